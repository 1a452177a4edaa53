"""How close a stage's decode step comes to its memory roofline.

A decode step reads every weight of the stage once, so it cannot take less
than (weight bytes / memory bandwidth): its roofline. The bench measures the
bandwidth here, on one thread (the 3-stage pipeline gives each stage one),
and sets each stage's roofline against its measured compute per decode step.
A small model's stage may sit partly in the CPU's caches, which lets it beat
the DRAM roofline; a large one cannot.
"""

from __future__ import annotations

import time

import numpy as np

# 1 GiB: far past any cache here (32 MiB of L3), so the sum reads from DRAM.
BANDWIDTH_BYTES = 2**30
BANDWIDTH_ROUNDS = 5  # the fastest: the least disturbed by other processes


def read_bandwidth() -> float:
    """Bytes per second one thread reads from memory (numpy's sum of float32, no threads)."""
    data = np.ones(BANDWIDTH_BYTES // 4, np.float32)
    data.sum()  # faults the pages in before timing
    best = float("inf")
    for _ in range(BANDWIDTH_ROUNDS):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return data.nbytes / best


def fraction(weight_bytes: float, step_s: float, bandwidth: float) -> float:
    """The roofline (weight bytes / bandwidth) over the measured step: 1.0 is at the roofline."""
    return weight_bytes / bandwidth / step_s
