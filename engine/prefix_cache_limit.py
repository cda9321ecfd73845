"""The size limit of a prefix-cache directory: what this cache wrote, least recently used out.

Counted and deleted are only the block files this cache wrote, in any model's folder of
the directory: a regular file named `<16 hex>.kv` whose head carries the cache's magic and
its directory key's id (see engine/prefix_store.py); and temporary files of writers that
died, by their exact name pattern, when they are empty or carry that head. A user's
`notes.kv`, a `download.tmp`, a folder that is a link or another user's: never touched.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)

_BLOCK_NAME = re.compile(r"[0-9a-f]{16}\.kv")
_TMP_NAME = re.compile(r"\.([0-9a-f]{16}\.kv|model\.json)\.[0-9]+\.[0-9a-f]+\.tmp")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_STALE_TMP_SECONDS = 3600.0  # a temporary file this old belongs to a writer that died
_RESCAN_SECONDS = 60.0
_EVICT_TO = 0.9  # evict down to this share of the limit, so that not every write rescans


class SizeLimit:
    """Keeps one directory's files of this cache under `max_bytes` (writer thread only)."""

    def __init__(self, root_fd: int, max_bytes: int, is_ours: Callable[[str, int], bool]) -> None:
        self.root_fd = root_fd  # the directory, opened once (links are never followed)
        self.max_bytes = max_bytes
        self.is_ours = is_ours  # (file name, folder fd) -> written by this cache
        self.scanned_bytes: int | None = None  # the directory's size at the last scan
        self.written_since_scan = 0
        self.last_scan = 0.0
        self.files_evicted = 0

    def evict_if_needed(self) -> None:
        now = time.monotonic()
        due = self.scanned_bytes is None or now - self.last_scan > _RESCAN_SECONDS
        if not due and self.scanned_bytes + self.written_since_scan <= self.max_bytes:  # type: ignore[operator]
            return
        files, total = self._scan()
        self.last_scan, self.written_since_scan = now, 0
        if total > self.max_bytes:
            files.sort()  # oldest modification time first
            target = int(self.max_bytes * _EVICT_TO)
            by_folder: dict[str, list[tuple[str, int]]] = {}
            for _, size, folder, name in files:
                if total <= target:
                    break
                by_folder.setdefault(folder, []).append((name, size))
                total -= size
            for folder, victims in by_folder.items():
                self._evict(folder, victims)
        self.scanned_bytes = total

    def _evict(self, folder: str, victims: list[tuple[str, int]]) -> None:
        with self._folder_fd(folder) as fd:
            if fd is None:
                return
            for name, _ in victims:
                try:
                    os.unlink(name, dir_fd=fd)
                    self.files_evicted += 1
                except FileNotFoundError:
                    pass  # another process evicted it first
                except OSError as error:
                    logger.warning("prefix cache: could not evict %s: %s", name, error)

    @contextlib.contextmanager
    def _folder_fd(self, folder: str) -> Iterator[int | None]:
        """An fd of one model folder of the directory: a real one of this user's, else None."""
        try:
            fd = os.open(folder, _DIR_FLAGS, dir_fd=self.root_fd)
        except OSError:
            yield None
            return
        try:
            yield fd if os.fstat(fd).st_uid == os.getuid() else None
        finally:
            os.close(fd)

    def _scan(self) -> tuple[list[tuple[float, int, str, str]], int]:
        """Every block file this cache wrote in the directory: (mtime, size, folder, name),
        and their total size. Removes temporary files of writers that died."""
        files: list[tuple[float, int, str, str]] = []
        total = 0
        wall = time.time()
        with os.scandir(self.root_fd) as folders:
            names = [f.name for f in folders if f.is_dir(follow_symlinks=False)]
        for folder in names:
            with self._folder_fd(folder) as fd:
                if fd is None:
                    continue
                with os.scandir(fd) as entries:
                    listed = list(entries)
                for entry in listed:
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if not stat.S_ISREG(info.st_mode):
                        continue
                    if _BLOCK_NAME.fullmatch(entry.name) and self.is_ours(entry.name, fd):
                        files.append((info.st_mtime, info.st_size, folder, entry.name))
                        total += info.st_size
                    elif (
                        _TMP_NAME.fullmatch(entry.name)
                        and wall - info.st_mtime > _STALE_TMP_SECONDS
                        and (info.st_size == 0 or self.is_ours(entry.name, fd))
                    ):
                        with contextlib.suppress(OSError):
                            os.unlink(entry.name, dir_fd=fd)
        return files, total
