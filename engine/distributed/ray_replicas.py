"""Data-parallel replicas on Ray behind the `EngineClient` surface every front end uses.

    caller threads / event loops
      RayReplicaEngine.add_request -> validate, tokenize, compile a grammar here (InputProcessor,
                                      as AsyncEngine): one frozen EngineRequest
        client event-loop thread: PrefixAwareRouter picks a replica
          ReplicaActor.generate(EngineRequest) (num_returns="streaming") -> lists of
            RequestOutputs; the replica builds its state from the request as it is
        -> the caller's RequestStream (sync or async iteration, .result())

A replica that dies (actor killed, node lost) is replaced by a new actor; each request it
held is retried once on another replica (see replica_job.py for how a stream resumes).

`ray.init(address=...)` joins a running cluster (argument, else `$RAY_ADDRESS`); with
neither, a local cluster is started for this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import queue
import threading
from typing import Any

from ..async_engine import EngineDeadError, RequestError, RequestStream
from ..client import DEFAULT_STALL_SECONDS, EngineClient, ModelInfo
from ..config import EngineConfig
from ..engine_request import EngineRequest
from ..input_processor import InputProcessor
from ..metrics import SchedulerStats
from .ray_actor import ReplicaActor, ReplicaFailure
from .replica_job import ReplicaJob
from .replica_stats import ReplicaCounters, sum_stats
from .router import PrefixAwareRouter

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT = 900.0
# With every replica down, a request waits this long for a replacement, then fails.
NO_REPLICA_WAIT_S = 5.0
_HEALTH_POLL_S = 2.0  # how often the client asks each replica's engine how it is
_HEALTH_ANSWER_S = 10.0
_live_engines: set[int] = set()  # ids of RayReplicaEngines that started Ray and still run


class _ReplicaDead(Exception):
    """The replica's actor answers but its engine is gone: replace it like a dead actor."""


def _ray():
    try:
        import ray
    except ImportError as error:
        raise ValueError(
            "data-parallel replicas need Ray: pip install 'ray>=2.40' on every node"
        ) from error
    return ray


@dataclasses.dataclass(slots=True)
class _Replica:
    actor: Any
    info: dict


class RayReplicaEngine(EngineClient):
    """`config.data_parallel_size` engines as Ray actors, used like one AsyncEngine (an
    `EngineClient`). Requests are validated and tokenized here, on the caller's thread,
    with the model facts a replica reports; the model itself lives only in the replicas."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        address: str | None = None,
        num_replicas: int | None = None,
        router_policy: str = "prefix",
        num_cpus_per_replica: float = 1.0,
        num_gpus_per_replica: float | None = None,
        ray_init_kwargs: dict[str, Any] | None = None,
    ):
        ray = _ray()
        self.config = config
        self.num_replicas = num_replicas or config.data_parallel_size
        self._owns_ray = False
        if not ray.is_initialized():
            address = address or os.environ.get("RAY_ADDRESS")
            kwargs = dict(ray_init_kwargs or {})
            if address:
                ray.init(address=address, **kwargs)
            else:
                kwargs.setdefault(
                    "num_cpus",
                    max(os.cpu_count() or 1, int(self.num_replicas * num_cpus_per_replica)),
                )
                kwargs.setdefault("include_dashboard", False)
                ray.init(**kwargs)
            self._owns_ray = True
        if num_gpus_per_replica is None:
            wants_cuda = config.device.startswith("cuda") or (
                config.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0
            )
            num_gpus_per_replica = float(config.tensor_parallel_size) if wants_cuda else 0.0
        self._replica_config = dataclasses.replace(
            config, data_parallel_size=1, distributed_executor_backend=None
        )
        self._actor_class = ray.remote(ReplicaActor).options(
            num_cpus=num_cpus_per_replica, num_gpus=num_gpus_per_replica, max_concurrency=1000
        )
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        self._jobs: dict[str, ReplicaJob] = {}
        self._stopped = False
        self.replicas_replaced = 0
        self.requests_retried = 0
        self.requests_resumed = 0  # retried ones that continued a stream the caller had seen
        actors = [
            self._actor_class.remote(self._replica_config, i) for i in range(self.num_replicas)
        ]
        try:
            infos = ray.get([a.info.remote() for a in actors], timeout=_STARTUP_TIMEOUT)
            tokenizer = ray.get(actors[0].tokenizer.remote())
        except Exception as error:
            for actor in actors:
                ray.kill(actor)
            raise RuntimeError(f"a Ray replica failed to start: {error}") from error
        self._replicas = [_Replica(a, info) for a, info in zip(actors, infos)]
        self.router = PrefixAwareRouter(
            self.num_replicas, block_size=infos[0]["block_size"], policy=router_policy
        )
        first = infos[0]
        info = ModelInfo(
            name=first["model_name"],
            max_model_len=first["max_model_len"],
            vocab_size=first["vocab_size"],
            eos_token_ids=tuple(first["eos_token_ids"]),
            block_size=first["block_size"],
            architecture=first.get("architecture"),
            generation_defaults=dict(first.get("generation_defaults") or {}),
        )
        self._inputs = InputProcessor(config, tokenizer, info)
        self._stat_loggers: list = []
        self._counters = ReplicaCounters(self)
        self._loop = asyncio.new_event_loop()
        self._available = asyncio.Event()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="pagedllm-ray-client", daemon=True
        )
        self._thread.start()
        self._loop.call_soon_threadsafe(self._available.set)
        self._stall_after = DEFAULT_STALL_SECONDS
        self._replica_problems: list[str | None] = [None] * self.num_replicas
        asyncio.run_coroutine_threadsafe(self._watch_health(), self._loop)
        if self._owns_ray:
            _live_engines.add(id(self))
        logger.info(
            "%d Ray replicas of %s on %s",
            self.num_replicas,
            info.name,
            sorted({i["host"] for i in infos}),
        )

    # ------------------------------------------------------------------ state
    @property
    def counters(self) -> ReplicaCounters:
        return self._counters

    def scheduler_stats(self) -> SchedulerStats:
        """Every live replica's scheduler stats, summed (KV usage averaged)."""
        return sum_stats(self._on_replicas("scheduler_stats"))

    def reset_prefix_cache(self) -> bool:
        return all(self._on_replicas("reset_prefix_cache"))

    def save_prefix(self, prompt, cache_salt: str | None = None) -> int:
        """Every live replica computes the prompt and writes its blocks (a directory shared
        by replicas on one machine gets each file once); the fewest tokens any saved."""
        if self.config.prefix_cache_dir is None:
            raise ValueError("save_prefix needs a prefix-cache directory: set prefix_cache_dir")
        ray = _ray()
        live = [r for i, r in enumerate(self._replicas) if self.router.available[i]]
        return min(
            ray.get([r.actor.save_prefix.remote(prompt, cache_salt) for r in live], timeout=600)
        )

    def num_total_blocks(self) -> int:
        return sum(r.info["num_blocks"] for r in self._replicas)

    def add_stat_logger(self, stat_logger) -> None:
        """Registered loggers get every replica's steps, polled once a second."""
        self._stat_loggers.append(stat_logger)
        if len(self._stat_loggers) == 1:
            asyncio.run_coroutine_threadsafe(self._forward_stats(), self._loop)

    def remove_stat_logger(self, stat_logger) -> None:
        if stat_logger in self._stat_loggers:
            self._stat_loggers.remove(stat_logger)

    def _on_replicas(self, method: str, timeout: float = 60.0) -> list:
        """Call a method on every live replica and wait (any thread but the client's)."""
        ray = _ray()
        live = [r for i, r in enumerate(self._replicas) if self.router.available[i]]
        return ray.get([getattr(r.actor, method).remote() for r in live], timeout=timeout)

    def set_router_policy(self, policy: str) -> None:
        """A fresh router with `policy` ("prefix" | "round_robin"); call it while idle."""
        router = PrefixAwareRouter(
            self.num_replicas, block_size=self.router.block_size, policy=policy
        )
        router.available = list(self.router.available)
        self.router = router

    def num_free_blocks(self) -> int:
        return sum(self._on_replicas("num_free_blocks"))

    def submit_many(self, requests, loop=None, sink=None) -> list[RequestStream]:
        return [self.submit(request, loop=loop, sink=sink) for request in requests]

    @property
    def is_running(self) -> bool:
        """True while the router's event-loop thread runs (not shut down)."""
        return self._thread.is_alive() and not self._stopped

    def health(self, stall_after: float = DEFAULT_STALL_SECONDS) -> str | None:
        """None while some replica serves; else why none does (from flags the client keeps:
        replica availability and each replica's last health answer)."""
        self._stall_after = stall_after
        if not self.is_running:
            return "the engine is not running"
        live = [i for i, ok in enumerate(self.router.available) if ok]
        if not live:
            return "no replica is available (replacements are starting)"
        problems = [self._replica_problems[i] for i in live]
        if all(problem is not None for problem in problems):
            return f"no replica is healthy: {problems[0]}"
        return None

    # ---------------------------------------------------------------- requests
    def submit(
        self,
        request: EngineRequest,
        loop: asyncio.AbstractEventLoop | None = None,
        sink: queue.Queue | None = None,
    ) -> RequestStream:
        stream = RequestStream(request.request_id, loop=loop, sink=sink)
        job = ReplicaJob(request, stream)
        with self._lock:
            if self._stopped:
                raise EngineDeadError("the engine has been shut down")
            if request.request_id in self._jobs:
                raise ValueError(f"request id {request.request_id!r} is already in flight")
            self._jobs[request.request_id] = job
        asyncio.run_coroutine_threadsafe(self._drive(job), self._loop)
        return stream

    def abort(self, request_id: str) -> None:
        self._loop.call_soon_threadsafe(self._abort, request_id)

    def _abort(self, request_id: str) -> None:
        job = self._jobs.get(request_id)
        if job is None:
            return
        job.aborted = True
        if job.replica is not None:
            self._replicas[job.replica].actor.abort.remote(request_id)

    # -------------------------------------------------------- the client loop
    async def _drive(self, job: ReplicaJob) -> None:
        ray = _ray()
        exclude: set[int] = set()
        try:
            while True:
                index, hashes = await self._choose(job, exclude)
                replica = self._replicas[index]
                self.router.started(index, hashes)
                job.replica, job.attempts = index, job.attempts + 1
                try:
                    refs = replica.actor.generate.options(num_returns="streaming").remote(
                        job.next_request()
                    )
                    if job.aborted:  # aborted while it was being routed
                        replica.actor.abort.remote(job.request_id)
                    async for ref in refs:
                        for item in await ref:
                            if isinstance(item, ReplicaFailure) and item.kind == "dead":
                                raise _ReplicaDead(item.message)
                            if self._deliver(job, item):
                                return
                    raise RuntimeError("the replica's stream ended without a final output")
                except (
                    ray.exceptions.RayActorError,
                    ray.exceptions.ActorUnavailableError,
                    _ReplicaDead,
                ) as err:
                    self._replica_died(index, replica, err)
                    if job.aborted:
                        self._finish(job, job.abort_output())
                        return
                    reason = job.prepare_retry(self.tokenizer)
                    if reason is not None:
                        self._finish(job, RequestError(f"request {job.request_id} failed: its "
                                                       f"replica died and {reason}"))  # fmt: skip
                        return
                    self.requests_retried += 1
                    self.requests_resumed += job.base is not None
                    exclude.add(index)
                    logger.warning("replica %d died; retrying request %s", index, job.request_id)
                finally:
                    self.router.finished(index)
                    job.replica = None
        except Exception as error:
            logger.exception("request %s failed in the replica client", job.request_id)
            self._finish(job, RequestError(f"request {job.request_id} failed: {error}"))

    async def _choose(self, job: ReplicaJob, exclude: set[int]) -> tuple[int, list[int]]:
        deadline = self._loop.time() + NO_REPLICA_WAIT_S
        while True:
            try:
                return self.router.choose(job.prompt_token_ids, job.request.cache_salt, exclude)
            except RuntimeError:  # every replica is down: wait for a replacement
                self._available.clear()
                remaining = deadline - self._loop.time()
                if remaining <= 0:
                    raise
                try:
                    await asyncio.wait_for(self._available.wait(), timeout=remaining)
                except TimeoutError:
                    raise RuntimeError(
                        f"no replica is available (none came back within {NO_REPLICA_WAIT_S:g} s)"
                    ) from None

    def _deliver(self, job: ReplicaJob, item) -> bool:
        """Hand one item to the caller; True when the request is over."""
        if isinstance(item, ReplicaFailure):
            error: Exception = (
                ValueError(item.message)
                if item.kind == "invalid"
                else RequestError(f"request {job.request_id} failed: {item.message}")
            )
            self._finish(job, error)
            return True
        output = job.stitch(item)
        if output.finished:
            self._finish(job, output)
            return True
        job.stream.put(output)
        return False

    def _finish(self, job: ReplicaJob, item) -> None:
        with self._lock:
            self._jobs.pop(job.request_id, None)
        job.stream.put(item)

    def _replica_died(self, index: int, replica: _Replica, error: Exception) -> None:
        if self._replicas[index] is not replica or not self.router.available[index]:
            return  # already being replaced
        logger.error("Ray replica %d died (%r); starting a replacement", index, error)
        self.router.set_available(index, False)
        self._replica_problems[index] = None
        with contextlib.suppress(Exception):  # an actor whose engine died is still up
            _ray().kill(replica.actor)
        self._loop.create_task(self._replace(index))

    async def _watch_health(self) -> None:
        """Ask each live replica's engine how it is: one whose engine is gone is replaced
        before a request finds out; a wedged one is remembered for `health`."""
        while not self._stopped:
            await asyncio.sleep(_HEALTH_POLL_S)
            for index, replica in enumerate(list(self._replicas)):
                if self._stopped or not self.router.available[index]:
                    continue
                running = True
                try:
                    ref = replica.actor.health.remote(self._stall_after)
                    running, problem = await asyncio.wait_for(ref, timeout=_HEALTH_ANSWER_S)
                except TimeoutError:
                    problem = f"replica {index} did not answer its health check"
                except Exception as error:  # the actor died: the next request replaces it
                    problem = f"replica {index} is unreachable: {type(error).__name__}"
                if self._replicas[index] is not replica:
                    continue  # replaced meanwhile
                self._replica_problems[index] = problem
                if not running:
                    self._replica_died(index, replica, _ReplicaDead(problem or "engine gone"))

    async def _replace(self, index: int) -> None:
        ray = _ray()
        while not self._stopped:
            actor = self._actor_class.remote(self._replica_config, index)
            try:
                info = await actor.info.remote()
            except Exception:
                logger.exception("replacement for replica %d failed; trying again", index)
                ray.kill(actor)
                await asyncio.sleep(5)
                continue
            if self._stopped:
                ray.kill(actor)
                return
            self._replicas[index] = _Replica(actor, info)
            self.router.set_available(index, True)
            self.replicas_replaced += 1
            self._available.set()
            logger.info("replica %d replaced (pid %s on %s)", index, info["pid"], info["host"])
            return

    async def _forward_stats(self) -> None:
        """Feed registered stat loggers each replica step, with the summed scheduler stats."""
        while not self._stopped:
            await asyncio.sleep(1.0)
            live = [r for i, r in enumerate(self._replicas) if self.router.available[i]]
            try:
                drained = await asyncio.gather(*(r.actor.drain_stats.remote() for r in live))
            except Exception:  # a replica died; its own stats are gone with it
                continue
            latest = [items[-1][0] for items in drained if items]
            if not latest:
                continue
            total = sum_stats(latest)
            for items in drained:
                for _, iteration in items:
                    for stat_logger in list(self._stat_loggers):
                        stat_logger.record(total, iteration)

    # ---------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            jobs = list(self._jobs.values())
            self._jobs.clear()
        ray = _ray()
        for job in jobs:
            job.stream.put(EngineDeadError("the engine has been shut down"))
        for replica in self._replicas:
            with contextlib.suppress(Exception):  # already gone
                ray.kill(replica.actor)
        asyncio.run_coroutine_threadsafe(_stop_loop(), self._loop)
        self._thread.join(timeout=10)
        _live_engines.discard(id(self))
        if self._owns_ray and not _live_engines and ray.is_initialized():
            ray.shutdown()


async def _stop_loop() -> None:
    """End the client loop's tasks (request drivers, the stats and health watchers), then
    the loop: a loop stopped with tasks pending warns about each one."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    asyncio.get_running_loop().stop()
