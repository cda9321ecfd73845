"""Building engines, and the registry that lets every wrapper share one.

`create_engine(config)` builds a new engine: in this process (`AsyncEngine`), or replicas
on Ray when the config asks for them (`RayReplicaEngine`). `shared_engine(config)` gives
every caller with equal settings the same engine: one copy of the weights, one batch, one
prefix cache.

A shared engine lives until it is released:

- wrappers (`ChatPagedLLM`, `PagedLLM`, `PagedLlamaIndexLLM`) take it with an owner
  (`shared_engine(config, owner=self)`) and give it back with `close()`; when the last
  owner has closed, the engine is shut down and its weights and KV cache are freed;
- an engine taken without an owner (a direct `shared_engine(config)` call) is pinned: it
  stays until `shutdown_shared_engines()`, which shuts every shared engine down.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .client import EngineClient
from .config import EngineConfig


def create_engine(config: EngineConfig) -> EngineClient:
    """A new engine for `config`: in this process, or replicas on Ray when it asks for them."""
    if config.distributed_executor_backend == "ray":
        from .distributed.ray_replicas import RayReplicaEngine

        return RayReplicaEngine(config)
    from .async_engine import AsyncEngine

    return AsyncEngine(config)


@dataclass(slots=True)
class _Entry:
    engine: EngineClient
    owners: set[int] = field(default_factory=set)  # id() of the wrappers holding it
    pinned: bool = False  # taken without an owner: kept until shutdown_shared_engines()


_shared: dict[tuple, _Entry] = {}
_lock = threading.Lock()


def shared_engine(config: EngineConfig, owner: object | None = None) -> EngineClient:
    """The engine every caller with these settings shares, created on first use.

    With `owner`, the engine is held for that object until `release_shared_engine(config,
    owner)`; without, it stays until `shutdown_shared_engines()`.
    """
    key = config.cache_key()
    with _lock:
        entry = _shared.get(key)
        if entry is None or not entry.engine.is_running:
            entry = _Entry(create_engine(config))
            _shared[key] = entry
        if owner is None:
            entry.pinned = True
        else:
            entry.owners.add(id(owner))
        return entry.engine


def release_shared_engine(config: EngineConfig, owner: object) -> bool:
    """`owner` no longer needs the shared engine of `config`. When no owner is left and
    nobody took it without one, the engine is shut down (weights and KV cache freed).
    True when this call shut it down."""
    key = config.cache_key()
    with _lock:
        entry = _shared.get(key)
        if entry is None or id(owner) not in entry.owners:
            return False
        entry.owners.discard(id(owner))
        if entry.owners or entry.pinned:
            return False
        del _shared[key]
    entry.engine.shutdown()
    return True


def shutdown_shared_engines() -> None:
    """Shut down every shared engine and free its memory. Wrappers still in use load a
    fresh engine on their next call."""
    with _lock:
        entries = list(_shared.values())
        _shared.clear()
    for entry in entries:
        entry.engine.shutdown()
