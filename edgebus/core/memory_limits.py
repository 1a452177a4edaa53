"""The memory a process may use, and whether the kernel's OOM killer ended it.

A box's limit is its control group's (`memory.max` on cgroup v2,
`memory.limit_in_bytes` on v1), else the machine's RAM. A stage that dies of
SIGKILL was the OOM killer's where the kernel says so: its group's `oom_kill`
counter went up (v2 `memory.events`, v1 `memory.oom_control`; either counts
kills of the group's processes by any OOM killer), or the kernel log
(`/dev/kmsg`, readable as root) names its pid. Otherwise it may still have
been, and `describe_kill` says "likely" where its last RSS was near the limit.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
MIB = 1 << 20
# A limit at or above this is no limit: v1 writes "unlimited" as ~2^63 rounded to pages.
_UNLIMITED = 1 << 60
# Bytes of the kernel log read when looking for an OOM kill: the ring buffer's default
# size is 128-256 KiB, and an OOM report is a few KiB near its end.
_KMSG_MAX_RECORDS = 4096
# The kernel log stamps records with its own clock, which ran 2.2 s behind
# time.monotonic() on the EPYC VM (measured by writing a record): a record counts as
# being about a process if stamped after its start less this much, so that the kill of
# an earlier process with the same pid is not taken for it.
KMSG_CLOCK_SLACK_S = 60.0
# A SIGKILLed process whose last RSS was this share of what it could use most likely met
# the OOM killer, where the kernel would not say.
LIKELY_OOM_SHARE = 0.8


@dataclass(frozen=True)
class MemoryLimit:
    """What a process may hold: `limit_bytes`, from `source`; its control group (the
    directory of its memory controller) where it has one."""

    limit_bytes: int
    source: str
    group: Path | None

    def oom_kills(self) -> int | None:
        """Processes of the group the OOM killer has killed (None: no group, or unreadable)."""
        if self.group is None:
            return None
        for name, key in (("memory.events", "oom_kill"), ("memory.oom_control", "oom_kill")):
            value = _stat_field(self.group / name, key)
            if value is not None:
                return value
        return None

    def describe_kill(self, pid: int, *, started_s: float, kills_before: int | None,
                      last_rss: int | None, share: str = "") -> str:
        """`describe_kill` for a process of this limit's group; `kills_before`: the
        group's oom_kill counter when the process started."""
        kills = self.oom_kills()
        counted = None if kills is None or kills_before is None else kills > kills_before
        return describe_kill(pid, started_s=started_s, limit_bytes=self.limit_bytes,
                             limit_source=self.source,
                             group_counted=counted, peak_bytes=self.peak_bytes(),
                             last_rss=last_rss, share=share)

    def peak_bytes(self) -> int | None:
        """The most the group has held (v2 memory.peak, v1 memory.max_usage_in_bytes)."""
        if self.group is None:
            return None
        for name in ("memory.peak", "memory.max_usage_in_bytes"):
            try:
                return int((self.group / name).read_text())
            except (OSError, ValueError):
                continue
        return None

    def others_bytes(self, own_rss: int) -> int:
        """What the group's other processes hold besides `own_rss`: its anonymous memory
        (page cache is reclaimable, so not counted); 0 without a group."""
        if self.group is None:
            return 0
        anon = _stat_field(self.group / "memory.stat", "anon")  # v2
        if anon is None:
            anon = _stat_field(self.group / "memory.stat", "total_rss")  # v1, with children
        return max(0, (anon or 0) - own_rss)


def memory_limit(pid: int | str = "self") -> MemoryLimit:
    """The tightest memory limit over process `pid`: its control group's (or one of the
    group's ancestors'), else the machine's RAM."""
    ram = _meminfo("MemTotal") or 0
    best = MemoryLimit(ram, f"the machine's RAM ({ram // MIB} MiB, MemTotal)", None)
    for group in _memory_groups(pid):
        own_group = group
        while True:
            limit = _limit(group)
            if limit is not None and limit < best.limit_bytes:
                best = MemoryLimit(limit, f"its control group's limit ({limit // MIB} MiB, "
                                   f"{group})", own_group)
            if group in (CGROUP_ROOT, CGROUP_ROOT / "memory") or group.parent == group:
                break
            group = group.parent
        if best.group is None:
            best = MemoryLimit(best.limit_bytes, best.source, own_group)
    return best


def available_bytes() -> int:
    """What the machine can give without swapping (MemAvailable)."""
    return _meminfo("MemAvailable") or 0


def rss_bytes(pid: int) -> int | None:
    """Process `pid`'s resident memory now (None: it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = re.search(r"^VmRSS:\s+(\d+)\s+kB$", status, re.MULTILINE)
    return None if found is None else int(found.group(1)) * 1024


def kernel_says_oom_killed(pid: int, since_s: float) -> bool | None:
    """Whether the kernel log reports the OOM killer killing `pid` after `since_s` (the
    time.monotonic() it started at, the clock of the log's stamps: so a process of the same
    pid killed before is not it); None: the log is unreadable."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    pattern = re.compile(rf"(Killed process {pid} |oom-kill:.*[,:]pid={pid},)")
    try:
        for _ in range(_KMSG_MAX_RECORDS):
            try:
                record = os.read(fd, 8192)
            except BlockingIOError:
                return False  # read to the end
            except OSError:
                continue  # EPIPE: a record was overwritten while reading; go on
            if not record:
                return False
            prefix, _, text = record.decode(errors="replace").partition(";")
            fields = prefix.split(",")  # priority, sequence, microseconds since boot, ...
            stamp_s = int(fields[2]) / 1e6 if len(fields) > 2 and fields[2].isdigit() else 0.0
            if stamp_s >= since_s - KMSG_CLOCK_SLACK_S and pattern.search(text):
                return True
        return False
    finally:
        os.close(fd)


def describe_kill(pid: int, *, started_s: float, limit_bytes: int, limit_source: str,
                  group_counted: bool | None, peak_bytes: int | None, last_rss: int | None,
                  share: str = "") -> str:
    """How a process killed by SIGKILL died, with the numbers: "was killed by the
    kernel's OOM killer: ..." where the kernel confirms it (`group_counted`: its control
    group's oom_kill counter went up while it ran; None: no counter to read, or its
    log names `pid`), else "was killed by SIGKILL (likely the OOM killer: ...)" where its
    last RSS was near the limit, or plainly. `started_s`: its time.monotonic() at start;
    `share`: what the plan gave it, in words."""
    confirmed = group_counted is True or kernel_says_oom_killed(pid, started_s) is True
    held = [f"limit {limit_bytes // MIB} MiB ({limit_source})"]
    if peak_bytes is not None:
        held.append(f"{peak_bytes // MIB} MiB held at the peak")
    if last_rss is not None:
        held.append(f"its last RSS seen {last_rss // MIB} MiB")
    if share:
        held.append(share)
    numbers = "; ".join(held)
    if confirmed:
        return f"was killed by the kernel's OOM killer, out of memory ({numbers})"
    if last_rss is not None and last_rss >= LIKELY_OOM_SHARE * limit_bytes:
        return f"was killed by SIGKILL (likely the OOM killer: {numbers})"
    return f"was killed by SIGKILL ({numbers}; the kernel reported no OOM kill)"


def _memory_groups(pid: int | str) -> list[Path]:
    """The directories of `pid`'s memory control groups (v1's memory hierarchy, v2's)."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return []
    groups = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            groups.append(CGROUP_ROOT / "memory" / path.lstrip("/"))
        elif controllers == "":
            groups.append(CGROUP_ROOT / path.lstrip("/"))
    return [group for group in groups if group.is_dir() and _has_memory(group)]


def _has_memory(group: Path) -> bool:
    return (group / "memory.max").exists() or (group / "memory.limit_in_bytes").exists() \
        or (group / "memory.stat").exists()


def _limit(group: Path) -> int | None:
    for name in ("memory.max", "memory.limit_in_bytes"):
        try:
            text = (group / name).read_text().strip()
        except OSError:
            continue
        if text == "max":
            return None
        value = int(text)
        return value if value < _UNLIMITED else None
    return None


def _stat_field(path: Path, key: str) -> int | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return None


def _meminfo(key: str) -> int | None:
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return None
    found = re.search(rf"^{key}:\s+(\d+) kB$", text, re.MULTILINE)
    return None if found is None else int(found.group(1)) * 1024
