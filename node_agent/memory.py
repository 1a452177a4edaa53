"""How a stage's process uses the C heap, so that its RSS is its weights and caches
and its forward passes do not wait on page faults.

glibc serves a large allocation with its own memory map and unmaps it when
freed, but after the first such free it raises that threshold to the freed
size, and from then on blocks of that size come from the heap, where freed
ones stay resident. The two phases of a stage want opposite things:

- Loading reads each weight (or block of rows) into a buffer that is freed
  once packed or converted. With the moving threshold, a middle SmolLM2 stage
  kept 70 MiB of freed buffers (215 MiB for 135 MiB of weights), so while
  loading, large blocks get maps of their own.
- Serving allocates the same activation tensors op after op: a 128-token
  prefill chunk's are 0.3-0.8 MB each. Each one a fresh map means the kernel
  faults in and zeroes every page again; that made a middle stage's prefill
  20 % slower (664 against 534 ms a 128-token chunk on one thread). So once
  loaded, such blocks come from the heap and are reused.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
from collections.abc import Iterator

# <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# While loading, this large or larger gets a map of its own: weight buffers,
# never the many small tensors Python and torch create on the way.
LOAD_MMAP_THRESHOLD_BYTES = 256 * 1024
# While serving, below this comes from the heap: a forward pass's largest
# temporaries (a 512-token chunk's MLP activations, 16 rows of logits: ~3 MB).
SERVE_MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
# Free heap above this at its top goes back to the OS: a prefill chunk's working
# set stays for the next op, more than that (after a burst) does not.
SERVE_TRIM_THRESHOLD_BYTES = 8 * 1024 * 1024


def _mallopt(param: int, value: int) -> None:
    libc = _libc()
    if libc is not None:
        with contextlib.suppress(AttributeError):
            libc.mallopt(param, value)


@functools.cache  # find_library may run ldconfig: once per process is enough
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError):
        return ctypes.CDLL(name) if name else None
    return None


@contextlib.contextmanager
def loading() -> Iterator[None]:
    """Heap settings for loading weights inside the block, for serving after it
    (glibc only; elsewhere a no-op)."""
    _mallopt(_M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD_BYTES)
    try:
        yield
    finally:
        return_freed_memory()
        _mallopt(_M_MMAP_THRESHOLD, SERVE_MMAP_THRESHOLD_BYTES)
        _mallopt(_M_TRIM_THRESHOLD, SERVE_TRIM_THRESHOLD_BYTES)


def return_freed_memory() -> None:
    """Hand freed heap pages back to the OS, so RSS shows what evicting caches freed.

    glibc keeps freed blocks for reuse: after converting weights (the fp32
    originals freed) or evicting caches, RSS would go on counting them.
    """
    libc = _libc()
    if libc is not None:
        with contextlib.suppress(AttributeError):
            libc.malloc_trim(0)
