"""Password hashes in Mosquitto 2's `$7$` format (what `mosquitto_passwd` writes), in Python.

A line of a password file is `user:$7$<iterations>$<salt>$<hash>`: PBKDF2-HMAC-
SHA512 over the password, base64 salt and hash. Mosquitto reads it; so does
the embedded broker (`broker.security`), so one file serves both brokers and
generating it needs no `mosquitto_passwd` on the box.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

PREFIX = "$7$"
# What mosquitto_passwd 2.0 uses (PW_DEFAULT_ITERATIONS, a 12-byte salt and the
# full 64-byte SHA-512 output): Mosquitto verifies with the iteration count in
# the line, but staying at its default keeps its connect cost as it expects.
ITERATIONS = 101
_SALT_BYTES = 12
_HASH_BYTES = 64


def hash_password(password: str, *, salt: bytes | None = None,
                  iterations: int = ITERATIONS) -> str:
    """`password` as a `$7$` hash, with a fresh random salt unless one is given."""
    salt = secrets.token_bytes(_SALT_BYTES) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations, _HASH_BYTES)
    return (f"{PREFIX}{iterations}${base64.b64encode(salt).decode()}$"
            f"{base64.b64encode(digest).decode()}")


def is_hash(text: str) -> bool:
    """Whether `text` is a well-formed `$7$` hash."""
    return _parse(text) is not None


def verify_password(password: str, hashed: str) -> bool:
    """Whether `password` matches the `$7$` hash `hashed` (False for a malformed hash)."""
    parts = _parse(hashed)
    if parts is None:
        return False
    iterations, salt, expected = parts
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations, len(expected))
    return hmac.compare_digest(digest, expected)


def _parse(hashed: str) -> tuple[int, bytes, bytes] | None:
    fields = hashed.split("$")
    # "$7$101$salt$hash".split("$") == ["", "7", "101", "salt", "hash"]
    if len(fields) != 5 or fields[:2] != ["", "7"] or not fields[2].isdigit():
        return None
    try:
        salt = base64.b64decode(fields[3], validate=True)
        expected = base64.b64decode(fields[4], validate=True)
    except ValueError:
        return None
    if not salt or not expected or int(fields[2]) < 1:
        return None
    return int(fields[2]), salt, expected


def password_file(hashes: dict[str, str]) -> str:
    """The text of a password file: one `user:hash` line per user."""
    return "".join(f"{user}:{hashed}\n" for user, hashed in hashes.items())
