"""A box's disk in a rehearsal: a box with a `disk:` reads its stage file's share of the model
cold, through its io limit, and its cut's write is charged to it too.

Checked through what each box's io controller counted (io.stat, or blkio's
throttle.io_service_bytes on cgroup v1), not through wall time: the box with a
20 MB/s card is limited on the disk that holds the model and the stage files,
has read at least its share from that disk (a model left in the page cache
would read nothing), has written its stage file there, and has not come online
sooner than its reads take at 20 MB/s, which only the limit makes true on this
machine's disk.
"""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

import optional

from edgebus.core.processes import cores
from edgebus.model_import import bundled_gguf
from edgebus.rehearse import Options, Rehearsal, cgroups, disk
from edgebus.rehearse.rehearsal import missing
from edgebus.rehearse.workload import Client, wait_online
from plant_config import make_plant
from plant_config.schema import BoxSpec, DiskSpec

# An SD card slower than any a Pi ships with: 20 MB/s, a box's share of SmolLM2 in seconds.
CARD = DiskSpec(read_mb_s=20, write_mb_s=20)
ROOMY_MB = 1024


def limits(group: cgroups.BoxGroup) -> str:
    """The io limits the box's group holds, as the kernel shows them."""
    if isinstance(group, cgroups._V2Group):
        return (group.path / "io.max").read_text()
    assert isinstance(group, cgroups._V1Group) and group.blkio is not None
    return (group.blkio / "blkio.throttle.read_bps_device").read_text() + (
        group.blkio / "blkio.throttle.write_bps_device").read_text()


@optional.needs(missing(), "a rehearsal")
@optional.HOST_NETWORK
def test_a_box_with_a_slow_card_reads_its_share_cold_at_its_rate(tmp_path: Path) -> None:
    model = bundled_gguf()
    plant = make_plant(model, stages=2, weights="gguf").model_copy(update={
        "topic_root": f"edgebus-test/{secrets.token_hex(4)}",
        "boxes": [BoxSpec(name="stage-0", memory_mb=ROOMY_MB, disk=CARD),
                  BoxSpec(name="stage-1", memory_mb=ROOMY_MB)]})
    plant = plant.model_copy(update={"stages": [
        spec.model_copy(update={"kv_budget_mb": 64}) for spec in plant.stages]})
    workdir = tmp_path / "rehearse"

    with Rehearsal(plant, workdir, Options(cpu_total=float(cores())),
                   progress=print) as running:
        running.start()

        async def online() -> None:
            async with Client(running.plant) as client:
                await wait_online(running, client, timeout=300)

        asyncio.run(online())
        slow, unlimited = running.groups["stage-0"], running.groups["stage-1"]
        shown = limits(slow)
        counted = running.disk_at_online["stage-0"]
        first_start_s = running.first_start_s("stage-0")
        assert "20000000" not in limits(unlimited)

    [device] = disk.devices([model, workdir])
    assert f"{device} 20000000" in shown or f"{device} rbps=20000000 wbps=20000000" in shown, \
        shown
    [stage_file] = (workdir / "home" / "stages").glob("*.0-15.first.*.gguf")
    assert counted is not None and first_start_s is not None
    # Cold: the cut read its layers and the embedding from the disk, through the box's limit
    # (the stand-in LM head it writes is never read, so a part of the file's size).
    assert counted.read >= stage_file.stat().st_size // 2, counted
    # The stage file went to the disk from the box (synced by the cut), its write metered too.
    assert counted.written >= stage_file.stat().st_size, counted
    # Reading what it read takes the box at least this long at 20 MB/s; unlimited, this
    # machine's disk reads it in a fraction of that.
    assert first_start_s >= CARD.read_s(counted.read), (first_start_s, counted)
