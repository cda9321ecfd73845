"""Defaults of the server's limits, timeouts and shutdown grace period, in a module that
imports nothing of the server extra (FastAPI, Starlette), so that `pagedllm serve --help`
shows them where the extra is not installed."""

from __future__ import annotations

DEFAULT_MAX_QUEUE_LEN = 512  # sequences running + waiting before new requests get 503
# Sequences one client (clients.py) may have running + waiting: a quarter of the queue, so one
# client's large request never fills the server.
DEFAULT_MAX_SEQS_PER_CLIENT = DEFAULT_MAX_QUEUE_LEN // 4
DEFAULT_MAX_BODY_BYTES = 4 << 20  # request bodies larger than this get 413
DEFAULT_HEADER_TIMEOUT_S = 10.0  # a request head must arrive within this
DEFAULT_BODY_TIMEOUT_S = 30.0  # a request body must arrive within this
DEFAULT_KEEP_ALIVE_S = 5.0  # an idle connection between requests is closed after this
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # SIGTERM: running requests get this long to finish
