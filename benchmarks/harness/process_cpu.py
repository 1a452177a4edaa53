"""CPU time of a plant's processes, by role, from /proc: what a token costs each of them."""

from __future__ import annotations

import os
from pathlib import Path

from edgebus.launcher import PlantProcesses

ROLES = ("stage", "coordinator", "broker")


def cpu_s(pids: list[int]) -> float:
    """User plus system seconds the processes `pids` have used so far."""
    ticks = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def roles(processes: PlantProcesses) -> dict[str, list[int]]:
    """The plant's process ids by role: its stages, its coordinator, its broker (the embedded
    one; a broker the plant did not start is the caller's to add)."""
    found: dict[str, list[int]] = {role: [] for role in ROLES}
    for agent, pid in processes.pids.items():
        role = next((r for r in ROLES if agent.startswith(r)), None)
        if role is not None:
            found[role].append(pid)
    return found
