"""Memory in a rehearsal: boxes that cannot hold their part are refused before anything
starts, with the numbers; a stage the kernel's OOM killer ends is reported as such, with
its box's limit and what the box held, not as "exited with code -9"."""

from __future__ import annotations

import asyncio
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import optional
import pytest
from gguf_models import PROCESS_KV_BUDGET_MB, quick_llama_cpp_profile

from edgebus.cli import main
from edgebus.core.errors import EdgebusError
from edgebus.core.processes import cores
from edgebus.model_import import bundled_gguf
from edgebus.rehearse import Options, Rehearsal, one_box_variant
from edgebus.rehearse.fit import check_boxes
from edgebus.rehearse.rehearsal import missing
from edgebus.rehearse.workload import Client, wait_online
from node_agent.costs import model_costs
from plant_config import BrokerSettings, Plant, StageSpec, make_plant, write_plant
from plant_config.schema import BoxSpec

# SmolLM2's 10-layer llama.cpp stage with a 64 MiB KV budget needs ~340 MiB on its box.
SMALL_BOX_MB = 256
ROOMY_MB = 1024
# Less than a Python importing torch holds (~300 MiB): a torch stage cannot start in it.
TINY_MB = 120


@pytest.fixture(scope="module", autouse=True)
def quick_profile(edgebus_home: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """SmolLM2's llama.cpp profile made quick (gguf_models.quick_llama_cpp_profile), kept in
    a profiles directory of this module's own: these tests need its sizes, not steady times,
    and the machine's cache keeps the full profile (on a fresh machine the full one took 10 s)."""
    home = tmp_path_factory.mktemp("quick-profile-home")
    for entry in edgebus_home.iterdir():
        if entry.name != "profiles":
            (home / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EDGEBUS_HOME", str(home))
        quick_llama_cpp_profile(patch)
        yield


def gguf_plant(tmp_path: Path, memory_mb: int) -> Path:
    plant = make_plant(bundled_gguf(), stages=3, weights="gguf")
    stages = [spec.model_copy(update={"kv_budget_mb": 64}) for spec in plant.stages]
    boxes = [BoxSpec(name=spec.node, memory_mb=memory_mb) for spec in stages]
    path = tmp_path / "plant.yaml"
    write_plant(plant.model_copy(update={"stages": stages, "boxes": boxes}), path)
    return path


def test_boxes_too_small_are_refused_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # No root needed: the check comes before any namespace or control group.
    with pytest.raises(SystemExit) as exited:
        main(["rehearse", str(gguf_plant(tmp_path, SMALL_BOX_MB))])
    assert exited.value.code != 0
    err = capsys.readouterr().err
    assert "cannot hold their parts as rehearsed" in err and "nothing was started" in err, err
    assert re.search(rf"stage-0: \d+ MiB over its memory_mb {SMALL_BOX_MB} with layers "
                     r"\[0, 10\] in gguf \(weights \d+ \+ KV \d+ \+ llama.cpp buffers \d+ \+ "
                     r"process 64 \+ broker and coordinator \d+ \+ headroom 64 MiB\)", err), err


def test_one_box_alone_is_refused_when_it_cannot_hold_the_model(tmp_path: Path) -> None:
    from plant_config import load_plant

    plant = load_plant(gguf_plant(tmp_path, ROOMY_MB // 2))
    costs, _, _ = model_costs(bundled_gguf())
    options = Options(cpu_total=1.0)
    assert check_boxes(plant, costs, options)[0] == []  # the plant itself fits
    alone, alone_options = one_box_variant(plant, "stage-2", options)
    refused, _ = check_boxes(alone, costs, alone_options)
    # 64 MiB holds no request of 5120 positions on all 30 layers (113 MiB each).
    assert refused and "stage-2: kv_budget_mb 64 holds no request of 5120 positions on " \
        "layers [0, 30] (113 MiB each)" in refused[0], refused


def _failed_start(plant: Plant, tmp_path: Path, box: str) -> tuple[str, int]:
    """Rehearse `plant` past the rehearsal's own check; the error its start ends in, and the
    OOM kills in `box`."""

    async def start() -> None:
        async with Client(running.plant) as client:
            await wait_online(running, client, timeout=300)

    with Rehearsal(plant, tmp_path / "rehearse", Options(cpu_total=float(cores())),
                   progress=print) as running:
        running.start()
        with pytest.raises(EdgebusError) as caught:
            asyncio.run(start())
        kills = running.groups[box].oom_kills()
    return str(caught.value), kills


@optional.needs(missing(), "a rehearsal")
@optional.HOST_NETWORK
def test_a_llama_cpp_stage_in_a_box_too_small_refuses_itself_with_the_numbers(
        tmp_path: Path) -> None:
    """The node's own check, inside its box, reads the box's limit: past the rehearsal's
    check (as `bigger_than_any_box.py` starts a rehearsal), nothing loads and the kernel
    kills nothing."""
    plant = make_plant(bundled_gguf(), stages=2, weights="gguf").model_copy(update={
        "topic_root": f"edgebus-test/{secrets.token_hex(4)}",
        "boxes": [BoxSpec(name="stage-0", memory_mb=ROOMY_MB),
                  BoxSpec(name="stage-1", memory_mb=TINY_MB)]})

    message, kills = _failed_start(plant, tmp_path, "stage-1")
    assert kills == 0, message
    assert re.search(rf"stage-1 cannot hold layers \[15, 30\] on this box: it needs \d+ MiB "
                     rf"\(weights \d+ .*\) and the box has \d+ MiB for it \(its control "
                     rf"group's limit \({TINY_MB} MiB", message), message


@optional.needs(missing(), "a rehearsal")
@optional.HOST_NETWORK
def test_a_stage_killed_by_the_oom_killer_is_reported_with_the_numbers(
        tmp_path: Path, tiny_llama_gguf: Path) -> None:
    # The killed stage is torch's; the broker's box runs its stage on llama.cpp, which
    # starts without importing torch: it never serves, the plant dies before coming online.
    plant = Plant(
        plant_id="rehearse", topic_root=f"edgebus-test/{secrets.token_hex(4)}",
        broker=BrokerSettings(url="mqtt://roomy:1883"), model=tiny_llama_gguf,
        boxes=[BoxSpec(name="roomy", memory_mb=ROOMY_MB), BoxSpec(name="tiny",
                                                                  memory_mb=TINY_MB)],
        stages=[StageSpec(node="roomy", layers=(0, 3), weights="gguf",
                          kv_budget_mb=PROCESS_KV_BUDGET_MB),
                StageSpec(node="tiny", layers=(3, 6))])

    message, _ = _failed_start(plant, tmp_path, "tiny")
    print(message)
    assert re.search(rf"tiny \(pid \d+\) was killed by the kernel's OOM killer, out of memory "
                     rf"\(limit {TINY_MB} MiB \(box tiny: memory_mb x --memory-scale, its "
                     r"control group's limit\); \d+ MiB held at the peak", message), message
    assert "before the plant came online" in message
