"""A box's CPU, memory and disk: one control group per box, on cgroup v1 or v2 behind one
interface.

v2 (one unified tree, most current distributions) and v1 (a tree per
controller, older ones and many containers) name the same limits differently:
`cpu.max` against `cpu.cfs_quota_us` / `cpu.cfs_period_us`, `memory.max`
against `memory.limit_in_bytes`, `memory.events`' `oom_kill` against
`memory.oom_control`'s, `io.max`'s rbps and wbps against blkio's
`throttle.read_bps_device` and `throttle.write_bps_device`. `open_tree` picks
the one this machine has writable, or says what is missing. The io controller
is optional: only a box with a `disk:` needs it (`set_disk` says what lacks).
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
# CFS period: a short one keeps a box's share of the CPU even over the few
# milliseconds one decode step lasts. With the default 100 ms, a stage that
# idles between steps runs each short step at full speed out of its unused
# quota, and a slow box would look as fast as the machine.
CPU_PERIOD_US = 10_000
# The kernel refuses quotas below 1 ms.
MIN_QUOTA_US = 1_000
# A box's quota is its ceiling; the highest scheduling weight makes it its floor too: on a
# host busy with other work, the scheduler runs a box's processes before the others' until
# the quota is spent, so each box keeps the speed the rehearsal gave it (on the 2-core
# Intel Xeon VM at a load of 12, boxes without it got well under their quotas). The
# quotas cap what this takes from the rest of the host. A box whose quota is lifted goes
# back to the default weight, and so does the boxes' parent, which competes with the host's
# other processes as one: uncapped, they must not starve the host. cgroup v1's cpu.shares
# and v2's cpu.weight, each its kernel's highest and default.
V1_TOP_SHARES, V1_DEFAULT_SHARES = 262_144, 1_024
V2_TOP_WEIGHT, V2_DEFAULT_WEIGHT = 10_000, 100
# Prefix of every group edgebus creates, so a leftover is recognisable.
PREFIX = "edgebus-rehearse-"


class CgroupError(RuntimeError):
    """What this machine lacks for per-box CPU, memory and disk limits."""


@dataclass(frozen=True)
class DiskBytes:
    """Bytes a group's processes have read from and written to block devices: what the io
    controller metered, whichever process's page cache they went through."""

    read: int
    written: int


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
    def set_disk(self, devices: list[str], read_bps: int, write_bps: int) -> None:
        """Hold reads and writes on each block device of `devices` ("MAJ:MIN") to these
        bytes a second."""

    @abstractmethod
    def disk_bytes(self) -> DiskBytes | None:
        """What the group has read and written on block devices (None: no io controller)."""

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
    def __init__(self, name: str, cpu: Path, cpuacct: Path, memory: Path,
                 blkio: Path | None) -> None:
        super().__init__(name)
        self.cpu, self.cpuacct, self.memory, self.blkio = cpu, cpuacct, memory, blkio

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
        shares = V1_DEFAULT_SHARES if cpu_cores is None else V1_TOP_SHARES
        for group in [self.cpu] + ([self.cpu.parent] if cpu_cores is None else []):
            (group / "cpu.shares").write_text(str(shares))

    def set_disk(self, devices: list[str], read_bps: int, write_bps: int) -> None:
        if self.blkio is None:
            raise CgroupError(f"the blkio controller (cgroup v1's io controller, mounted at "
                              f"{CGROUP_ROOT / V1Tree.IO_CONTROLLER}), which holds a box to "
                              "its disk: rates — mount it, or leave the boxes' disk: out")
        for device in devices:
            (self.blkio / "blkio.throttle.read_bps_device").write_text(f"{device} {read_bps}")
            (self.blkio / "blkio.throttle.write_bps_device").write_text(
                f"{device} {write_bps}")

    def disk_bytes(self) -> DiskBytes | None:
        if self.blkio is None:
            return None
        # "MAJ:MIN Read N" lines, a device each; a "Total N" line last
        counts = {"Read": 0, "Write": 0}
        for line in (self.blkio / "blkio.throttle.io_service_bytes").read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] in counts:
                counts[parts[1]] += int(parts[2])
        return DiskBytes(counts["Read"], counts["Write"])

    def dirs(self) -> list[Path]:
        return [self.cpu, self.cpuacct, self.memory] + ([self.blkio] if self.blkio else [])


class V1Tree(CgroupTree):
    """cgroup v1: a directory per box in each of the cpu, cpuacct and memory hierarchies."""

    version = "v1"
    CONTROLLERS = ("cpu", "cpuacct", "memory")
    # Optional: only a box with a disk: rate needs it.
    IO_CONTROLLER = "blkio"

    def _run_dirs(self) -> list[Path]:
        controllers = self.CONTROLLERS + ((self.IO_CONTROLLER,) if _v1_io() else ())
        return [CGROUP_ROOT / controller / f"{PREFIX}{self.run}" for controller in controllers]

    def create(self, box: str, cpu_cores: float, memory_bytes: int) -> BoxGroup:
        for parent in self._run_dirs():
            parent.mkdir(exist_ok=True)
        # The boxes' parent competes with the host's other processes as one: it needs the
        # weight too, and what its boxes may take is capped by their quotas.
        (self._run_dirs()[0] / "cpu.shares").write_text(str(V1_TOP_SHARES))
        cpu, cpuacct, memory, *blkio = (parent / box for parent in self._run_dirs())
        group = _V1Group(box, cpu, cpuacct, memory, blkio[0] if blkio else None)
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
        weight = V2_DEFAULT_WEIGHT if cpu_cores is None else V2_TOP_WEIGHT
        for group in [self.path] + ([self.path.parent] if cpu_cores is None else []):
            (group / "cpu.weight").write_text(str(weight))

    def set_disk(self, devices: list[str], read_bps: int, write_bps: int) -> None:
        io_max = self.path / "io.max"
        if not io_max.exists():
            raise CgroupError(f"the io controller in {self.path.parent.parent}'s "
                              "cgroup.controllers, which holds a box to its disk: rates — "
                              "enable it (it may be held by a cgroup v1 blkio mount), or "
                              "leave the boxes' disk: out")
        for device in devices:
            io_max.write_text(f"{device} rbps={read_bps} wbps={write_bps}")

    def disk_bytes(self) -> DiskBytes | None:
        stat = self.path / "io.stat"
        if not stat.exists():
            return None
        # "MAJ:MIN rbytes=N wbytes=N rios=N ..." lines, a device each
        read = written = 0
        for line in stat.read_text().splitlines():
            fields = dict(item.split("=") for item in line.split()[1:])
            read += int(fields.get("rbytes", 0))
            written += int(fields.get("wbytes", 0))
        return DiskBytes(read, written)

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
            controllers = "+cpu +memory"
            if "io" in (self.root / "cgroup.controllers").read_text().split():
                # Delegated from the root down, so the boxes' groups have io.max and io.stat;
                # where the root refuses, a box with a disk: says what lacks (set_disk).
                with contextlib.suppress(OSError):
                    (self.root / "cgroup.subtree_control").write_text("+io")
            if "io" in (parent / "cgroup.controllers").read_text().split():
                controllers += " +io"
            (parent / "cgroup.subtree_control").write_text(controllers)
            # As V1Tree's parent: it competes with the host's other processes as one.
            (parent / "cpu.weight").write_text(str(V2_TOP_WEIGHT))
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


def _v1_io() -> bool:
    return (CGROUP_ROOT / V1Tree.IO_CONTROLLER / "blkio.throttle.read_bps_device").is_file()


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
