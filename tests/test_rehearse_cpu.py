"""A box's CPU in a rehearsal: its quota holds on a busy host, not only on an idle one.

A box's process spins inside its group, with a quota of most of a core, while
four spinners a core of this machine spin outside it. Shared out evenly, the box
would get about a fifth of a core; with its group's weight it gets its quota. On
the 2-core Intel Xeon VM: 0.19 of a core without the weight, 0.88 with it. The
check is on the CPU time the group's own counter shows, with the line far from
either, not on a speed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import optional

from edgebus.rehearse import cgroups

QUOTA_CORES = 0.9
SPINNERS_A_CORE = 4
WINDOW_S = 3.0
# Evenly shared, the box would get about 1 / (SPINNERS_A_CORE + 1) of a core, a fifth of
# its quota; weighted, all of it.
LEAST_SHARE_OF_QUOTA = 0.6
MEMORY_BYTES = 64 * 2**20
SPIN = ["sh", "-c", "while :; do :; done"]


@contextlib.contextmanager
def spinning(count: int, join: list[Path] | None = None) -> Iterator[None]:
    """`count` processes spinning on the CPU, each joined to the group of `join` if given."""

    def preexec() -> None:
        for path in join or []:
            path.write_text(str(os.getpid()))

    # Each in a session of its own: the kernel's autogroup would otherwise schedule all
    # the spinners started from this one session as one process.
    procs = [subprocess.Popen(SPIN, preexec_fn=preexec if join else None,
                              start_new_session=True) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@optional.needs(cgroups.missing(), "a rehearsal's control groups")
@optional.HOST_NETWORK
def test_a_box_gets_its_cpu_quota_on_a_busy_host() -> None:
    tree = cgroups.open_tree(f"test-{secrets.token_hex(3)}")
    try:
        group = tree.create("box", QUOTA_CORES, MEMORY_BYTES)
        with spinning(SPINNERS_A_CORE * len(os.sched_getaffinity(0))), \
                spinning(1, join=group.procs_files()):
            start_s, start_cpu = time.monotonic(), group.cpu_usage_s()
            time.sleep(WINDOW_S)
            share = (group.cpu_usage_s() - start_cpu) / (time.monotonic() - start_s)
    finally:
        tree.remove()
    assert share >= LEAST_SHARE_OF_QUOTA * QUOTA_CORES, f"the box got {share:.2f} of a core"


@optional.needs(cgroups.missing(), "a rehearsal's control groups")
@optional.HOST_NETWORK
def test_a_box_without_its_quota_has_no_priority_over_the_host() -> None:
    """Lifted (teardown, the fault tests), a box is uncapped: neither it nor the boxes'
    parent may keep the weight that puts them before the host's other processes."""
    tree = cgroups.open_tree(f"test-{secrets.token_hex(3)}")
    try:
        group = tree.create("box", QUOTA_CORES, MEMORY_BYTES)
        group.set_cpu(None)
        if isinstance(group, cgroups._V2Group):
            weights = [int((path / "cpu.weight").read_text())
                       for path in (group.path, group.path.parent)]
            assert weights == [cgroups.V2_DEFAULT_WEIGHT] * 2
        else:
            assert isinstance(group, cgroups._V1Group)
            shares = [int((path / "cpu.shares").read_text())
                      for path in (group.cpu, group.cpu.parent)]
            assert shares == [cgroups.V1_DEFAULT_SHARES] * 2
    finally:
        tree.remove()
