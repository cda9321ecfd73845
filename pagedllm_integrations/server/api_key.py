"""Where `pagedllm serve` gets its API key: `--api-key-file`, the PAGEDLLM_API_KEY environment
variable, or `--api-key` (which `ps` shows to every local user, hence the warning)."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

API_KEY_ENV = "PAGEDLLM_API_KEY"
MAX_KEY_CHARS = 4096


def resolve_api_key(
    api_key: str | None, api_key_file: str | None, environ: Mapping[str, str] | None = None
) -> str | None:
    """The key the server requires (None: no key). ValueError for a bad or empty key, an
    unreadable file, or both `--api-key` and `--api-key-file`. A flag wins over the
    environment variable."""
    environ = os.environ if environ is None else environ
    if api_key is not None and api_key_file is not None:
        raise ValueError("give the API key once: --api-key or --api-key-file, not both")
    if api_key_file is not None:
        key, source = _read_key_file(Path(api_key_file)), f"--api-key-file {api_key_file}"
    elif api_key is not None:
        logger.warning(
            "--api-key puts the key on the command line, where `ps` shows it to every local "
            "user; prefer --api-key-file or the %s environment variable",
            API_KEY_ENV,
        )
        key, source = api_key, "--api-key"
    elif environ.get(API_KEY_ENV) is not None:
        key, source = environ[API_KEY_ENV], API_KEY_ENV
    else:
        return None
    if source != API_KEY_ENV and environ.get(API_KEY_ENV) is not None:
        logger.info("%s is set but %s gives the API key", API_KEY_ENV, source)
    check_api_key(key, source)
    return key


def check_api_key(key: str, source: str) -> None:
    if not key:
        raise ValueError(f"the API key from {source} is empty")
    if len(key) > MAX_KEY_CHARS:
        raise ValueError(f"the API key from {source} is longer than {MAX_KEY_CHARS} characters")
    if not all(33 <= ord(c) <= 126 for c in key):
        raise ValueError(
            f"the API key from {source} must be printable ASCII without spaces (it is sent "
            "as 'Authorization: Bearer <key>')"
        )


def _read_key_file(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
        mode = path.stat().st_mode
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"cannot read the API key file {path}: {error}") from None
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        logger.warning(
            "the API key file %s can be read by other users (mode %o); chmod 600 it",
            path,
            stat.S_IMODE(mode),
        )
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) != 1:
        raise ValueError(
            f"the API key file {path} must hold the key on one line, found {len(lines)} "
            "non-empty lines"
        )
    return lines[0]
