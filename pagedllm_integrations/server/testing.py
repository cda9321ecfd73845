"""Run the real server (uvicorn) in a background thread on a free loopback port.

For tests, notebooks and examples that need an HTTP endpoint in the same process:

    with ThreadedServer(create_app(engine)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
"""

from __future__ import annotations

import threading
import time

import uvicorn
from fastapi import FastAPI


class ThreadedServer:
    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0):
        config = uvicorn.Config(
            app, host=host, port=port, log_level="warning", lifespan="on", timeout_keep_alive=30
        )
        self.app = app
        self.server = uvicorn.Server(config)
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

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> ThreadedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
