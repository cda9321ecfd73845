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
# An idle connection between requests is closed after this: longer than the idle expiry
# of common client pools (httpx and the OpenAI SDK on it: 5 s; aiohttp: 15 s) and of load
# balancers in front (60 s), so the client closes an idle connection first. Closing at
# the client's own expiry races its next request on that connection (an httpx ReadError
# in benchmarks/latency_mix.py at 50% load, with uvicorn's 5 s). The connection caps
# (connections.py) bound what idle connections can hold.
DEFAULT_KEEP_ALIVE_S = 75.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # SIGTERM: running requests get this long to finish
