"""A llama.cpp node refuses at start, before anything loads, when its box cannot hold its
share: a KV budget that holds no request, a control group too small (as root)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from edgebus.model_import import bundled_gguf
from plant_config import make_plant, write_plant

CGROUP_V1 = Path("/sys/fs/cgroup/memory")
# A box far smaller than a SmolLM2 stage with its default KV budget (~600 MiB).
TINY_BOX_MB = 200


def plant_file(tmp_path: Path, kv_budget_mb: int) -> Path:
    plant = make_plant(bundled_gguf(), stages=3, weights="gguf")
    stages = [spec.model_copy(update={"kv_budget_mb": kv_budget_mb}) for spec in plant.stages]
    path = tmp_path / "plant.yaml"
    write_plant(plant.model_copy(update={"stages": stages}), path)
    return path


def node(plant: Path, node_id: str, *, group: Path | None = None
         ) -> subprocess.CompletedProcess[str]:
    """`edgebus node` as a user runs it, in control group `group` where given. No broker
    runs: a node that got past its check would fail to connect, later and otherwise."""
    join = None if group is None else lambda: (group / "cgroup.procs").write_text(
        str(os.getpid()))
    return subprocess.run([sys.executable, "-m", "edgebus", "node", str(plant), "--id", node_id],
                          capture_output=True, text=True, timeout=120, preexec_fn=join,
                          env={**os.environ, "EDGEBUS_HOME": str(plant.parent / "home")})


def test_a_kv_budget_that_holds_no_request_refuses_before_loading(tmp_path: Path) -> None:
    done = node(plant_file(tmp_path, kv_budget_mb=10), "stage-1")
    assert done.returncode != 0
    assert ("stage-1: kv_budget_mb 10 holds no request of 5120 positions on layers [10, 20] "
            "(38 MiB each" in done.stderr), done.stderr
    assert not (tmp_path / "home" / "stages").exists()  # nothing was cut, nothing loaded


@pytest.fixture
def tiny_box() -> Iterator[Path]:
    """A cgroup v1 memory group of TINY_BOX_MB, where this machine lets us make one."""
    if os.geteuid() != 0 or not (CGROUP_V1 / "memory.limit_in_bytes").exists():
        pytest.skip("needs root and cgroup v1's memory hierarchy (the rehearsal tests cover v2)")
    group = CGROUP_V1 / f"edgebus-test-fit-{os.getpid()}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(TINY_BOX_MB << 20))
        yield group
    finally:
        group.rmdir()


def test_a_box_too_small_for_the_stage_refuses_before_loading(tmp_path: Path,
                                                                tiny_box: Path) -> None:
    done = node(plant_file(tmp_path, kv_budget_mb=512), "stage-1", group=tiny_box)
    assert done.returncode != 0
    assert "stage-1 cannot hold layers [10, 20] on this box: it needs" in done.stderr, done.stderr
    assert f"the box has {TINY_BOX_MB} MiB for it (its control group's limit" in done.stderr
    assert not (tmp_path / "home" / "stages").exists()


def test_up_refuses_a_plant_this_box_cannot_hold_before_starting_anything(
        tmp_path: Path, tiny_box: Path) -> None:
    plant = plant_file(tmp_path, kv_budget_mb=512)
    done = subprocess.run([sys.executable, "-m", "edgebus", "up", str(plant)],
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: (tiny_box / "cgroup.procs").write_text(
                              str(os.getpid())),
                          env={**os.environ, "EDGEBUS_HOME": str(tmp_path / "home")})
    assert done.returncode != 0
    assert "this machine cannot hold the plant: its agents need" in done.stderr, done.stderr
    assert f"its control group's limit ({TINY_BOX_MB} MiB" in done.stderr
    for node in ("stage-0", "stage-1", "stage-2"):
        assert f"  {node}: " in done.stderr
    assert "started" not in done.stdout  # no broker, no agent
    assert not (tmp_path / "home" / "stages").exists()
