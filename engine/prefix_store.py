"""KV blocks on disk: the file format, one model's folder, the size limit, the writer thread.

A prefix-cache directory may be shared by any number of processes and models of one user:

    <prefix_cache_dir>/                            0700, this user's (engine/private_dir.py)
      .pagedllm-prefix-cache.key                   the directory's secret, 0600
      SmolLM2-135M-Instruct-1f0c3a5e9b7d2c41.../   one folder per fingerprint, 0700
        model.json                                 what the fingerprint stands for, as text
        3fa94c1d0b2e8a77.kv                        one full KV block, named by its chained hash
        .3fa94c1d0b2e8a77.kv.4242.9f1c3e5a.tmp     a write in progress (never read)

One block file (0600), every integer little-endian:

    "PAGEDKV2" | key id (16) | header bytes (u32) | payload bytes (u64) | header (JSON)
    | payload | HMAC-SHA256 (32) of everything before it, keyed by the directory's secret

The header names the fingerprint, the block's chained hash, a keyed digest of its prefix
(`prefix_mac`: HMAC of the 128-bit digest of every token up to the block's end and of the
block's own tokens; no token id is stored), and the payload's dtype and shape [layers, 2
(key, value), elements of one block of one layer]; the payload is the block's keys and
values as the KV cache holds them. The key id names the key without giving it away.

Safety. A file is written under a temporary name (0600, never through a link) and renamed
into place (`os.replace` is atomic), so a reader sees a whole file or none, whatever other
processes do. Reading checks the size, then the MAC before any byte is used (a file forged
or corrupted, even with a matching plain checksum, is refused), then every header field
against what the engine expects (fingerprint, hash, prefix, dtype, shape); a file that
fails any check is never loaded: it is logged, removed, and the lookup ends there. Files
are not fsynced: a file torn by a power cut fails its MAC. The MAC costs the engine
thread ~0.5 ms per 360 KiB block read (SHA-256 instructions; measured on a loaded EPYC).

Size limit. Every block file this cache wrote in the directory (its name, its magic and
its key id; any model) counts against `max_bytes`; the least recently used go first,
oldest modification time first; a file's time is bumped when it is read and when a writer
finds it already there. Nothing else is counted or deleted: not a user's `notes.kv`, not a
`download.tmp`, nothing in a folder that is a link or another user's. Each process rescans
the directory when its own writes since the last scan would pass the limit, or a minute
after its last scan, so with several writers at once the limit holds within their last
minute of writes.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
import struct
import threading
import weakref
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .prefix_cache_limit import SizeLimit
from .private_dir import key_id, load_or_create_key, open_private_dir

logger = logging.getLogger(__name__)

MAGIC = b"PAGEDKV2"
LEGACY_MAGIC = b"PAGEDKV1"  # before keys: token ids in clear, a plain checksum; never loaded
_PREFIX = struct.Struct("<8s16sIQ")  # magic, key id, header bytes, payload bytes
_MAC_BYTES = 32
_MAX_HEADER_BYTES = 1 << 16
# A refused file's header is still read (after its MAC) to say what is wrong, up to this size.
_MAX_MISFIT_PAYLOAD = 1 << 26
SUFFIX = ".kv"
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
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
    token before them. BLAKE2b: a prompt made to collide with another's is not feasible."""
    state = hashlib.blake2b(first_hash.to_bytes(8, "little"), digest_size=16)
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
        _, _, header_len, _ = _PREFIX.unpack(f.read(_PREFIX.size))
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
        # The user's path, its links resolved once; inside it, no link is ever followed.
        self.root = Path(os.path.realpath(os.fspath(root)))
        self.folder = self.root / folder_name
        self.fingerprint = fingerprint
        self.payload_dtype = payload_dtype
        self.payload_shape = list(payload_shape)
        self.max_bytes = max_bytes
        root_fd = dir_fd = -1
        try:
            self.root.parent.mkdir(parents=True, exist_ok=True)
            root_fd = open_private_dir(str(self.root))
            self._key = load_or_create_key(root_fd)
            dir_fd = open_private_dir(folder_name, dir_fd=root_fd, tighten=True)
            if not os.access(folder_name, os.W_OK | os.X_OK, dir_fd=root_fd):
                raise PermissionError(f"{self.folder} is not writable")
            self._root_fd, self._dir_fd = root_fd, dir_fd
            if not self._is_regular("model.json"):
                text = json.dumps(
                    {"fingerprint": fingerprint, **description}, indent=1, default=str
                )
                self._write_atomically("model.json", text.encode())
        except OSError as error:
            for fd in (root_fd, dir_fd):
                if fd >= 0:
                    os.close(fd)
            raise ValueError(
                f"prefix_cache_dir {str(self.root)!r} cannot be used: {error}"
            ) from error
        self._key_id = key_id(self._key)
        weakref.finalize(self, _close_fds, root_fd, dir_fd)
        self._lock = threading.Lock()
        self._jobs: deque[_WriteJob] = deque()
        self._thread: threading.Thread | None = None
        self._pending_bytes = 0
        self.limit = SizeLimit(root_fd, max_bytes, self._is_ours)
        self.files_written = 0
        self.files_rejected = 0

    @property
    def files_evicted(self) -> int:
        return self.limit.files_evicted

    def path_of(self, block_hash: int) -> Path:
        return self.folder / block_file_name(block_hash)

    def exists(self, block_hash: int) -> bool:
        return self._is_regular(block_file_name(block_hash))

    def _is_regular(self, name: str, dir_fd: int | None = None) -> bool:
        """A regular file (not a link) of that name in the folder."""
        try:
            info = os.stat(name, dir_fd=self._dir_fd if dir_fd is None else dir_fd,
                           follow_symlinks=False)  # fmt: skip
        except OSError:
            return False
        return stat.S_ISREG(info.st_mode)

    def _is_ours(self, name: str, dir_fd: int | None = None) -> bool:
        """A regular file whose head says this cache wrote it (its magic and key id, or the
        magic of the format before keys)."""
        try:
            fd = os.open(name, _FILE_FLAGS, dir_fd=self._dir_fd if dir_fd is None else dir_fd)
        except OSError:
            return False
        with open(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return False
            head = f.read(24)
        return head[:8] == LEGACY_MAGIC or head == MAGIC + self._key_id

    def _prefix_mac(self, record: BlockRecord) -> str:
        """The keyed digest of a block's prefix and tokens (no token id is stored)."""
        tokens = np.asarray(record.token_ids, dtype=np.int64).tobytes()
        message = b"prefix" + bytes.fromhex(record.prefix_digest) + tokens
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    # ------------------------------------------------------------------- read
    def read(self, record: BlockRecord, out: np.ndarray) -> bool:
        """Fill `out` (uint8, one block's payload bytes) from the block's file; True when it
        passed every check. A missing file is False quietly; a bad one is logged, removed,
        and False."""
        name = block_file_name(record.block_hash)
        try:
            problem = self._read_checked(name, record, out)
        except FileNotFoundError:
            return False
        except OSError as error:
            problem = f"unreadable (a link is never followed): {error}"
        path = self.folder / name
        if problem is None:
            with contextlib.suppress(OSError):
                os.utime(name, dir_fd=self._dir_fd, follow_symlinks=False)  # LRU
            return True
        self.files_rejected += 1
        logger.warning("prefix cache: skipped %s (%s); it will be computed instead", path, problem)
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=self._dir_fd)
        return False

    def _read_checked(self, name: str, record: BlockRecord, out: np.ndarray) -> str | None:
        """None when the file is whole, was written with this directory's key and is the
        block asked for; else what is wrong. The MAC is checked before any byte is used."""
        with open(os.open(name, _FILE_FLAGS, dir_fd=self._dir_fd), "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                return "not a regular file"
            prefix = f.read(_PREFIX.size)
            if len(prefix) < _PREFIX.size:
                return "truncated"
            magic, file_key_id, header_len, payload_len = _PREFIX.unpack(prefix)
            if magic != MAGIC:
                return "not a pagedllm KV block file of this format version"
            if not hmac.compare_digest(file_key_id, self._key_id):
                return "not written with this cache directory's key (forged or copied in)"
            if header_len > _MAX_HEADER_BYTES:
                return f"a header of {header_len} bytes"
            if info.st_size != _PREFIX.size + header_len + payload_len + _MAC_BYTES:
                return (
                    f"truncated or padded: {info.st_size} bytes, its header announces more or fewer"
                )
            if payload_len != out.nbytes and payload_len > _MAX_MISFIT_PAYLOAD:
                return f"payload of {payload_len} bytes, expected {out.nbytes}"
            header_bytes = f.read(header_len)
            # The payload goes where it is wanted; a misfit one (another layout) to scratch,
            # so that its header, once authenticated, can say what it is.
            target = memoryview(out).cast("B") if payload_len == out.nbytes else bytearray(  # type: ignore[arg-type]  # numpy: a buffer
                payload_len
            )  # fmt: skip
            if f.readinto(target) != payload_len:
                return "truncated"
            stored_mac = f.read(_MAC_BYTES)
        mac = hmac.new(self._key, prefix, hashlib.sha256)
        mac.update(header_bytes)
        mac.update(target)
        if not hmac.compare_digest(mac.digest(), stored_mac):
            return "checksum mismatch: the file is corrupt or forged (its keyed MAC differs)"
        try:
            header = json.loads(header_bytes)
        except ValueError:
            return "its header is not valid JSON"
        problem = self._check_header(header, record)
        if problem is None and payload_len != out.nbytes:
            problem = f"payload of {payload_len} bytes, expected {out.nbytes}"
        return problem

    def _check_header(self, header: Any, record: BlockRecord) -> str | None:
        if not isinstance(header, dict):
            return "its header is not a JSON object"
        if header.get("fingerprint") != self.fingerprint:
            return "written for another model, dtype or KV layout (fingerprint differs)"
        prefix_mac = header.get("prefix_mac")
        if header.get("block_hash") != record.block_hash or not (
            isinstance(prefix_mac, str)
            and hmac.compare_digest(prefix_mac, self._prefix_mac(record))
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
                self.limit.evict_if_needed()
            except OSError as error:
                logger.warning("prefix cache: could not scan %s: %s", self.root, error)

    def _write_block(self, record: BlockRecord, payload: np.ndarray) -> int:
        name = block_file_name(record.block_hash)
        if self._is_ours(name):  # written before, by us or another process: now recently used
            try:
                os.utime(name, dir_fd=self._dir_fd, follow_symlinks=False)
                return 1
            except OSError:  # evicted meanwhile: write it again
                pass
        header = json.dumps(
            {
                "fingerprint": self.fingerprint,
                "block_hash": record.block_hash,
                "prefix_mac": self._prefix_mac(record),
                "dtype": self.payload_dtype,
                "shape": self.payload_shape,
            }
        ).encode()
        prefix = _PREFIX.pack(MAGIC, self._key_id, len(header), payload.nbytes)
        mac = hmac.new(self._key, prefix, hashlib.sha256)
        mac.update(header)
        mac.update(memoryview(payload).cast("B"))  # type: ignore[arg-type]  # numpy: a buffer
        self._write_atomically(name, prefix, header, payload.data, mac.digest())
        size = len(prefix) + len(header) + payload.nbytes + _MAC_BYTES
        self.limit.written_since_scan += size
        self.files_written += 1
        return 1

    def _write_atomically(self, name: str, *parts: Any) -> None:
        """A new file (0600, never through a link) in the folder, renamed over `name`."""
        tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = self._dir_fd
        try:
            with open(os.open(tmp, flags, 0o600, dir_fd=fd), "wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=fd)
            raise


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
