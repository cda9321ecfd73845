"""`pagedllm serve`: the OpenAI-compatible server from the command line.

pagedllm serve --model path/or/gguf --port 8000 --api-key secret
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..cli_generate import add_engine_arguments, engine_kwargs
from ..engine.client import DEFAULT_STALL_SECONDS
from ..engine.structured_outputs import DEFAULT_COMPILE_TIMEOUT_S
from .app import DEFAULT_MAX_QUEUE_LEN
from .guard import DEFAULT_MAX_BODY_BYTES

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    add_engine_arguments(parser)
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name", default=None, help="the name clients pass as `model`"
    )
    parser.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)"
    )
    parser.add_argument(
        "--max-queue-len",
        type=int,
        default=DEFAULT_MAX_QUEUE_LEN,
        help="sequences running + waiting before new requests get 503 "
        f"(default {DEFAULT_MAX_QUEUE_LEN})",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413",
    )
    parser.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=DEFAULT_COMPILE_TIMEOUT_S,
        help="seconds a response_format or forced tool call may take to compile; past it "
        f"the request gets 400 (default {DEFAULT_COMPILE_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--report-cached-tokens",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="report prefix-cache hits in usage (prompt_tokens_details.cached_tokens); "
        "--no-report-cached-tokens on a server shared by tenants",
    )
    parser.add_argument(
        "--health-stall-timeout",
        type=float,
        default=DEFAULT_STALL_SECONDS,
        help="/health answers 503 once an engine step has run this many seconds "
        f"(default {DEFAULT_STALL_SECONDS:g})",
    )
    parser.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic status line (the engine logs one every 5 s while busy)",
    )
    parser.add_argument("--uvicorn-log-level", default="warning")
    parser.add_argument(
        "--embedding-model",
        default=None,
        help="an embedding model served by /v1/embeddings beside --model (a folder, hub id "
        "or GGUF file; its own engine, default settings)",
    )
    parser.add_argument(
        "--embedding-served-model-name",
        default=None,
        help="the name clients pass as `model` to /v1/embeddings",
    )
    parser.add_argument(
        "--runner",
        default="auto",
        choices=["auto", "generate", "pooling"],
        help="pooling: serve --model as an embedding model only (/v1/embeddings); an "
        "encoder (BERT) is one under auto too",
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..engine.config import EngineConfig
    from ..engine.factory import create_engine
    from .app import create_app

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        logger.warning(
            "binding %s without --api-key: anyone who can reach it can use it", args.host
        )
    try:
        config = EngineConfig.from_kwargs(
            **engine_kwargs(args),
            served_model_name=args.served_model_name,
            disable_log_stats=args.disable_log_stats,
            runner=args.runner,
        )
        embedding_config = None
        if args.embedding_model is not None:
            embedding_config = EngineConfig.from_kwargs(
                model=args.embedding_model,
                device=args.device,
                served_model_name=args.embedding_served_model_name,
                disable_log_stats=args.disable_log_stats,
            )
        engine = create_engine(config)
    except ValueError as error:
        print(f"pagedllm serve: {error}", file=sys.stderr)
        return 2
    embedding_engine = None
    if embedding_config is not None:
        try:
            embedding_engine = create_engine(embedding_config)
        except ValueError as error:
            engine.shutdown()
            print(f"pagedllm serve: --embedding-model: {error}", file=sys.stderr)
            return 2
    try:
        app = create_app(
            engine,
            served_model_name=args.served_model_name,
            api_key=args.api_key,
            max_queue_len=args.max_queue_len,
            max_body_bytes=args.max_body_bytes,
            compile_timeout=args.grammar_compile_timeout,
            report_cached_tokens=args.report_cached_tokens,
            health_stall_timeout=args.health_stall_timeout,
            embedding_engine=embedding_engine,
            embedding_model_name=args.embedding_served_model_name,
        )
        logger.info("serving %s on http://%s:%d/v1", engine.model_name, args.host, args.port)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    finally:
        engine.shutdown()
        if embedding_engine is not None:
            embedding_engine.shutdown()
    return 0
