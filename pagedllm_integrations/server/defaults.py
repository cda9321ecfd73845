"""Defaults of the server's limits, in a module that imports nothing of the server extra
(FastAPI, Starlette), so that `pagedllm serve --help` shows them where the extra is not
installed."""

from __future__ import annotations

DEFAULT_MAX_QUEUE_LEN = 512  # sequences running + waiting before new requests get 503
DEFAULT_MAX_BODY_BYTES = 4 << 20  # request bodies larger than this get 413
