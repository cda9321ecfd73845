"""The block files of the disk prefix cache on their own: round trip, every check that
refuses a file, the directory's size limit (least recently used first), writers that die
or race. Real files in a temporary folder; no model."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import shutil
import stat
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import xxhash

from pagedllm_integrations.engine.prefix_store import (
    BlockRecord,
    PrefixStore,
    block_file_name,
    prefix_digests,
    read_header,
)
from pagedllm_integrations.engine.private_dir import KEY_FILE

# The documented head of a block file: magic, key id, header bytes, payload bytes.
PREFIX = struct.Struct("<8s16sIQ")
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
    neighbour = make_store(tmp_path, fingerprint="e" * 32)  # the same directory and key
    write(neighbour, 0)
    record, payload = block(0)
    # What a writer has written of the file when it dies.
    head = neighbour.path_of(record.block_hash).read_bytes()[:100]
    store = make_store(tmp_path)
    final = store.path_of(record.block_hash)
    stale = final.with_name(f".{final.name}.999.dead.tmp")
    fresh = final.with_name(f".{final.name}.998.busy.tmp")
    for leftover in (stale, fresh):
        leftover.write_bytes(head)  # half a file, under a temporary name
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


# ------------------------------------------- issue 43: a disk cache that trusts nothing
def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_files_are_private_and_hold_no_token_id(tmp_path):
    root = tmp_path / "cache"
    store = make_store(root)
    write(store, 0)
    record, _ = block(0)
    path = store.path_of(record.block_hash)
    assert (mode(root), mode(store.folder)) == (0o700, 0o700)
    assert mode(path) == mode(store.folder / "model.json") == mode(root / KEY_FILE) == 0o600
    header = read_header(path)
    assert set(header) == {"fingerprint", "block_hash", "prefix_mac", "dtype", "shape"}
    data = path.read_bytes()
    tokens = np.asarray(record.token_ids, dtype=np.int64)
    for encoding in (tokens.tobytes(), tokens.astype(np.int32).tobytes(),
                     json.dumps(list(record.token_ids)).encode()):  # fmt: skip
        assert encoding not in data


def test_a_folder_other_users_can_write_is_refused(tmp_path):
    root = tmp_path / "shared"
    root.mkdir(mode=0o777)
    root.chmod(0o777)
    with pytest.raises(ValueError, match="can be written by other users"):
        make_store(root)
    root.chmod(0o755)  # a folder of the user's that others may read: used as it is
    store = make_store(root)
    assert mode(root) == 0o755
    store.folder.chmod(0o775)
    with pytest.raises(ValueError, match="can be written by other users"):
        make_store(root)
    store.folder.chmod(0o755)  # the model folder is the cache's own: made private
    make_store(root)
    assert mode(store.folder) == 0o700
    (root / KEY_FILE).chmod(0o644)
    with pytest.raises(ValueError, match="mode 600"):
        make_store(root)


def forge(path: Path, payload: bytes, key: bytes) -> None:
    """Rewrite a block file with another payload and a MAC under `key`."""
    data = path.read_bytes()
    _, _, header_len, _ = PREFIX.unpack_from(data)
    head = data[: PREFIX.size + header_len]
    body = head + payload
    path.write_bytes(body + hmac.new(key, body, hashlib.sha256).digest())


def test_a_forged_or_foreign_block_file_is_refused(tmp_path, caplog):
    store = make_store(tmp_path)
    record, payload = block(0)
    path = store.path_of(record.block_hash)
    forged = bytes(PAYLOAD_BYTES)  # other keys and values under the block's own name
    cases = [
        # A checksum that anyone can recompute (the file format before keys did this).
        (lambda: legacy_file(path, record, forged), "not a pagedllm KV block file"),
        # The whole format, with a MAC under a key that is not the directory's.
        (lambda: forge(path, forged, b"k" * 32), "checksum mismatch"),
        # A real file of another cache directory (another key), copied in.
        (lambda: path.write_bytes(other_directory_file(tmp_path)), "this cache directory's key"),
    ]
    for make, why in cases:
        write(store, 0)
        make()
        with caplog.at_level(logging.WARNING):
            assert read(store, 0) is None
        assert why in caplog.text
        assert not path.exists()
    write(store, 0)
    assert np.array_equal(read(store, 0), payload)


def legacy_file(path: Path, record: BlockRecord, payload: bytes) -> None:
    """A block file of the format before keys: token ids in clear, a plain xxh3 checksum."""
    header = json.dumps({"fingerprint": "f" * 32, "block_hash": record.block_hash,
                         "token_ids": list(record.token_ids), "dtype": "bfloat16",
                         "shape": list(SHAPE)}).encode()  # fmt: skip
    body = struct.pack("<8sIQ", b"PAGEDKV1", len(header), len(payload)) + header + payload
    path.write_bytes(body + xxhash.xxh3_128(body).digest())


def other_directory_file(tmp_path: Path) -> bytes:
    other = make_store(tmp_path / "elsewhere")
    write(other, 0)
    return other.path_of(block(0)[0].block_hash).read_bytes()


def test_eviction_deletes_only_files_the_cache_wrote(tmp_path):
    probe = make_store(tmp_path / "probe")
    write(probe, 0)
    one_file = probe.path_of(block(0)[0].block_hash).stat().st_size
    root = tmp_path / "cache"
    store = make_store(root, max_bytes=int(one_file * 2.5))
    old = time.time() - 7200
    users = [
        root / "project" / "notes.kv",
        root / "project" / "download.tmp",
        store.folder / "notes.kv",
        store.folder / "download.tmp",
        store.folder / block_file_name(4242),  # a block's name, not the cache's content
        store.folder / f".{block_file_name(4243)}.1.dead.tmp",  # a writer's name, likewise
    ]
    for path in users:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"the user's own bytes" * 100)
        os.utime(path, (old, old))
    write(store, 1)
    os.utime(store.path_of(block(1)[0].block_hash), (old + 60, old + 60))
    write(store, 2)
    write(store, 3)  # over the limit: its own oldest file goes, nothing of the user's
    assert all(path.exists() for path in users)
    ours = {block_file_name(block(i)[0].block_hash): i for i in (1, 2, 3)}
    assert sorted(ours[p.name] for p in store.folder.iterdir() if p.name in ours) == [2, 3]
    assert store.files_evicted == 1


def test_links_are_never_followed(tmp_path, caplog):
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "cache"
    store = make_store(root, max_bytes=1 << 20)
    model = store.folder.name
    # A model folder that is a link (to a folder the size limit would not see): refused.
    shutil.rmtree(store.folder)
    (root / model).symlink_to(outside, target_is_directory=True)
    with pytest.raises(ValueError, match="symbolic link"):
        make_store(root)
    (root / model).unlink()
    store = make_store(root)
    # A block file that is a link to the user's file: never read, and never written through.
    record, payload = block(0)
    precious = outside / "precious.bin"
    precious.write_bytes(b"keep me" * 100)
    path = store.path_of(record.block_hash)
    path.symlink_to(precious)
    with caplog.at_level(logging.WARNING):
        assert read(store, 0) is None
    assert "a link is never followed" in caplog.text and not path.is_symlink()
    path.symlink_to(precious)
    write(store, 0)  # the link is replaced by a file, its target is untouched
    assert not path.is_symlink() and np.array_equal(read(store, 0), payload)
    assert precious.read_bytes() == b"keep me" * 100
    # A link as the key: refused.
    (root / KEY_FILE).unlink()
    (root / KEY_FILE).symlink_to(precious)
    with pytest.raises(ValueError, match="link"):
        make_store(root)
