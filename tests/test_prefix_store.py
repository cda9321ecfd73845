"""The block files of the disk prefix cache on their own: round trip, every check that
refuses a file, the directory's size limit (least recently used first), writers that die
or race. Real files in a temporary folder; no model."""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pagedllm_integrations.engine.prefix_store import (
    BlockRecord,
    PrefixStore,
    block_file_name,
    prefix_digests,
)

SHAPE = (2, 2, 64)  # layers, key/value, elements: 256 bf16 values = 512 bytes
PAYLOAD_BYTES = 512


def make_store(root: Path, fingerprint: str = "f" * 32, max_bytes: int = 1 << 30) -> PrefixStore:
    return PrefixStore(
        root, f"model-{fingerprint}", fingerprint, {"model_name": "test"}, "bfloat16", SHAPE,
        max_bytes,
    )  # fmt: skip


def block(index: int) -> tuple[BlockRecord, np.ndarray]:
    tokens = list(range(index * 16, index * 16 + 16))
    record = BlockRecord(1000 + index, tuple(tokens), prefix_digests(7, tokens, 1, 16)[0])
    payload = np.random.default_rng(index).integers(0, 256, PAYLOAD_BYTES, dtype=np.uint8)
    return record, payload


def write(store: PrefixStore, *indexes: int) -> None:
    records, payloads = zip(*(block(i) for i in indexes))
    assert store.submit(list(records), np.stack(payloads), wait=True).result() == len(indexes)
    store.flush()  # and the eviction after it


def read(store: PrefixStore, index: int) -> np.ndarray | None:
    out = np.zeros(PAYLOAD_BYTES, dtype=np.uint8)
    return out if store.read(block(index)[0], out) else None


def test_a_block_reads_back_exactly_and_only_as_the_block_it_names(tmp_path, caplog):
    store = make_store(tmp_path)
    write(store, 0)
    record, payload = block(0)
    assert np.array_equal(read(store, 0), payload)
    assert read(store, 1) is None  # no such file: quietly a miss
    assert not caplog.records

    # Asked under its own name for another prefix, dtype or shape: refused and removed.
    for wrong, why in [
        (BlockRecord(record.block_hash, record.token_ids[::-1], record.prefix_digest),
         "another prefix"),
        (BlockRecord(record.block_hash, record.token_ids, "0" * 32), "another prefix"),
    ]:  # fmt: skip
        write(store, 0)
        with caplog.at_level(logging.WARNING):
            assert not store.read(wrong, np.zeros(PAYLOAD_BYTES, dtype=np.uint8))
        assert why in caplog.text
        assert not store.path_of(record.block_hash).exists()
    write(store, 0)
    other_shape = PrefixStore(
        tmp_path, store.folder.name, store.fingerprint, {}, "bfloat16", (2, 2, 32), 1 << 30
    )
    with caplog.at_level(logging.WARNING):
        assert not other_shape.read(record, np.zeros(PAYLOAD_BYTES // 2, dtype=np.uint8))
    assert "payload bfloat16 [2, 2, 64], expected bfloat16 [2, 2, 32]" in caplog.text


def test_garbage_under_a_block_name_is_refused(tmp_path, caplog):
    store = make_store(tmp_path)
    path = store.path_of(block(0)[0].block_hash)
    for content, why in [
        (b"", "truncated"),
        (b"GGUF" + bytes(600), "not a pagedllm KV block file"),
    ]:
        path.write_bytes(content)
        with caplog.at_level(logging.WARNING):
            assert read(store, 0) is None
        assert why in caplog.text and not path.exists()


def test_the_size_limit_evicts_the_least_recently_used_files_of_every_model(tmp_path):
    probe = make_store(tmp_path / "probe")
    write(probe, 0)
    one_file = probe.path_of(block(0)[0].block_hash).stat().st_size
    store = make_store(tmp_path / "cache", max_bytes=int(one_file * 2.5))
    neighbour = make_store(tmp_path / "cache", fingerprint="e" * 32, max_bytes=1 << 30)
    write(neighbour, 0)  # another model's file in the same directory counts too
    write(store, 1)
    now = time.time()
    os.utime(neighbour.path_of(block(0)[0].block_hash), (now - 300, now - 300))
    os.utime(store.path_of(block(1)[0].block_hash), (now - 200, now - 200))
    write(store, 2)  # three files: over the limit; the oldest goes
    assert not neighbour.path_of(block(0)[0].block_hash).exists()
    os.utime(store.path_of(block(2)[0].block_hash), (now - 100, now - 100))
    assert read(store, 1) is not None  # a read makes it the most recently used
    write(store, 3)
    names = sorted(p.name for p in (tmp_path / "cache").rglob("*.kv"))
    assert names == sorted(block_file_name(block(i)[0].block_hash) for i in (1, 3))
    assert store.files_evicted == 2


def test_a_write_in_progress_is_never_read_and_a_dead_writers_leftovers_go(tmp_path):
    store = make_store(tmp_path)
    record, payload = block(0)
    final = store.path_of(record.block_hash)
    stale = final.with_name(f".{final.name}.999.dead.tmp")
    fresh = final.with_name(f".{final.name}.998.busy.tmp")
    for leftover in (stale, fresh):
        leftover.write_bytes(payload.tobytes()[:100])  # half a file, under a temporary name
    assert read(store, 0) is None  # the final name does not exist yet
    two_hours_ago = time.time() - 7200
    os.utime(stale, (two_hours_ago, two_hours_ago))
    write(store, 0)  # the first write scans the directory
    assert not stale.exists() and fresh.exists()
    assert np.array_equal(read(store, 0), payload)


def test_writers_racing_on_one_block_leave_one_whole_file(tmp_path):
    stores = [make_store(tmp_path) for _ in range(4)]
    records, payloads = zip(*(block(i) for i in range(8)))
    barrier = threading.Barrier(len(stores))

    def race(store: PrefixStore) -> None:
        barrier.wait()
        store.submit(list(records), np.stack(payloads), wait=True).result()

    threads = [threading.Thread(target=race, args=(s,)) for s in stores]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for index in range(8):
        assert np.array_equal(read(stores[0], index), payloads[index])
    assert not list(tmp_path.rglob("*.tmp"))


def test_a_directory_that_cannot_be_written_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ValueError, match="cannot be used"):
        make_store(blocker)


def test_blocks_move_out_of_and_into_the_kv_cache_unchanged():
    import torch

    from pagedllm_integrations.engine.disk_prefix_cache import gather_blocks, scatter_blocks

    torch.manual_seed(0)
    # The fast path's layout: k [blocks, Hkv, D, block_size], v [blocks, Hkv, block_size, D].
    caches = [
        (torch.randn(12, 2, 8, 16).bfloat16(), torch.randn(12, 2, 16, 8).bfloat16())
        for _ in range(3)
    ]
    source = [5, 6, 7, 2, 9, 10]  # runs of consecutive ids and single ones
    data = gather_blocks(caches, source)  # [6, layers, 2, 256]
    assert data.shape == (6, 3, 2, 256)
    target = [0, 1, 11, 3, 4, 8]
    fresh = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in caches]
    scatter_blocks(fresh, target, data)
    for (k, v), (k2, v2) in zip(caches, fresh):
        for src, dst in zip(source, target):
            assert torch.equal(k2[dst], k[src]) and torch.equal(v2[dst], v[src])
        untouched = sorted(set(range(12)) - set(target))
        assert not k2[untouched].any() and not v2[untouched].any()
