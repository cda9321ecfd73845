"""`pagedllm serve`: the OpenAI-compatible server from the command line.

PAGEDLLM_API_KEY=secret pagedllm serve --model path/or/gguf --port 8000
pagedllm serve --model path/or/gguf --api-key-file /run/secrets/pagedllm-key
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..cli_generate import add_engine_arguments, engine_kwargs
from ..engine.client import DEFAULT_STALL_SECONDS
from ..engine.scheduler_policy import POLICY_NAMES
from ..engine.structured_outputs import DEFAULT_COMPILE_TIMEOUT_S
from .api_key import API_KEY_ENV, resolve_api_key
from .defaults import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_QUEUE_LEN,
    DEFAULT_MAX_SEQS_PER_CLIENT,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
)

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
        "--api-key-file",
        default=None,
        help="require 'Authorization: Bearer KEY' on all routes but /health, KEY read from "
        f"this file (one line); or set {API_KEY_ENV}",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="the key itself (visible to local users in `ps`: prefer --api-key-file or "
        f"{API_KEY_ENV})",
    )
    parser.add_argument(
        "--max-queue-len",
        type=int,
        default=DEFAULT_MAX_QUEUE_LEN,
        help="sequences running + waiting before new requests get 503 "
        f"(default {DEFAULT_MAX_QUEUE_LEN})",
    )
    parser.add_argument(
        "--max-seqs-per-client",
        type=int,
        default=DEFAULT_MAX_SEQS_PER_CLIENT,
        help="sequences one client (its `user` field, X-PagedLLM-User header, else its "
        "address) may have running + waiting; past it 429 for that client only, a larger "
        f"request is a 400 (default {DEFAULT_MAX_SEQS_PER_CLIENT}; 0: no per-client limit)",
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
        "--scheduling-policy",
        choices=POLICY_NAMES,
        default="fcfs",
        help="fcfs: first come, first served (default); priority: a request's `priority` "
        "field orders it (lower first), as in vLLM; short_first: the least remaining work "
        "(prompt + max_tokens) first, aged so that every wait is bounded",
    )
    parser.add_argument(
        "--allow-unknown-fields",
        action="store_true",
        help="accept (and ignore) request fields no known server defines; by default they "
        "are a 400 naming them",
    )
    add_connection_arguments(parser)
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


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    """Timeouts, connection caps and shutdown (server/connections.py, server/runner.py)."""
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a request head may take to arrive, from the connection opening or the "
        f"previous response (default {DEFAULT_HEADER_TIMEOUT_S:g}); past it: 408 and close",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help=f"seconds a request body may take to arrive (default {DEFAULT_BODY_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=DEFAULT_KEEP_ALIVE_S,
        help="seconds an idle connection is kept between requests "
        f"(default {DEFAULT_KEEP_ALIVE_S:g})",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections at most, past it 503 (default: the open-file limit less 64; "
        "0: no cap)",
    )
    parser.add_argument(
        "--max-connections-per-client",
        type=int,
        default=None,
        help="open connections from one address, past it 429 (default: half of "
        "--max-connections, at most 256; 0: no cap; behind a proxy every client has the "
        "proxy's address)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        help="on SIGTERM, seconds running requests get to finish before they are aborted "
        f"(default {DEFAULT_SHUTDOWN_TIMEOUT_S:g}; a second SIGTERM aborts at once)",
    )


def run(args: argparse.Namespace) -> int:
    from ..engine.config import EngineConfig
    from ..engine.factory import create_engine
    from .app import create_app
    from .connections import ConnectionLimits
    from .runner import GracefulServer, server_config

    try:
        api_key = resolve_api_key(args.api_key, args.api_key_file)
        limits = ConnectionLimits(
            header_timeout=args.header_timeout,
            body_timeout=args.body_timeout,
            keep_alive_timeout=args.keep_alive_timeout,
            max_connections=args.max_connections,
            max_connections_per_client=args.max_connections_per_client,
        )
        if args.max_seqs_per_client < 0:
            raise ValueError(
                f"--max-seqs-per-client must be >= 0 (0: no limit), got {args.max_seqs_per_client}"
            )
        if not 0 <= args.shutdown_timeout < float("inf"):
            raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    except ValueError as error:
        print(f"pagedllm serve: {error}", file=sys.stderr)
        return 2
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        logger.warning(
            "binding %s without an API key: anyone who can reach it can use it", args.host
        )
    try:
        config = EngineConfig.from_kwargs(
            **engine_kwargs(args),
            served_model_name=args.served_model_name,
            disable_log_stats=args.disable_log_stats,
            scheduling_policy=args.scheduling_policy,
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
            api_key=api_key,
            max_queue_len=args.max_queue_len,
            max_seqs_per_client=args.max_seqs_per_client or None,
            max_body_bytes=args.max_body_bytes,
            compile_timeout=args.grammar_compile_timeout,
            report_cached_tokens=args.report_cached_tokens,
            health_stall_timeout=args.health_stall_timeout,
            connection_limits=limits,
            allow_unknown_fields=args.allow_unknown_fields,
            embedding_engine=embedding_engine,
            embedding_model_name=args.embedding_served_model_name,
        )
        uvicorn_config = server_config(app, args.host, args.port, args.uvicorn_log_level)
        logger.info("serving %s on http://%s:%d/v1", engine.model_name, args.host, args.port)
        GracefulServer(uvicorn_config, shutdown_timeout=args.shutdown_timeout).run()
    finally:
        engine.shutdown()
        if embedding_engine is not None:
            embedding_engine.shutdown()
    return 0
