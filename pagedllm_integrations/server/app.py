"""The FastAPI app: OpenAI's routes over one `AsyncEngine`, plus /health and /metrics.

from pagedllm_integrations.server.app import create_app
from pagedllm_integrations.server.runner import GracefulServer, server_config
app = create_app(engine, served_model_name="smol", api_key=None)
GracefulServer(server_config(app, host="127.0.0.1", port=8000)).run()
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..engine.client import DEFAULT_STALL_SECONDS, EngineClient
from ..engine.structured_outputs import DEFAULT_COMPILE_TIMEOUT_S
from .chat import create_chat_completion
from .clients import ClientAdmission
from .completions import create_completion
from .connections import ConnectionLimits
from .defaults import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_QUEUE_LEN, DEFAULT_MAX_SEQS_PER_CLIENT
from .embeddings import EmbeddingRequest, create_embedding, embedding_route
from .errors import APIError, GuardedRoute, install_error_handlers
from .guard import GuardMiddleware
from .metrics import PrometheusStatLogger
from .protocol import ChatCompletionRequest, CompletionRequest
from .serving import ServerLimits, ServerState

logger = logging.getLogger(__name__)

_STATS_TIMEOUT_S = 5.0


def engine_alive(engine: EngineClient) -> bool:
    return engine.is_running


def create_app(
    engine: EngineClient,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queue_len: int | None = DEFAULT_MAX_QUEUE_LEN,
    max_seqs_per_client: int | None = DEFAULT_MAX_SEQS_PER_CLIENT,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    compile_timeout: float | None = DEFAULT_COMPILE_TIMEOUT_S,
    report_cached_tokens: bool = True,
    health_stall_timeout: float = DEFAULT_STALL_SECONDS,
    connection_limits: ConnectionLimits | None = None,
    allow_unknown_fields: bool = False,
    embedding_engine: EngineClient | None = None,
    embedding_model_name: str | None = None,
) -> FastAPI:
    """An OpenAI-compatible app serving `engine`.

    served_model_name: the name clients pass as `model` (default: the engine's model name).
    api_key: when set, every route but /health needs `Authorization: Bearer <api_key>`.
    max_queue_len: sequences (running + waiting) admitted at once; past it a request gets 503.
    max_seqs_per_client: sequences one client (its `user` field, X-PagedLLM-User header or
        address; see clients.py) may have running + waiting; past it 429 for that client
        only, and a larger request is a 400. None: no per-client limit.
    max_body_bytes: larger request bodies get 413.
    compile_timeout: seconds a response_format or forced tool call may take to compile
        (past it: 400); None for no limit.
    report_cached_tokens: report prefix-cache hits in `usage` (turn off on a server shared
        by tenants that must not learn about each other's prompts; see also `cache_salt`).
    health_stall_timeout: /health answers 503 once an engine step has run this long.
    connection_limits: timeouts and connection caps (connections.py); the body timeout is
        applied here, the rest by the server that runs the app (runner.py).
    allow_unknown_fields: accept (and ignore) request fields no known server defines;
        by default they are a 400 naming them. Known fields pagedllm cannot honour are
        always a 400.
    embedding_engine: the engine behind /v1/embeddings (its name: embedding_model_name);
        None: `engine` itself where it embeds (server/embeddings.py).
    """
    if max_queue_len is not None and max_queue_len < 1:
        raise ValueError(f"max_queue_len must be >= 1 (or None for no limit), got {max_queue_len}")
    clients = ClientAdmission(max_seqs_per_client)  # ValueError for a bad limit
    if compile_timeout is not None and compile_timeout <= 0:
        raise ValueError(f"compile_timeout must be > 0 (or None), got {compile_timeout}")
    if health_stall_timeout <= 0:
        raise ValueError(f"health_stall_timeout must be > 0, got {health_stall_timeout}")
    model_name = served_model_name or engine.model_name
    metrics = PrometheusStatLogger(model_name)
    engine.add_stat_logger(metrics)
    connection_limits = connection_limits or ConnectionLimits()
    limits = ServerLimits(
        compile_timeout, report_cached_tokens, health_stall_timeout, allow_unknown_fields
    )
    state = ServerState(engine, model_name, metrics, max_queue_len, limits, clients=clients)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        for task in list(state.background):
            task.cancel()
        state.pool.shutdown(wait=False, cancel_futures=True)
        if engine_alive(engine):  # stop feeding this app's registry
            engine.remove_stat_logger(metrics)

    app = FastAPI(
        title="pagedllm", summary="OpenAI-compatible API over pagedllm", lifespan=lifespan
    )
    # Unexpected errors in a route answer a generic 500 there (see GuardedRoute).
    app.router.route_class = GuardedRoute
    app.state.server = state
    app.state.connection_limits = connection_limits
    install_error_handlers(app)
    app.add_middleware(
        GuardMiddleware,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        body_timeout=connection_limits.body_timeout,
    )

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(state, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(state, body, request)

    embeddings = embedding_route(state, engine, embedding_engine, embedding_model_name)

    @app.post("/v1/embeddings")
    async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
        if embeddings is None:
            raise APIError(
                400, f"{model_name} does not serve embeddings; start the server with "
                "--embedding-model to serve an embedding model beside it", param="model",
            )  # fmt: skip
        return await create_embedding(embeddings, body, request)

    def served() -> list[tuple[str, EngineClient]]:
        """(name, engine) of every model this server answers for."""
        models = [(model_name, engine)]
        if embeddings is not None and embeddings.engine is not engine:
            models.append((embeddings.model_name, embeddings.engine))
        return models

    def model_card(name: str, client: EngineClient) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": state.created,
            "owned_by": "pagedllm",
            "root": client.model_name,
            "parent": None,
            "max_model_len": client.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [model_card(name, client) for name, client in served()]
        return JSONResponse({"object": "list", "data": cards})

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str) -> JSONResponse:
        # As OpenAI's: the model object, or 404 with code model_not_found.
        for name, client in served():
            if model_id in (name, client.model_name):
                return JSONResponse(model_card(name, client))
        state.check_model(model_id)  # raises: no such model
        return JSONResponse(model_card(model_name, engine))

    @app.get("/health")
    async def health() -> JSONResponse:
        # Flags only, no engine call: it must answer at once however busy the engine is.
        if state.draining:  # a load balancer stops sending requests here
            raise APIError(503, "the server is shutting down", code="shutting_down")
        problem = engine.health(limits.health_stall_timeout)
        if problem is not None:
            raise APIError(503, problem)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        # The engine reports at every step; after the last step an abort can still change
        # the gauges, so take a fresh snapshot from the engine thread.
        if engine_alive(engine):
            try:
                stats = await asyncio.wait_for(
                    asyncio.to_thread(engine.scheduler_stats),
                    _STATS_TIMEOUT_S,
                )
                metrics.update_scheduler(stats)
            except TimeoutError:
                logger.warning("engine did not answer a stats request in %.0fs", _STATS_TIMEOUT_S)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
