"""`pagedllm serve | generate | chat | bench | quantize | top`.

Each subcommand lives with the code it drives and is imported only when used, so
`pagedllm generate` never imports the web server and `pagedllm serve` never imports the
quantizer.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

logger = logging.getLogger(__name__)

# subcommand -> (module relative to this package, help). Each module defines
# `add_arguments(parser)` and `run(args) -> int`.
SUBCOMMANDS = {
    "generate": ("cli_generate", "generate a completion for a prompt"),
    "chat": ("cli_generate", "chat with a model in the terminal"),
    "serve": ("server.cli", "run the OpenAI-compatible HTTP server"),
    "top": ("server.top", "live view of a running server's /metrics"),
    "bench": ("engine.bench", "throughput benchmark against transformers"),
    "quantize": ("cli_quantize", "quantize a model to AWQ INT4"),
}


# Modules an optional extra brings, and the extra's name.
EXTRAS = {
    "fastapi": "server",
    "starlette": "server",
    "uvicorn": "server",
    "prometheus_client": "server",
    "httpx": "server",
    "orjson": "server",
    "langchain_core": "langchain",
    "llama_index": "llama-index",
    "ray": "ray",
}


def _missing_extra(command: str, error: ModuleNotFoundError) -> str | None:
    """One line naming the extra that brings the missing module, or None if none does."""
    extra = EXTRAS.get((error.name or "").split(".")[0])
    if extra is None:
        return None
    return (
        f"pagedllm {command} needs the [{extra}] extra ({error.name} is not installed): "
        f"pip install 'pagedllm[{extra}]'"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text)
        if name == chosen:  # only the chosen subcommand's module is imported
            try:
                module = importlib.import_module(f".{module_name}", __package__)
            except ModuleNotFoundError as error:
                hint = _missing_extra(name, error)
                if hint is None:
                    raise
                print(hint, file=sys.stderr)
                return 2
            module.add_arguments(sub_parser, name)
            sub_parser.set_defaults(_module=module)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return int(args._module.run(args) or 0)
    except ModuleNotFoundError as error:  # an extra imported only when the command runs
        hint = _missing_extra(args.command, error)
        if hint is None:
            raise
        print(hint, file=sys.stderr)
        return 2
    except (ValueError, OSError) as error:
        # What a user can get wrong (a model name, a setting, a file): one line, not a
        # traceback; --log-level debug shows the traceback.
        logger.debug("pagedllm %s failed", args.command, exc_info=True)
        print(f"pagedllm {args.command}: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
