"""A directory only its owner can touch, and the secret kept in it (for the disk prefix cache).

The prefix cache's files hold what a model computed from users' prompts; another local
user must neither read them nor plant one that the engine would load. So the cache
directory and each model's folder in it are opened here once, as file descriptors (every
later operation is relative to them, so a folder swapped for a symbolic link later is never
followed), after checking that:

- it is a real directory, not a symbolic link (a link would let writes escape the folder
  that the size limit counts);
- it belongs to this user, and no other user can write in it (a folder made here is 0700;
  a model folder of ours that others can read is made 0700);

and a per-directory secret (`KEY_FILE`, 32 random bytes, 0600, made on first use) keys the
MAC of every block file: a file that was not written with it is never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import secrets
import stat

KEY_FILE = ".pagedllm-prefix-cache.key"
KEY_BYTES = 32
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_private_dir(path: str, dir_fd: int | None = None, tighten: bool = False) -> int:
    """An fd of the directory `path` (relative to dir_fd when given), made if missing (0700).

    OSError with what is wrong when it is a link, not a directory, another user's, or
    writable by other users. tighten: also take away what others may read (for a folder of
    our own, such as a model's folder in the cache)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700, dir_fd=dir_fd)
    info = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISLNK(info.st_mode):
        raise OSError(f"{path} is a symbolic link; the prefix cache follows none (remove it)")
    if not stat.S_ISDIR(info.st_mode):
        raise OSError(f"{path} is not a directory")
    fd = os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid():
            raise OSError(
                f"{path} belongs to user id {info.st_uid}, not to this user ({os.getuid()})"
            )
        if info.st_mode & 0o022:
            raise OSError(
                f"{path} can be written by other users (mode {stat.S_IMODE(info.st_mode):o}); "
                f"make it private (chmod 700 {path}) or choose another folder"
            )
        if tighten and info.st_mode & 0o077:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


def load_or_create_key(dir_fd: int) -> bytes:
    """The directory's secret: read, or made (0600) by whichever process comes first."""
    for _ in range(50):
        try:
            fd = os.open(KEY_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            _create_key(dir_fd)
            continue
        except OSError as error:
            raise OSError(f"{KEY_FILE} cannot be opened ({error}); is it a link?") from error
        with open(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise OSError(f"{KEY_FILE} is not a regular file")
            if info.st_uid != os.getuid() or info.st_mode & 0o077:
                raise OSError(
                    f"{KEY_FILE} must belong to this user with mode 600 (it has "
                    f"{stat.S_IMODE(info.st_mode):o}, user id {info.st_uid})"
                )
            key = f.read(KEY_BYTES + 1)
        if len(key) == KEY_BYTES:
            return key
        raise OSError(f"{KEY_FILE} holds {len(key)} bytes, not {KEY_BYTES}; remove it")
    raise OSError(f"{KEY_FILE} could not be made")


def _create_key(dir_fd: int) -> None:
    """Write the key under a temporary name, then link it into place: a reader sees a whole
    key or none, and of two processes making one at once, one wins."""
    tmp = f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
    try:
        with open(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
        with contextlib.suppress(FileExistsError):
            os.link(tmp, KEY_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)


def key_id(key: bytes) -> bytes:
    """16 bytes that name the key without giving it away (in every file this key signs)."""
    return hmac.new(key, b"pagedllm prefix cache key id", hashlib.sha256).digest()[:16]
