"""The HTTP gateway's API keys: one `<name>.api-key` file each, in the credentials directory.

The plant file is the same on every box and holds no secret, so it lists only
the keys' names (`security.api_keys`); each key lives beside the passwords,
owner-readable only. `edgebus init` writes them; the gateway reads them at
start and compares a presented key against each in constant time.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

from edgebus.core.errors import PlantConfigError
from plant_config.credentials import SECRET_DIR_MODE, SECRET_MODE

SUFFIX = ".api-key"
# 32 random bytes, URL-safe base64, as the passwords: beyond guessing, and
# nothing a shell or an editor's settings file would treat specially.
_KEY_BYTES = 32


def key_path(directory: Path, name: str) -> Path:
    return directory / f"{name}{SUFFIX}"


def ensure_api_keys(directory: Path, names: Iterable[str]) -> list[Path]:
    """Write a key (mode 0600) for every name that has no file yet; return the files written."""
    directory.mkdir(mode=SECRET_DIR_MODE, parents=True, exist_ok=True)
    written = []
    for name in names:
        path = key_path(directory, name)
        if path.exists():
            continue
        # Created with its final mode: never readable by others, not even briefly.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, SECRET_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(secrets.token_urlsafe(_KEY_BYTES) + "\n")
        written.append(path)
    return written


def read_api_key(directory: Path, name: str) -> str:
    """The key `name`; PlantConfigError, saying what to do, if its file is missing or open."""
    path = key_path(directory, name)
    make = (f"(umask 077 && head -c 32 /dev/urandom | base64 > {path}), then give the key to "
            "its users")
    try:
        mode = path.stat().st_mode
        key = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise PlantConfigError(f"no API key {name!r}: {path} does not exist — copy it from the "
                               f"box where `edgebus init` ran, or make a new one: {make}"
                               ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlantConfigError(f"cannot read API key {name!r} from {path}: {exc}") from None
    if stat.S_IMODE(mode) & 0o077:
        raise PlantConfigError(f"{path} can be read by other users (mode "
                               f"{stat.S_IMODE(mode):o}) — run `chmod 600 {path}`")
    if not key:
        raise PlantConfigError(f"{path} is empty — make a new key: {make}")
    return key


class ApiKeys:
    """The keys a request may present, compared without leaking which bytes matched."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [key.encode() for key in keys]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def admits(self, presented: str) -> bool:
        candidate = presented.encode()
        # Every key is compared, so the time taken says nothing about which one is near.
        matches = [hmac.compare_digest(candidate, key) for key in self._keys]
        return any(matches)
