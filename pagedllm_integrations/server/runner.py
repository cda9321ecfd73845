"""uvicorn, configured the one way `pagedllm serve` and `ThreadedServer` both run it: the
guarded h11 protocol (connections.py) and a shutdown with a grace period.

Shutdown (SIGTERM, SIGINT, or `request_shutdown()`):
1. stop admitting: the listening sockets close, idle connections close, /health and new
   requests on open connections answer 503;
2. the requests already running get `shutdown_timeout` seconds to finish;
3. then every one still running is aborted in the engine: a stream ends cleanly (its last
   chunk has finish_reason "abort", then `data: [DONE]`), a plain request answers with
   what it had;
4. uvicorn waits for the connections to close (a last backstop cancels what is left).
A second signal skips the grace period: what runs is aborted at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from collections.abc import Iterator
from types import FrameType

import uvicorn
from fastapi import FastAPI

from .connections import ConnectionLimits, guarded_protocol
from .defaults import DEFAULT_SHUTDOWN_TIMEOUT_S

logger = logging.getLogger(__name__)

# After the abort, how long uvicorn waits for the ended responses to go out before it
# cancels what is left (an aborted stream needs one more engine step to end).
_AFTER_ABORT_S = 10.0
_POLL_S = 0.05


def server_config(
    app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"
) -> uvicorn.Config:
    """The uvicorn configuration for `app`: the connection limits create_app was given, on
    the guarded h11 protocol."""
    limits = getattr(app.state, "connection_limits", None) or ConnectionLimits()
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        http=guarded_protocol(limits),
        timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type]
        timeout_graceful_shutdown=_AFTER_ABORT_S,  # type: ignore[arg-type]
    )


class GracefulServer(uvicorn.Server):
    """uvicorn's server with pagedllm's shutdown (see the module's docstring)."""

    def __init__(
        self, config: uvicorn.Config, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    ):
        if not 0 <= shutdown_timeout < float("inf"):
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {shutdown_timeout!r}")
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self.abort_now = threading.Event()  # a second signal: no grace period

    def request_shutdown(self) -> None:
        """What a signal does: the first starts the shutdown, the next aborts at once."""
        if self.should_exit:
            if not self.abort_now.is_set():
                logger.warning("second shutdown request: aborting the running requests now")
            self.abort_now.set()
        else:
            logger.info(
                "shutting down: no new requests; running ones get %gs", self.shutdown_timeout
            )
            self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.request_shutdown()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGTERM and SIGINT start the shutdown (and a second one hurries it). Unlike
        uvicorn's, the signal is not raised again afterwards: `serve` returns, so the
        engine is shut down properly by its caller."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        state = _server_state(self.config)
        if state is not None:
            state.draining = True
        for server in self.servers:  # stop accepting now, not after the grace period
            server.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()  # idle ones close; busy ones close after their response
        if state is not None:
            # in_flight counts requests still being prepared too: they get the grace period.
            deadline = time.monotonic() + self.shutdown_timeout
            while state.in_flight and not self.abort_now.is_set():
                if time.monotonic() >= deadline:
                    break
                await asyncio.sleep(_POLL_S)
            if state.open_calls:
                logger.warning("aborting %d running request(s) at shutdown", len(state.open_calls))
            state.abort_all()
        await super().shutdown(sockets)


def _server_state(config: uvicorn.Config):
    """The app's ServerState (serving.py), if the app is pagedllm's."""
    app = config.app
    state = getattr(getattr(app, "state", None), "server", None)
    return state if hasattr(state, "abort_all") else None
