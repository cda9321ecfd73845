"""The prefix cache that survives a restart: KV blocks of recurring prompts, on disk.

With `prefix_cache_dir` set, the in-memory prefix cache (engine/kv_cache_manager.py) gets
a second level. File reads and writes run on threads of their own; the rest on the engine
thread:

    LLMEngine.add_request(request)       before the request is ever scheduled
      DiskPrefixCache.begin_load         its prompt's full blocks, in chain order: those in
                                         memory are held; from the first that is not, each
                                         one found on disk gets a fresh block, held; the first
                                         one missing ends the walk. The reader thread reads
                                         and checks (prefix_store) the files and copies them
                                         into their fresh blocks; meanwhile the request waits
                                         outside the scheduler and the others' steps go on
    LLMEngine.step(), once read          DiskPrefixCache.finish_load: the blocks read are
                                         registered under their hashes and every held block
                                         is freed to the cached end of the free queue; then
                                         the request joins the scheduler
    Scheduler.schedule()                 finds them as ordinary prefix-cache hits: they count
                                         as cached tokens in usage, and are not computed
    KVCacheManager.allocate_slots        each hit is counted per block (hit_listener); a
                                         block's second hit queues it for the disk
    LLMEngine.step() after the forward   DiskPrefixCache.after_step(): the queued blocks are
                                         copied out of the KV cache (one gather per layer)
                                         and handed to the writer thread, which writes,
                                         renames into place and evicts (prefix_store)

So a block is written once it has been a prefix-cache hit twice in one process (the third
request that shares it), or when `save_prefix(prompt)` asks. Hits of a sample on its
siblings' blocks (`n` > 1) and of a preempted request on its own do not count.

What the engine thread pays. A load reads each block's file and checks its keyed MAC (for
SmolLM2-135M one block of 16 tokens is 360 KiB: a 2,000-token prompt is 45 MiB, tens of
milliseconds from the page cache, as much again for HMAC-SHA256 at ~0.7 GB/s, and far
more from a cold disk), then copies it into the KV cache (the first touch of those pages
too); all of that runs on the reader thread, overlapped with the steps of the other
requests, and the engine thread only takes the blocks and registers their hashes.
Writes cost the engine thread only the copy out of the KV cache; the files are written by
a thread of their own (prefix_store.PrefixStore).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .block_pool import KVCacheBlock, consecutive_runs
from .kv_cache_manager import KVCacheManager
from .kv_fingerprint import kv_fingerprint
from .prefix_store import BlockRecord, PrefixStore, prefix_digests
from .request import Request

logger = logging.getLogger(__name__)

PERSIST_AFTER_HITS = 2  # "prompts that were hit more than once"
_MAX_COUNTED_BLOCKS = 1 << 16  # per-block hit counts kept (least recently hit dropped)
_MAX_KNOWN_ON_DISK = 1 << 20


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src for two tensors of one shape and dtype. On the CPU as a numpy copy of
    their bytes: torch's copy_ of a large CPU tensor is an OpenMP parallel region, and on
    a busy machine every such region waits for a core (the 60 copies of a 2,000-token
    load took 1 s instead of 0.1 s with the other core taken)."""
    if dst.device.type == "cpu" and src.device.type == "cpu":
        np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())
    else:
        dst.copy_(src)


def gather_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int]
) -> torch.Tensor:
    """Copy blocks out of the KV cache: [n, layers, 2, elements of one block] on the CPU."""
    k0 = kv_caches[0][0]
    out = torch.empty((len(block_ids), len(kv_caches), 2, k0[0].numel()), dtype=k0.dtype)
    for position, first, length in consecutive_runs(block_ids):
        rows = out[position : position + length]
        for layer, (k, v) in enumerate(kv_caches):
            _copy(rows[:, layer, 0], k[first : first + length].reshape(length, -1).cpu())
            _copy(rows[:, layer, 1], v[first : first + length].reshape(length, -1).cpu())
    return out


def scatter_blocks(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_ids: list[int], data: torch.Tensor
) -> None:
    """Write blocks into the KV cache: data [n, layers, 2, elements] from gather_blocks."""
    data = data.to(kv_caches[0][0].device)
    for position, first, length in consecutive_runs(block_ids):
        rows = data[position : position + length]
        for layer, (k, v) in enumerate(kv_caches):
            _copy(k[first : first + length].view(length, -1), rows[:, layer, 0])
            _copy(v[first : first + length].view(length, -1), rows[:, layer, 1])


@dataclass(slots=True)
class PendingLoad:
    """A request's prefix blocks being read from disk (DiskPrefixCache.begin_load). Every
    block here is held (a reference) until `finish_load`, even if the request is aborted
    meanwhile: the reader thread writes the fresh ones."""

    request: Request
    hashes: list[int]  # the chained hashes of the prompt's full blocks
    resident: list[tuple[int, KVCacheBlock]]  # (block index, block) already in memory
    fresh: list[tuple[int, KVCacheBlock]]  # (block index, block) the files are read into
    future: Future  # -> how many of `fresh`, from the first, were read, checked and copied


class DiskPrefixCache:
    """The engine's disk level of the prefix cache (one per engine, on its thread)."""

    def __init__(
        self,
        store: PrefixStore,
        kv: KVCacheManager,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        k0, v0 = kv_caches[0]
        assert all(
            k.shape[1:] == k0.shape[1:] and v.shape[1:] == v0.shape[1:] for k, v in kv_caches
        )
        assert k0[0].numel() == v0[0].numel() and k0.dtype == v0.dtype
        self.store = store
        self.kv = kv
        self.kv_caches = kv_caches
        self.payload_shape = (len(kv_caches), 2, k0[0].numel())
        self._hit_counts: OrderedDict[int, int] = OrderedDict()
        self._queued: list[BlockRecord] = []  # to write after this step's forward pass
        self._saves: list[tuple[Request, Future]] = []  # save_when_computed, not yet computed
        self._on_disk: set[int] = set()  # hashes loaded or queued by this engine
        self.loaded_tokens = 0  # cumulative, for SchedulerStats
        # Block files are read and checked here, beside the steps (begin_load).
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-prefix-reader")
        kv.hit_listener = self._count_hits

    @classmethod
    def create(
        cls,
        directory: str,
        max_bytes: int,
        kv: KVCacheManager,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        **fingerprint_inputs: Any,
    ) -> DiskPrefixCache:
        """Open (or make) this model's folder in `directory`; ValueError if it cannot be used."""
        fingerprint, folder_name, description = kv_fingerprint(
            block_size=kv.block_size, kv_caches=kv_caches, **fingerprint_inputs
        )
        k0 = kv_caches[0][0]
        store = PrefixStore(
            directory,
            folder_name,
            fingerprint,
            description,
            payload_dtype=str(k0.dtype).removeprefix("torch."),
            payload_shape=(len(kv_caches), 2, k0[0].numel()),
            max_bytes=max_bytes,
        )
        logger.info(
            "prefix cache on disk: %s (up to %.1f GiB)", store.folder, max_bytes / (1 << 30)
        )
        return cls(store, kv, kv_caches)

    @property
    def folder(self) -> Path:
        return self.store.folder

    def _tokens(self, request: Request, index: int) -> tuple[int, ...]:
        size = self.kv.block_size
        return tuple(request.all_token_ids[index * size : (index + 1) * size])

    # ------------------------------------------------------------------- load
    def begin_load(self, request: Request) -> PendingLoad | None:
        """Engine thread: find the blocks of `request`'s prompt that are on disk and not in
        memory, and start reading them on the reader thread. None when there are none (or
        looking failed: that costs only the tokens it would have saved)."""
        try:
            return self._begin_load(request)
        except Exception:
            logger.exception("prefix cache: looking in %s failed; computing instead", self.folder)
            return None

    def _begin_load(self, request: Request) -> PendingLoad | None:
        size, pool = self.kv.block_size, self.kv.pool
        num_blocks = (request.num_tokens - 1) // size  # the last token is always computed
        if num_blocks <= 0:
            return None
        hashes = self.kv.full_block_hashes(request, num_blocks * size)
        resident: list[tuple[int, KVCacheBlock]] = []
        wanted: list[int] = []  # block indices, in chain order
        for index in range(num_blocks):
            block = pool.lookup(hashes[index], self._tokens(request, index))
            if block is not None:
                resident.append((index, block))
            elif self.store.exists(hashes[index]):
                wanted.append(index)
            else:
                break
        # Hold the resident blocks first, so that taking fresh ones cannot evict them.
        pool.touch([block for _, block in resident])
        held = [block for _, block in reversed(resident)]  # freed prefix-last if it fails
        wanted = wanted[: pool.num_free_blocks]
        if not wanted:
            pool.free_blocks(held)
            return None
        fresh: list[KVCacheBlock] = []
        try:
            fresh = pool.get_new_blocks(len(wanted))  # held, unhashed: nobody else writes them
            digests = prefix_digests(hashes[0], request.all_token_ids, wanted[-1] + 1, size)
            records = [BlockRecord(hashes[i], self._tokens(request, i), digests[i]) for i in wanted]
            future = self._reader.submit(self._read_blocks, records, [b.block_id for b in fresh])
        except BaseException:
            pool.free_blocks([*fresh, *held])
            raise
        return PendingLoad(request, hashes, resident, list(zip(wanted, fresh)), future)

    def _read_blocks(self, records: list[BlockRecord], block_ids: list[int]) -> int:
        """Reader thread: read and check the files in chain order, and copy those that pass
        into their blocks of the KV cache (held by the PendingLoad: nothing else touches
        them). How many of them, from the first, passed (a missing or refused one ends the
        run: a chain)."""
        staging = torch.empty((len(records), *self.payload_shape), dtype=self.kv_caches[0][0].dtype)
        raw = staging.view(torch.uint8).numpy()  # [n, layers, 2, bytes]
        passed = len(records)
        for slot, record in enumerate(records):
            if not self.store.read(record, raw[slot]):
                passed = slot
                break
        if passed:
            scatter_blocks(self.kv_caches, block_ids[:passed], staging[:passed])
        return passed

    def finish_load(self, pending: PendingLoad) -> int:
        """Engine thread, once `pending.future` is done: register the blocks read under
        their hashes and free every block the load held (the chain's to the cached end of
        the free queue); the scheduler then hits them like any other. Returns the tokens
        loaded."""
        pool = self.kv.pool
        loaded: list[tuple[int, KVCacheBlock]] = []
        try:
            num_read = pending.future.result()
            loaded = pending.fresh[:num_read]
            for index, block in loaded:
                pool.cache_block(block, pending.hashes[index], self._tokens(pending.request, index))
                self._remember_on_disk(pending.hashes[index])
        except Exception:
            logger.exception("prefix cache: loading from %s failed; computing instead", self.folder)
            for _, block in loaded:  # their contents may not be what their hashes say
                pool.uncache(block)
            loaded = []
        finally:
            unread = [block for _, block in pending.fresh[len(loaded) :]]
            chain = sorted(pending.resident + loaded, key=lambda pair: pair[0])
            pool.free_blocks([*unread, *reversed([block for _, block in chain])])
        self.loaded_tokens += len(loaded) * self.kv.block_size
        logger.debug(
            "prefix cache: %d blocks of %s read from disk", len(loaded), pending.request.request_id
        )
        return len(loaded) * self.kv.block_size

    # ------------------------------------------------------------------ write
    def _count_hits(self, request: Request, hits: list[KVCacheBlock]) -> None:
        """KVCacheManager.hit_listener: hits are the request's first len(hits) blocks."""
        if request.sample_index or request.num_preemptions:
            return
        digests: list[str] | None = None
        for index, block in enumerate(hits):
            block_hash = block.block_hash
            if block_hash is None or block_hash in self._on_disk:
                continue
            count = self._hit_counts.pop(block_hash, 0) + 1
            if count < PERSIST_AFTER_HITS:
                self._hit_counts[block_hash] = count
                if len(self._hit_counts) > _MAX_COUNTED_BLOCKS:
                    self._hit_counts.popitem(last=False)
                continue
            if digests is None:
                digests = prefix_digests(
                    request.block_hashes[0], request.all_token_ids, len(hits), self.kv.block_size
                )
            self._queued.append(BlockRecord(block_hash, block.token_ids or (), digests[index]))
            self._remember_on_disk(block_hash)

    def after_step(self) -> None:
        """Hand the blocks queued during this step to the writer (their keys and values are
        in the cache now that the forward pass ran), and save the prompts asked for."""
        if self._queued:
            records, self._queued = self._queued, []
            try:
                self._write(records, wait=False)
            except Exception:
                logger.exception("prefix cache: copying blocks for %s failed", self.folder)
        for request, future in list(self._saves):
            if request.num_computed_tokens < request.num_prompt_tokens and not request.is_finished:
                continue
            self._saves.remove((request, future))
            if request.error is not None or request.num_computed_tokens < request.num_prompt_tokens:
                future.set_result(0)  # the request failed or was aborted: nothing to save
                continue
            try:
                tokens, written = self.save(request)
            except Exception as error:
                future.set_exception(error)
                continue
            written.add_done_callback(lambda done, f=future, t=tokens: _chain(done, f, t))  # type: ignore[misc]

    def save_when_computed(self, request: Request, future: Future | None = None) -> Future:
        """Save `request`'s prompt (see `save`) right after the step that computes it, while
        its blocks are certainly cached. The future (`future`, or a new one) gives its
        tokens now on disk."""
        future = Future() if future is None else future
        self._saves.append((request, future))
        return future

    def save(self, request: Request) -> tuple[int, Future]:
        """Write every full block of a computed prompt: (tokens in them, a future that is
        done when the files are). Blocks already on disk are kept (and marked recently
        used)."""
        size = self.kv.block_size
        num_blocks = request.num_prompt_tokens // size
        if num_blocks == 0:
            return 0, _done(0)
        hashes = self.kv.full_block_hashes(request, num_blocks * size)
        digests = prefix_digests(hashes[0], request.all_token_ids, num_blocks, size)
        records = [
            BlockRecord(hashes[index], self._tokens(request, index), digests[index])
            for index in range(num_blocks)
        ]
        written, future = self._write(records, wait=True)
        for record in written:
            self._remember_on_disk(record.block_hash)
        return len(written) * size, future

    def _write(self, records: list[BlockRecord], wait: bool) -> tuple[list[BlockRecord], Future]:
        """Copy out the blocks that are still cached and queue them for the writer thread.

        wait (an explicit save): stop at the first block no longer cached, so that what is
        written is a whole prefix, and never drop the write."""
        found: list[BlockRecord] = []
        block_ids: list[int] = []
        for record in records:
            block = self.kv.pool.lookup(record.block_hash, record.token_ids)
            if block is None:  # evicted meanwhile, or its step failed
                if wait:
                    break
                continue
            found.append(record)
            block_ids.append(block.block_id)
        if not found:
            return found, _done(0)
        payloads = gather_blocks(self.kv_caches, block_ids)
        raw = payloads.view(torch.uint8).numpy().reshape(len(found), -1)
        return found, self.store.submit(found, raw, wait=wait)

    def _remember_on_disk(self, block_hash: int) -> None:
        if len(self._on_disk) >= _MAX_KNOWN_ON_DISK:
            self._on_disk.clear()
        self._on_disk.add(block_hash)

    @property
    def written_tokens(self) -> int:
        """Tokens in the block files this engine wrote (not those it found already there)."""
        return self.store.files_written * self.kv.block_size

    def close(self, timeout: float = 60.0) -> None:
        """Wait for the queued writes (at engine shutdown); end the reader."""
        self._reader.shutdown(wait=True, cancel_futures=True)
        self.store.flush(timeout)


def _chain(done: Future, future: Future, tokens: int) -> None:
    error = done.exception()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(tokens)


def _done(value: int) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future
