"""`pagedllm serve` in a process of its own, for the slow server tests: the default model,
an API key from a file, and 256 file descriptors (issue 43's conditions)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import closing

import httpx

LIMITED_SERVE = (
    "import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256)); "
    "from pagedllm_integrations.cli import main; sys.exit(main(sys.argv[1:]))"
)


class Served:
    """Started on a free loopback port; `stop()` kills it if it still runs."""

    def __init__(self, tmp_path, *arguments: str):
        self.key = "k-" + os.urandom(8).hex()
        key_file = tmp_path / "api-key"
        key_file.write_text(self.key + "\n")
        key_file.chmod(0o600)
        with closing(socket.socket()) as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = (tmp_path / "serve.log").open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-P", "-c", LIMITED_SERVE, "serve", "--port", str(self.port),
             "--api-key-file", str(key_file), "--max-model-len", "2048",
             "--kv-cache-memory", str(1 << 30), "--max-num-seqs", "128", *arguments],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        self.headers = {"Authorization": f"Bearer {self.key}"}
        for _ in range(600):
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert self.process.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        raise AssertionError("pagedllm serve did not start")

    def client(self, source: str = "127.0.0.1") -> httpx.Client:
        transport = httpx.HTTPTransport(local_address=source)
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=600,
                            transport=transport)  # fmt: skip

    def stop(self) -> int:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        code = self.process.wait(60)
        self.log.close()
        return code
