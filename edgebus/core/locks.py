"""An exclusive lock between processes on one machine, for build-if-missing caches.

A second process that wants the entry another is building waits for it and then
finds it built, instead of building it again beside it (a model import is ~45 s of
both cores). The kernel drops the lock with the process, so a `kill -9` leaves
nothing to clean up: the lock file itself stays, empty, and means nothing.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def exclusive(path: Path, waiting: Callable[[], None] | None = None) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (created if missing) for the with block;
    `waiting` is called once first if another process holds it.

    Raises OSError if `path` cannot be created: the caller says what to fix.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the only descriptor drops the lock
