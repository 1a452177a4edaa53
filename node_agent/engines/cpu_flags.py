"""What this CPU can do, as the kernel lists it: the engines pick kernels by it."""

from __future__ import annotations

import functools
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The CPU's feature flags: /proc/cpuinfo's `flags` (x86) or `Features` (ARM) line."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


@functools.cache
def host_cpu_flags() -> frozenset[str]:
    """This machine's flags; none where /proc/cpuinfo cannot be read."""
    try:
        return frozenset(cpu_flags(CPUINFO.read_text()))
    except OSError:
        return frozenset()
