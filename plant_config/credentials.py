"""Per-identity secrets: one `<identity>.password` file each, in the plant's credentials directory.

The plant file is the same on every box, so it holds no secret. `edgebus
broker mosquitto-config` writes a password for every identity that has none
yet into the credentials directory; each box then gets only its own file,
and its agent reads it from there.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

from edgebus.core.errors import PlantConfigError

SUFFIX = ".password"
# 32 random bytes, URL-safe base64: 256 bits, beyond any guessing, and no
# character that a shell, YAML or a config line would treat specially.
_PASSWORD_BYTES = 32
# Owner read/write only: a secret readable by others is a secret shared with them.
SECRET_MODE = 0o600
# A directory of secrets: its owner may list and enter it, nobody else.
SECRET_DIR_MODE = 0o700


def password_path(directory: Path, identity: str) -> Path:
    return directory / f"{identity}{SUFFIX}"


def read_password(directory: Path, identity: str) -> str:
    """The password of `identity`; PlantConfigError if its file is missing or open to others."""
    path = password_path(directory, identity)
    try:
        mode = path.stat().st_mode
        password = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise PlantConfigError(
            f"no password for {identity!r}: {path} does not exist — copy it from the box where "
            "`edgebus broker mosquitto-config` ran (it writes one per identity)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlantConfigError(f"cannot read the password of {identity!r} from {path}: "
                               f"{exc}") from None
    if stat.S_IMODE(mode) & 0o077:
        raise PlantConfigError(f"{path} can be read by other users (mode "
                               f"{stat.S_IMODE(mode):o}) — run `chmod 600 {path}`")
    if not password:
        raise PlantConfigError(f"{path} is empty — delete it and run `edgebus broker "
                               "mosquitto-config` again to get a new password")
    return password


def ensure_passwords(directory: Path, identities: Iterable[str]) -> dict[str, str]:
    """Every identity's password, generating (mode 0600) those that have no file yet.

    Existing files are kept, so regenerating the broker config does not change
    the password of a box that already has its file.
    """
    # Owner only: the directory lists the identities, and holds every secret on
    # the box where they are made.
    directory.mkdir(mode=SECRET_DIR_MODE, parents=True, exist_ok=True)
    result: dict[str, str] = {}
    for identity in identities:
        path = password_path(directory, identity)
        if not path.exists():
            # Created with the final mode: the secret is never readable by others, not even briefly.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, SECRET_MODE)
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                file.write(secrets.token_urlsafe(_PASSWORD_BYTES) + "\n")
        result[identity] = read_password(directory, identity)
    return result
