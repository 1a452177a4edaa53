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
import shutil
from pathlib import Path

import optional
import pytest

from edgebus.core.processes import cores
from edgebus.model_import import bundled_gguf
from edgebus.rehearse import Options, Rehearsal, cgroups, disk
from edgebus.rehearse.cgroups import CgroupError
from edgebus.rehearse.rehearsal import missing
from edgebus.rehearse.workload import Client, wait_online
from plant_config import make_plant
from plant_config.schema import BoxSpec, DiskSpec

# A card slower than any a Pi ships with, so that reading dominates a box's first start here:
# 5 MB/s reads a box's ~30 MB of SmolLM2 in ~6 s, where this machine's disk takes a fraction
# of a second and the agent's own start ~2 s.
CARD = DiskSpec(read_mb_s=5, write_mb_s=20)
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
def test_boxes_with_a_slow_card_read_the_model_cold_at_their_rate(tmp_path: Path) -> None:
    # A copy of its own: other processes on this machine (another test's agents) read the
    # bundled file and keep its pages in the page cache, which no box then reads from disk.
    model = tmp_path / "model.gguf"
    shutil.copyfile(bundled_gguf(), model)
    plant = make_plant(model, stages=2, weights="gguf")
    plant = plant.model_copy(update={
        "topic_root": f"edgebus-test/{secrets.token_hex(4)}",
        "boxes": [BoxSpec(name=spec.node, memory_mb=ROOMY_MB, disk=CARD)
                  for spec in plant.stages],
        "stages": [spec.model_copy(update={"kv_budget_mb": 64}) for spec in plant.stages]})
    workdir = tmp_path / "rehearse"
    nodes = [spec.node for spec in plant.stages]

    with Rehearsal(plant, workdir, Options(cpu_total=float(cores())),
                   progress=print) as running:
        running.start()

        async def online() -> None:
            async with Client(running.plant) as client:
                await wait_online(running, client, timeout=300)

        asyncio.run(online())
        shown = {node: limits(running.groups[node]) for node in nodes}
        counted = {node: running.online[node].disk for node in nodes}
        first_start_s = {node: running.online[node].seconds for node in nodes}

    [device] = disk.devices([model, workdir])
    stage_files = {node: next((workdir / "home" / "stages").glob(
        f"*.{spec.layers[0]}-{spec.layers[1]}.*.gguf")) for node, spec in zip(
            nodes, plant.stages, strict=True)}
    for node in nodes:
        lines = shown[node].splitlines()
        assert {f"{device} 5000000", f"{device} 20000000"} <= set(lines) or any(
            line.startswith(f"{device} rbps=5000000 wbps=20000000 ") for line in lines), shown
        read = counted[node]
        assert read is not None, counted
        # Each stage file went to the disk from its box (written back by the cut as it
        # went), its write metered by the box's limit.
        assert read.written >= stage_files[node].stat().st_size, (node, read)
        # Reading what it read takes the box at least this long at 5 MB/s; at this
        # machine's disk, a fraction of a second.
        start = first_start_s[node]
        assert start >= CARD.read_s(read.read), (node, start, read)
    # Cold: every byte of the model was read from the disk by one box or the other (the
    # boxes share this machine's page cache, so a page one box read the other may find
    # there: the embedding both cut, the fingerprint's pieces), through their limits.
    assert sum(c.read for c in counted.values() if c) >= model.stat().st_size * 0.95, counted


def test_a_file_on_no_block_device_cannot_be_held_to_a_rate() -> None:
    # /dev/shm is a tmpfs: its files' device numbers name no block device.
    with pytest.raises(CgroupError, match=r"/dev/shm is on no block device \(device 0:\d+: a "
                       r"tmpfs, an overlay or a btrfs subvolume\?\), so the io controller "
                       r"cannot hold a box's disk: to its rates"):
        disk.block_device(Path("/dev/shm"))
