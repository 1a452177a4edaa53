"""A process the kernel's OOM killer ends is told from one killed otherwise, with its
limit and what it held: what `edgebus up` and `edgebus rehearse` report (as root, in a
control group of this machine's own)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgebus.core.memory_limits import memory_limit

CGROUP_V1 = Path("/sys/fs/cgroup/memory")
LIMIT_MB = 64
# Allocates (and touches) far more than LIMIT_MB, a MiB at a time, then waits to be killed.
HOG = "import time\nheld = [bytearray(1 << 20) for _ in range(1024)]\ntime.sleep(60)\n"


@pytest.fixture
def small_group() -> Iterator[Path]:
    if os.geteuid() != 0 or not (CGROUP_V1 / "memory.limit_in_bytes").exists():
        pytest.skip("needs root and cgroup v1's memory hierarchy (the rehearsal tests cover v2)")
    group = CGROUP_V1 / f"edgebus-test-oom-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(LIMIT_MB << 20))
        (group / "memory.swappiness").write_text("0")
        yield group
    finally:
        group.rmdir()


def start_in(group: Path, code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], preexec_fn=lambda: (
        group / "cgroup.procs").write_text(str(os.getpid())))


def test_an_oom_kill_is_confirmed_with_the_limit(small_group: Path) -> None:
    started = time.monotonic()
    hog = start_in(small_group, HOG)
    limit = memory_limit(hog.pid)
    kills_before = limit.oom_kills()
    assert limit.limit_bytes == LIMIT_MB << 20 and limit.group == small_group
    assert hog.wait(60) == -signal.SIGKILL
    how = limit.describe_kill(hog.pid, started_s=started, kills_before=kills_before,
                              last_rss=None)
    assert how.startswith(f"was killed by the kernel's OOM killer, out of memory (limit "
                          f"{LIMIT_MB} MiB (its control group's limit"), how
    assert "MiB held at the peak" in how


def test_a_kill_9_is_not_taken_for_the_oom_killer(small_group: Path) -> None:
    started = time.monotonic()
    idle = start_in(small_group, "import time\ntime.sleep(60)\n")
    limit = memory_limit(idle.pid)
    kills_before = limit.oom_kills()
    idle.kill()
    assert idle.wait(60) == -signal.SIGKILL
    how = limit.describe_kill(idle.pid, started_s=started, kills_before=kills_before,
                              last_rss=10 << 20)
    assert how.startswith(f"was killed by SIGKILL (limit {LIMIT_MB} MiB"), how
    assert how.endswith("the kernel reported no OOM kill)"), how
    # Near the limit, a SIGKILL nobody confirms is most likely the OOM killer's.
    near = limit.describe_kill(idle.pid, started_s=started, kills_before=kills_before,
                               last_rss=(LIMIT_MB - 4) << 20)
    assert near.startswith("was killed by SIGKILL (likely the OOM killer: limit"), near
