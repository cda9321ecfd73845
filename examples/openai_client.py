"""The official OpenAI client against `pagedllm serve`: a completion, a streamed chat and a
tool call.

    python examples/openai_client.py                     # starts a server on a free port
    python examples/openai_client.py --base-url http://127.0.0.1:8000/v1   # uses yours
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.request

import openai

SERVED_NAME = "pagedllm-example"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve(model: str | None, timeout: float = 300.0):
    """`pagedllm serve` as a subprocess; yields its /v1 URL once /health answers."""
    port = free_port()
    command = [sys.executable, "-m", "pagedllm_integrations.cli", "--log-level", "WARNING",
               "serve", "--port", str(port), "--served-model-name", SERVED_NAME,
               "--max-model-len", "1024", "--kv-cache-memory", str(256 << 20)]  # fmt: skip
    if model:
        command += ["--model", model]
    process = subprocess.Popen(command)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise SystemExit(f"pagedllm serve exited with {process.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("pagedllm serve did not come up in time") from None
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def demo(base_url: str, model: str, api_key: str, max_tokens: int) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=api_key)

    completion = client.completions.create(
        model=model, prompt="The three primary colours are", max_tokens=max_tokens, temperature=0
    )
    print("completion:", repr(completion.choices[0].text), completion.usage)

    print("chat: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Write a haiku about paged memory."}],
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            print(f"\n  usage: {chunk.usage}")

    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    response = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What's the weather in Paris?"}],
        tools=[weather],
        tool_choice="required",
        max_tokens=max(max_tokens, 48),
        temperature=0,
    )
    call = response.choices[0].message.tool_calls[0]
    print("tool call:", call.function.name, json.loads(call.function.arguments))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default=None, help="a running server's /v1 URL")
    parser.add_argument("--model", default=None, help="model for the server this starts")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    if args.base_url:
        served = openai.OpenAI(base_url=args.base_url, api_key=args.api_key).models.list()
        demo(args.base_url, served.data[0].id, args.api_key, args.max_tokens)
        return 0
    with serve(args.model) as base_url:
        demo(base_url, SERVED_NAME, args.api_key, args.max_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
