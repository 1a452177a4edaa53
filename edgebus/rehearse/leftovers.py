"""What a rehearsal killed with `kill -9` leaves on the host, and `edgebus rehearse --clean`.

A rehearsal that ends in any other way tears down what it built
(`Rehearsal.stop`). `kill -9`, an OOM kill of `edgebus rehearse` itself or a
crash of Python leaves its namespaces, its bridge (with the bridge's host
address and route), the host ends of its veth pairs and its control groups.

So that they can be found, and told from those of a rehearsal still
running, every run writes a record before it builds anything:
`RECORD_DIR/<run>.json`, with the process that owns the run. Every name the
run creates carries its run id (`eb<run>` links, `edgebus-<run>-<box>`
namespaces, `edgebus-rehearse-<run>` control groups). `clean` removes what
belongs to runs whose owner is gone, and never touches a live run's.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from edgebus.rehearse import cgroups, netns

# In /run: a tmpfs emptied at boot, as namespaces, links and control groups are.
RECORD_DIR = Path("/run/edgebus-rehearse")
# Processes of a dead run left in its control groups (a broker or agent that
# outlived it) get SIGKILL; this long for the kernel to reap them before the
# group, which cannot be removed while it has members, is given up on.
REAP_S = 10.0
_POLL_S = 0.05


@dataclass(frozen=True)
class RunRecord:
    """The process that owns rehearsal run `run`."""

    run: str
    pid: int
    started: int  # the process's start time (clock ticks after boot): a reused pid differs

    def alive(self) -> bool:
        return _start_time(self.pid) == self.started


def _start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Field 22, counted after the command name, which may hold spaces and parentheses.
    return int(stat.rpartition(")")[2].split()[19])


def record(run: str) -> Path:
    """Write the record of run `run`, owned by this process; return its path."""
    RECORD_DIR.mkdir(mode=0o700, exist_ok=True)
    pid = os.getpid()
    path = RECORD_DIR / f"{run}.json"
    path.write_text(json.dumps({"run": run, "pid": pid, "started": _start_time(pid)}))
    return path


def forget(run: str) -> None:
    """Remove run `run`'s record, once everything it built is gone."""
    (RECORD_DIR / f"{run}.json").unlink(missing_ok=True)


def records() -> list[RunRecord]:
    if not RECORD_DIR.is_dir():
        return []
    found = []
    for path in sorted(RECORD_DIR.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            found.append(RunRecord(str(data["run"]), int(data["pid"]), int(data["started"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # half-written by a run killed at that moment: it built nothing yet
    return found


def names(run: str) -> tuple[str, str, str]:
    """The prefixes of run `run`'s links, its namespaces, and its control group."""
    return f"eb{run}", f"edgebus-{run}-", f"{cgroups.PREFIX}{run}"


def clean() -> tuple[list[str], list[str]]:
    """Remove everything of rehearsals whose process is gone: (what was removed, what could
    not be), one line each. A run whose things could not all be removed keeps its record,
    so that a later `--clean` tries again.

    A record that cannot be parsed is removed with nothing else: its run was
    killed before it built anything.
    """
    removed: list[str] = []
    failed: list[str] = []
    live = {r.run for r in records() if r.alive()}
    for path in sorted(RECORD_DIR.glob("*.json")) if RECORD_DIR.is_dir() else []:
        run = path.stem
        if run in live:
            continue
        try:
            _clean_run(run, removed)
        except (OSError, netns.NetworkError, cgroups.CgroupError) as exc:
            failed.append(f"run {run}: {exc}")
            continue
        path.unlink(missing_ok=True)
        removed.append(f"record {path}")
    return removed, failed


def _clean_run(run: str, removed: list[str]) -> None:
    links, namespaces, group = names(run)
    for directory in _group_dirs(group):  # first: nothing of the run may run on
        _kill_members(directory)
    for namespace in netns.run("ip", "netns", "list").split():
        if namespace.startswith(namespaces):
            netns.run("ip", "netns", "del", namespace)
            removed.append(f"namespace {namespace}")
    # Host ends of veth pairs first (each takes its peer along), then the bridge,
    # which takes its host address and its route along.
    found = [line.split(":")[1].strip().partition("@")[0]
             for line in netns.run("ip", "-o", "link", "show").splitlines()]
    for link in sorted((name for name in found if name.startswith(links)), key=len, reverse=True):
        with contextlib.suppress(netns.NetworkError):  # gone with its namespace meanwhile
            netns.run("ip", "link", "del", link)
            removed.append(f"link {link}")
    for directory in _group_dirs(group):
        for child in sorted(p for p in directory.iterdir() if p.is_dir()):
            child.rmdir()
        directory.rmdir()
        removed.append(f"control group {directory}")


def _group_dirs(group: str) -> list[Path]:
    """The run's group directories, once each (cgroup v1 may mount cpu and cpuacct together)."""
    roots = [cgroups.CGROUP_ROOT, cgroups.CGROUP_ROOT / "unified",
             *(cgroups.CGROUP_ROOT / c for c in (*cgroups.V1Tree.CONTROLLERS,
                                                 cgroups.V1Tree.IO_CONTROLLER))]
    found = {(root / group).resolve() for root in roots if (root / group).is_dir()}
    return sorted(found)


def _kill_members(directory: Path) -> None:
    procs = [directory / "cgroup.procs", *directory.glob("*/cgroup.procs")]
    deadline = time.monotonic() + REAP_S
    while pids := {int(pid) for path in procs if path.exists()
                   for pid in path.read_text().split()}:
        if time.monotonic() > deadline:
            raise cgroups.CgroupError(f"processes {sorted(pids)} of {directory} did not die")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(_POLL_S)
