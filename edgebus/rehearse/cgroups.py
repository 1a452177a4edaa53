"""A box's CPU and memory: one control group per box, on cgroup v1 or v2 behind one interface.

v2 (one unified tree, most current distributions) and v1 (a tree per
controller, older ones and many containers) name the same limits differently:
`cpu.max` against `cpu.cfs_quota_us` / `cpu.cfs_period_us`, `memory.max`
against `memory.limit_in_bytes`, `memory.events`' `oom_kill` against
`memory.oom_control`'s. `open_tree` picks the one this machine has writable,
or says what is missing.
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# CFS period: a short one keeps a box's share of the CPU even over the few
# milliseconds one decode step lasts. With the default 100 ms, a stage that
# idles between steps runs each short step at full speed out of its unused
# quota, and a slow box would look as fast as the machine.
CPU_PERIOD_US = 10_000
# The kernel refuses quotas below 1 ms.
MIN_QUOTA_US = 1_000
# Prefix of every group edgebus creates, so a leftover is recognisable.
PREFIX = "edgebus-rehearse-"


class CgroupError(RuntimeError):
    """What this machine lacks for per-box CPU and memory limits."""


class BoxGroup(ABC):
    """The control group of one box."""

    def __init__(self, name: str) -> None:
        self.name = name

    @abstractmethod
    def procs_files(self) -> list[Path]:
        """The files a process writes its pid into to join this group (one per hierarchy)."""

    @abstractmethod
    def cpu_usage_s(self) -> float:
        """CPU seconds the group's processes have used."""

    @abstractmethod
    def oom_kills(self) -> int:
        """Processes of the group the kernel's OOM killer has killed."""

    @abstractmethod
    def memory_bytes(self) -> int:
        """Memory the group's processes use now, as the limit counts it."""

    @abstractmethod
    def major_faults(self) -> int:
        """Pages the group's processes have had to read back from disk: a box that evicts
        its own mapped weights under its limit reads them again at every pass."""

    @abstractmethod
    def peak_bytes(self) -> int | None:
        """The most the group has held (None: this kernel does not keep it)."""

    @abstractmethod
    def set_memory(self, limit_bytes: int) -> None:
        """Change the memory limit; past it, the kernel reclaims, then kills."""

    @abstractmethod
    def set_cpu(self, cpu_cores: float | None) -> None:
        """Change the CPU quota; None lifts it."""

    @abstractmethod
    def dirs(self) -> list[Path]:
        """The group's directories, removed at teardown."""


class CgroupTree(ABC):
    """Where the groups of one rehearsal live; `remove` takes them all away."""

    version: str

    def __init__(self, run: str) -> None:
        self.run = run
        self.groups: list[BoxGroup] = []

    @abstractmethod
    def create(self, box: str, cpu_cores: float, memory_bytes: int) -> BoxGroup:
        """A group for `box` with a CPU quota of `cpu_cores` and a memory limit."""

    @abstractmethod
    def _run_dirs(self) -> list[Path]:
        """The rehearsal's parent directories."""

    def remove(self) -> None:
        """Remove every group; processes still in one must have ended (the caller stops them)."""
        for group in self.groups:
            for path in group.dirs():
                _rmdir(path)
        for path in self._run_dirs():
            _rmdir(path)


def _rmdir(path: Path) -> None:
    # A group directory holds only kernel files, so rmdir (not a recursive delete) removes it.
    with contextlib.suppress(FileNotFoundError):
        path.rmdir()


def _quota_us(cpu_cores: float) -> int:
    return max(MIN_QUOTA_US, round(cpu_cores * CPU_PERIOD_US))


class _V1Group(BoxGroup):
    def __init__(self, name: str, cpu: Path, cpuacct: Path, memory: Path) -> None:
        super().__init__(name)
        self.cpu, self.cpuacct, self.memory = cpu, cpuacct, memory

    def procs_files(self) -> list[Path]:
        return [path / "cgroup.procs" for path in self.dirs()]

    def cpu_usage_s(self) -> float:
        return int((self.cpuacct / "cpuacct.usage").read_text()) / 1e9

    def oom_kills(self) -> int:
        return _field(self.memory / "memory.oom_control", "oom_kill")

    def memory_bytes(self) -> int:
        return int((self.memory / "memory.usage_in_bytes").read_text())

    def major_faults(self) -> int:
        return _field(self.memory / "memory.stat", "total_pgmajfault")

    def peak_bytes(self) -> int | None:
        return int((self.memory / "memory.max_usage_in_bytes").read_text())

    def set_memory(self, limit_bytes: int) -> None:
        memory = self.memory / "memory.limit_in_bytes"
        # Memory plus swap, where the kernel accounts swap: the same limit, so a
        # machine with swap does not let the box page out instead of meeting the
        # OOM killer. The kernel keeps it >= the memory limit, so the order of
        # the two writes follows the direction of the change.
        swap = self.memory / "memory.memsw.limit_in_bytes"
        files = [memory] + ([swap] if swap.exists() else [])
        if limit_bytes > int(memory.read_text()):
            files.reverse()
        for path in files:
            path.write_text(str(limit_bytes))

    def set_cpu(self, cpu_cores: float | None) -> None:
        quota = -1 if cpu_cores is None else _quota_us(cpu_cores)
        (self.cpu / "cpu.cfs_quota_us").write_text(str(quota))

    def dirs(self) -> list[Path]:
        return [self.cpu, self.cpuacct, self.memory]


class V1Tree(CgroupTree):
    """cgroup v1: a directory per box in each of the cpu, cpuacct and memory hierarchies."""

    version = "v1"
    CONTROLLERS = ("cpu", "cpuacct", "memory")

    def _run_dirs(self) -> list[Path]:
        return [CGROUP_ROOT / controller / f"{PREFIX}{self.run}" for controller in self.CONTROLLERS]

    def create(self, box: str, cpu_cores: float, memory_bytes: int) -> BoxGroup:
        for parent in self._run_dirs():
            parent.mkdir(exist_ok=True)
        cpu, cpuacct, memory = (parent / box for parent in self._run_dirs())
        group = _V1Group(box, cpu, cpuacct, memory)
        self.groups.append(group)
        for path in group.dirs():
            path.mkdir()
        (cpu / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
        group.set_cpu(cpu_cores)
        # No swapping: a box out of memory meets the OOM killer, as a real one
        # without swap would, instead of slowing down on a disk it does not have.
        (memory / "memory.swappiness").write_text("0")
        group.set_memory(memory_bytes)
        return group


class _V2Group(BoxGroup):
    def __init__(self, name: str, path: Path) -> None:
        super().__init__(name)
        self.path = path

    def procs_files(self) -> list[Path]:
        return [self.path / "cgroup.procs"]

    def cpu_usage_s(self) -> float:
        return _field(self.path / "cpu.stat", "usage_usec") / 1e6

    def oom_kills(self) -> int:
        return _field(self.path / "memory.events", "oom_kill")

    def memory_bytes(self) -> int:
        return int((self.path / "memory.current").read_text())

    def major_faults(self) -> int:
        return _field(self.path / "memory.stat", "pgmajfault")

    def peak_bytes(self) -> int | None:
        peak = self.path / "memory.peak"  # Linux 5.19 and later
        return int(peak.read_text()) if peak.exists() else None

    def set_memory(self, limit_bytes: int) -> None:
        (self.path / "memory.max").write_text(str(limit_bytes))

    def set_cpu(self, cpu_cores: float | None) -> None:
        quota = "max" if cpu_cores is None else str(_quota_us(cpu_cores))
        (self.path / "cpu.max").write_text(f"{quota} {CPU_PERIOD_US}")

    def dirs(self) -> list[Path]:
        return [self.path]


class V2Tree(CgroupTree):
    """cgroup v2: one directory per box under a parent that delegates cpu and memory."""

    version = "v2"

    def __init__(self, run: str, root: Path) -> None:
        super().__init__(run)
        self.root = root

    def _run_dirs(self) -> list[Path]:
        return [self.root / f"{PREFIX}{self.run}"]

    def create(self, box: str, cpu_cores: float, memory_bytes: int) -> BoxGroup:
        parent = self._run_dirs()[0]
        if not parent.exists():
            parent.mkdir()
            (parent / "cgroup.subtree_control").write_text("+cpu +memory")
        group = _V2Group(box, parent / box)
        self.groups.append(group)
        group.path.mkdir()
        group.set_cpu(cpu_cores)
        swap = group.path / "memory.swap.max"
        if swap.exists():  # absent where the kernel has no swap accounting
            swap.write_text("0")
        group.set_memory(memory_bytes)
        return group


def _field(path: Path, key: str) -> int:
    """A `key value` line of a cgroup stat file."""
    for line in path.read_text().splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    raise CgroupError(f"{path} has no {key} line: this kernel does not report it")


def _v2_root() -> Path | None:
    """The cgroup v2 mount where cpu and memory are available, or None."""
    for root in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
        controllers = root / "cgroup.controllers"
        if controllers.is_file() and {"cpu", "memory"} <= set(controllers.read_text().split()):
            return root
    return None


def missing() -> list[str]:
    """What this machine lacks for per-box limits; empty when `open_tree` will work."""
    if _v2_root() is not None or _v1_root_ok():
        if os.geteuid() != 0:
            return ["root: creating control groups needs it — run as root (sudo)"]
        return []
    return [f"a writable cgroup with the cpu and memory controllers: neither cgroup v2 with "
            f"both (in {CGROUP_ROOT}/cgroup.controllers) nor cgroup v1's "
            f"{', '.join(V1Tree.CONTROLLERS)} hierarchies under {CGROUP_ROOT} — mount them, or "
            "run in a container started with its own cgroup namespace writable"]


def _v1_root_ok() -> bool:
    return all((CGROUP_ROOT / controller / "cgroup.procs").is_file()
               for controller in V1Tree.CONTROLLERS) and \
        (CGROUP_ROOT / "cpu" / "cpu.cfs_quota_us").is_file()


def open_tree(run: str) -> CgroupTree:
    """The cgroup tree of rehearsal `run`, v2 where the machine has it, else v1."""
    problems = missing()
    if problems:
        raise CgroupError("; ".join(problems))
    root = _v2_root()
    if root is not None:
        return V2Tree(run, root)
    return V1Tree(run)
