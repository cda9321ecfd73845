"""Run the real server (uvicorn) in a background thread on a free loopback port.

For tests, notebooks and examples that need an HTTP endpoint in the same process:

    with ThreadedServer(create_app(engine)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")

It runs exactly what `pagedllm serve` runs (runner.py): the guarded protocol, the app's
connection limits and the graceful shutdown; `stop()` is the shutdown a SIGTERM starts.
"""

from __future__ import annotations

import threading
import time

from fastapi import FastAPI

from .defaults import DEFAULT_SHUTDOWN_TIMEOUT_S
from .runner import GracefulServer, server_config


class ThreadedServer:
    def __init__(
        self,
        app: FastAPI,
        host: str = "127.0.0.1",
        port: int = 0,
        shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    ):
        config = server_config(app, host=host, port=port)
        self.app = app
        self.server = GracefulServer(config, shutdown_timeout=shutdown_timeout)
        self.thread = threading.Thread(target=self.server.run, name="pagedllm-http", daemon=True)
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.01)
        # Port 0 asked the OS for a free port: read back the one it gave.
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def request_shutdown(self) -> None:
        """What SIGTERM does to `pagedllm serve` (a second call: what a second SIGTERM does)."""
        self.server.request_shutdown()

    def stop(self, timeout: float = 60.0) -> None:
        self.server.request_shutdown()
        self.thread.join(timeout)

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
