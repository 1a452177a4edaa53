"""How a stage's process uses the C heap, so that its RSS is its weights and caches.

glibc serves a large allocation with its own memory map and unmaps it when
freed, but after the first such free it raises that threshold to the freed
size, and from then on blocks of that size come from the heap, where freed
ones stay resident. Loading a stage reads each weight (or block of rows)
into a buffer that is freed once packed or converted: with the moving
threshold, a middle SmolLM2 stage kept 70 MiB of freed buffers (215 MiB for
135 MiB of weights). A fixed threshold keeps them out of the heap.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util

# <malloc.h>: M_MMAP_THRESHOLD.
_M_MMAP_THRESHOLD = -3
# Allocations this large or larger get a map of their own: weight buffers,
# large KV caches and logits, never the many small tensors of a forward pass.
MMAP_THRESHOLD_BYTES = 256 * 1024


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    with contextlib.suppress(OSError):
        return ctypes.CDLL(name) if name else None
    return None


def map_large_allocations() -> None:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD_BYTES for this process (no-op elsewhere)."""
    libc = _libc()
    if libc is not None:
        with contextlib.suppress(AttributeError):
            libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def return_freed_memory() -> None:
    """Hand freed heap pages back to the OS, so RSS shows what evicting caches freed.

    glibc keeps freed blocks for reuse: after converting weights (the fp32
    originals freed) or evicting caches, RSS would go on counting them.
    """
    libc = _libc()
    if libc is not None:
        with contextlib.suppress(AttributeError):
            libc.malloc_trim(0)
