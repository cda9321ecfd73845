"""KV blocks on disk: the file format, one model's folder, the size limit, the writer thread.

A prefix-cache directory may be shared by any number of processes and models:

    <prefix_cache_dir>/
      SmolLM2-135M-Instruct-1f0c3a5e9b7d2c41.../   one folder per fingerprint (engine/kv_fingerprint.py)
        model.json                                 what the fingerprint stands for, readable
        3fa94c1d0b2e8a77.kv                        one full KV block, named by its chained hash
        .3fa94c1d0b2e8a77.kv.4242.9f1c.tmp         a write in progress (never read)

One block file, every integer little-endian:

    "PAGEDKV1" | header bytes (u32) | payload bytes (u64) | header (JSON) | payload | xxh3-128

The header names the fingerprint, the block's chained hash, its token ids, a 128-bit
digest of the whole prefix up to the block's end, and the payload's dtype and shape
[layers, 2 (key, value), elements of one block of one layer]; the payload is the block's
keys and values as the KV cache holds them; the last 16 bytes are the xxh3-128 digest of
everything before them.

Safety. A file is written under a temporary name and renamed into place (`os.replace` is
atomic), so a reader sees a whole file or none, whatever other processes do. Reading
checks the size, the checksum and every header field against what the engine expects
(fingerprint, hash, tokens, prefix digest, dtype, shape); a file that fails any check is
never loaded: it is logged, removed, and the lookup ends there. Files are not fsynced: a
file torn by a power cut fails its checksum.

Size limit. The whole directory (all models) is kept under `max_bytes` by deleting the
least recently used block files, oldest modification time first; a file's time is bumped
when it is read and when a writer finds it already there. Each process rescans the
directory when its own writes since the last scan would pass the limit, or a minute after
its last scan, so with several writers at once the limit holds within their last minute
of writes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import struct
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

logger = logging.getLogger(__name__)

MAGIC = b"PAGEDKV1"
_PREFIX = struct.Struct("<8sIQ")  # magic, header bytes, payload bytes
_DIGEST_BYTES = 16
SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_STALE_TMP_SECONDS = 3600.0  # a temporary file this old belongs to a writer that died
_RESCAN_SECONDS = 60.0
_EVICT_TO = 0.9  # evict down to this share of the limit, so that not every write rescans
# Automatic writes wait in memory for the writer thread; past this many bytes they are
# dropped (the disk is slower than the engine), explicit saves always wait their turn.
MAX_PENDING_BYTES = 1 << 30


@dataclass(slots=True)
class BlockRecord:
    """What names one block on disk, and what its file must say when it is read back."""

    block_hash: int  # the chained hash (engine/kv_cache_manager.py)
    token_ids: tuple[int, ...]  # the block's tokens
    prefix_digest: str  # hex xxh3-128 over the first block's hash and every token up to here


def prefix_digests(
    first_hash: int, token_ids: list[int], num_blocks: int, block_size: int
) -> list[str]:
    """One `BlockRecord.prefix_digest` per block: a 128-bit name of the whole prefix.

    The chained 64-bit hashes are confirmed in memory by the block's own tokens only; on
    disk, where blocks of many prompts and processes meet, the digest also confirms every
    token before them."""
    state = xxhash.xxh3_128(first_hash.to_bytes(8, "little"))
    tokens = np.asarray(token_ids[: num_blocks * block_size], dtype=np.int64)
    digests = []
    for index in range(num_blocks):
        state.update(tokens[index * block_size : (index + 1) * block_size].tobytes())
        digests.append(state.hexdigest())
    return digests


def block_file_name(block_hash: int) -> str:
    return f"{block_hash:016x}{SUFFIX}"


def read_header(path: Path) -> dict[str, Any]:
    """The JSON header of a block file (for tools and tests; no checks)."""
    with open(path, "rb") as f:
        _, header_len, _ = _PREFIX.unpack(f.read(_PREFIX.size))
        return json.loads(f.read(header_len))


@dataclass(slots=True)
class _WriteJob:
    records: list[BlockRecord]
    payloads: np.ndarray  # [n, bytes of one block] uint8
    future: Future
    counted: bool  # its bytes count against MAX_PENDING_BYTES


class PrefixStore:
    """One fingerprint's folder in a prefix-cache directory, and the directory's limit."""

    def __init__(
        self,
        root: str | os.PathLike,
        folder_name: str,
        fingerprint: str,
        description: dict[str, Any],
        payload_dtype: str,
        payload_shape: tuple[int, ...],
        max_bytes: int,
    ) -> None:
        self.root = Path(root)
        self.folder = self.root / folder_name
        self.fingerprint = fingerprint
        self.payload_dtype = payload_dtype
        self.payload_shape = list(payload_shape)
        self.max_bytes = max_bytes
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            marker = self.folder / "model.json"
            if not marker.exists():
                text = json.dumps(
                    {"fingerprint": fingerprint, **description}, indent=1, default=str
                )
                self._write_atomically(marker, text.encode())
            if not os.access(self.folder, os.W_OK | os.X_OK):
                raise PermissionError(f"{self.folder} is not writable")
        except OSError as error:
            raise ValueError(
                f"prefix_cache_dir {str(self.root)!r} cannot be used: {error}"
            ) from error
        self._lock = threading.Lock()
        self._jobs: deque[_WriteJob] = deque()
        self._thread: threading.Thread | None = None
        self._pending_bytes = 0
        self._scanned_bytes: int | None = None  # the directory's size at the last scan
        self._written_since_scan = 0
        self._last_scan = 0.0
        self.files_written = 0
        self.files_rejected = 0
        self.files_evicted = 0

    def path_of(self, block_hash: int) -> Path:
        return self.folder / block_file_name(block_hash)

    def exists(self, block_hash: int) -> bool:
        return self.path_of(block_hash).is_file()

    # ------------------------------------------------------------------- read
    def read(self, record: BlockRecord, out: np.ndarray) -> bool:
        """Fill `out` (uint8, one block's payload bytes) from the block's file; True when it
        passed every check. A missing file is False quietly; a bad one is logged, removed,
        and False."""
        path = self.path_of(record.block_hash)
        try:
            problem = self._read_checked(path, record, out)
        except FileNotFoundError:
            return False
        except OSError as error:
            problem = f"unreadable: {error}"
        if problem is None:
            with contextlib.suppress(OSError):
                os.utime(path)  # least recently used goes first
            return True
        self.files_rejected += 1
        logger.warning("prefix cache: skipped %s (%s); it will be computed instead", path, problem)
        with contextlib.suppress(OSError):
            path.unlink()
        return False

    def _read_checked(self, path: Path, record: BlockRecord, out: np.ndarray) -> str | None:
        """None when the file is whole and is the block asked for, else what is wrong."""
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(_PREFIX.size)
            if len(prefix) < _PREFIX.size:
                return "truncated"
            magic, header_len, payload_len = _PREFIX.unpack(prefix)
            if magic != MAGIC:
                return "not a pagedllm KV block file of this format version"
            if size != _PREFIX.size + header_len + payload_len + _DIGEST_BYTES:
                return f"truncated or padded: {size} bytes, its header announces more or fewer"
            header_bytes = f.read(header_len)
            try:
                header = json.loads(header_bytes)
            except ValueError:
                return "its header is not valid JSON"
            problem = self._check_header(header, record)
            if problem is not None:
                return problem
            if payload_len != out.nbytes:
                return f"payload of {payload_len} bytes, expected {out.nbytes}"
            if f.readinto(memoryview(out).cast("B")) != payload_len:
                return "truncated"
            stored_digest = f.read(_DIGEST_BYTES)
        state = xxhash.xxh3_128(prefix)
        state.update(header_bytes)
        state.update(memoryview(out).cast("B"))
        if state.digest() != stored_digest:
            return "checksum mismatch: the file is corrupt"
        return None

    def _check_header(self, header: Any, record: BlockRecord) -> str | None:
        if not isinstance(header, dict):
            return "its header is not a JSON object"
        if header.get("fingerprint") != self.fingerprint:
            return "written for another model, dtype or KV layout (fingerprint differs)"
        if (
            header.get("block_hash") != record.block_hash
            or tuple(header.get("token_ids") or ()) != record.token_ids
            or header.get("prefix_digest") != record.prefix_digest
        ):
            return "holds another prefix than its name says"
        if header.get("dtype") != self.payload_dtype or header.get("shape") != self.payload_shape:
            return f"payload {header.get('dtype')} {header.get('shape')}, expected {self.payload_dtype} {self.payload_shape}"
        return None

    # ------------------------------------------------------------------ write
    def submit(
        self, records: list[BlockRecord], payloads: np.ndarray, wait: bool = False
    ) -> Future:
        """Queue blocks for the writer thread: payloads [len(records), bytes] uint8, a copy
        the caller does not touch again. The future gives how many of them are on disk
        (written now or found there), or the OSError that stopped the writer.

        wait=False (automatic writes): dropped when MAX_PENDING_BYTES are already queued."""
        future: Future = Future()
        if not records:
            future.set_result(0)
            return future
        with self._lock:
            if not wait and self._pending_bytes + payloads.nbytes > MAX_PENDING_BYTES:
                logger.debug("prefix cache: writer behind, %d blocks not written", len(records))
                future.set_result(0)
                return future
            if not wait:
                self._pending_bytes += payloads.nbytes
            self._jobs.append(_WriteJob(records, payloads, future, counted=not wait))
            if self._thread is None:
                # Not a daemon: at interpreter exit, queued blocks are still written.
                self._thread = threading.Thread(target=self._run, name="pagedllm-prefix-writer")
                self._thread.start()
        return future

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued block is written (or the timeout passes)."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        """The writer thread: drain the queue, then end (an idle store keeps no thread)."""
        while True:
            with self._lock:
                if not self._jobs:
                    self._thread = None
                    return
                job = self._jobs.popleft()
            try:
                on_disk = sum(self._write_block(r, p) for r, p in zip(job.records, job.payloads))
            except Exception as error:  # the thread must not die with the future unset
                logger.warning("prefix cache: could not write to %s: %s", self.folder, error)
                job.future.set_exception(error)
            else:
                job.future.set_result(on_disk)
            finally:
                if job.counted:
                    with self._lock:
                        self._pending_bytes -= job.payloads.nbytes
            try:
                self._evict_if_needed()
            except OSError as error:
                logger.warning("prefix cache: could not scan %s: %s", self.root, error)

    def _write_block(self, record: BlockRecord, payload: np.ndarray) -> int:
        path = self.path_of(record.block_hash)
        if path.exists():  # written before, by us or another process: now recently used
            try:
                os.utime(path)
                return 1
            except OSError:  # evicted meanwhile: write it again
                pass
        header = json.dumps(
            {
                "fingerprint": self.fingerprint,
                "block_hash": record.block_hash,
                "token_ids": list(record.token_ids),
                "prefix_digest": record.prefix_digest,
                "dtype": self.payload_dtype,
                "shape": self.payload_shape,
            }
        ).encode()
        prefix = _PREFIX.pack(MAGIC, len(header), payload.nbytes)
        state = xxhash.xxh3_128(prefix)
        state.update(header)
        state.update(memoryview(payload).cast("B"))
        self._write_atomically(path, prefix, header, payload.data, state.digest())
        size = len(prefix) + len(header) + payload.nbytes + _DIGEST_BYTES
        self._written_since_scan += size
        self.files_written += 1
        return 1

    @staticmethod
    def _write_atomically(path: Path, *parts: Any) -> None:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{_TMP_SUFFIX}")
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    # --------------------------------------------------------------- eviction
    def _evict_if_needed(self) -> None:
        now = time.monotonic()
        due = self._scanned_bytes is None or now - self._last_scan > _RESCAN_SECONDS
        if not due and self._scanned_bytes + self._written_since_scan <= self.max_bytes:  # type: ignore[operator]
            return
        files, total = self._scan()
        self._last_scan, self._written_since_scan = now, 0
        if total > self.max_bytes:
            files.sort()  # oldest modification time first
            target = int(self.max_bytes * _EVICT_TO)
            for _, size, path in files:
                if total <= target:
                    break
                try:
                    os.unlink(path)
                    total -= size
                    self.files_evicted += 1
                except FileNotFoundError:
                    total -= size  # another process evicted it first
                except OSError as error:
                    logger.warning("prefix cache: could not evict %s: %s", path, error)
        self._scanned_bytes = total

    def _scan(self) -> tuple[list[tuple[float, int, str]], int]:
        """Every block file under the root: (mtime, size, path), and their total size.
        Removes temporary files that writers which died left behind."""
        files: list[tuple[float, int, str]] = []
        total = 0
        wall = time.time()
        with os.scandir(self.root) as folders:
            for folder in folders:
                if not folder.is_dir(follow_symlinks=False):
                    continue
                with os.scandir(folder.path) as entries:
                    for entry in entries:
                        try:
                            stat = entry.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        if entry.name.endswith(SUFFIX):
                            files.append((stat.st_mtime, stat.st_size, entry.path))
                            total += stat.st_size
                        elif (
                            entry.name.endswith(_TMP_SUFFIX)
                            and wall - stat.st_mtime > _STALE_TMP_SECONDS
                        ):
                            with contextlib.suppress(OSError):
                                os.unlink(entry.path)
        return files, total
