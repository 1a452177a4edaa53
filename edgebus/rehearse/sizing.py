"""How much of this machine each box of a plant gets: CPU share, memory, link; where the
broker and the coordinator run.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from edgebus.core.errors import EdgebusError
from edgebus.core.processes import cores
from plant_config.schema import DiskSpec, Plant

MIB = 1 << 20
# Cores all boxes together get by default. Not the whole machine: the
# rehearsal's own client, the kernel's network work and whatever else runs
# here need some, and a quota the machine cannot actually deliver would make a
# box slower than its share says.
DEFAULT_CPU_TOTAL = 1.5
# Each stage runs on one thread (the planner's profile times one thread, so
# the prediction scales it by the share alone); a quota above one core would
# go unused.
MAX_BOX_CORES = 1.0


@dataclass(frozen=True)
class BoxShare:
    """One box of the plant as the rehearsal builds it."""

    box: str
    speed: float
    cpu_cores: float
    memory_bytes: int
    link_mbit: float | None
    disk: DiskSpec | None = None


def box_shares(plant: Plant, *, cpu_total: float | None = None,
               memory_scale: float = 1.0) -> list[BoxShare]:
    """Every box's share: CPU in proportion to its `speed`, the shares summing to `cpu_total`
    (default DEFAULT_CPU_TOTAL, at most this machine's cores); memory_mb x `memory_scale`."""
    if plant.boxes is None:
        raise EdgebusError("the plant file has no boxes: section, so there is nothing to "
                           "rehearse — add `boxes: [{name: NODE, memory_mb: MIB, speed: 1.0}, "
                           "...]`, one per stage node (docs/plant-file.md)")
    total = min(DEFAULT_CPU_TOTAL, cores()) if cpu_total is None else cpu_total
    if total <= 0 or memory_scale <= 0:
        raise EdgebusError("--cpus and --memory-scale must be above 0")
    if total > cores():
        raise EdgebusError(f"--cpus {total:g} is more than the {cores()} cores this process may "
                           "use: the boxes would get less than their quotas say")
    speeds = sum(box.speed for box in plant.boxes)
    return [BoxShare(box=box.name, speed=box.speed,
                     cpu_cores=min(MAX_BOX_CORES, total * box.speed / speeds),
                     memory_bytes=int(box.memory_mb * memory_scale * MIB),
                     link_mbit=box.link_mbit, disk=box.disk)
            for box in plant.boxes]


def broker_box(plant: Plant, shares: list[BoxShare], chosen: str | None = None) -> str:
    """The box the broker runs on: `chosen`, else the box its URL's host names, else the
    fastest (first of the fastest in pipeline order), where a plant would put Mosquitto."""
    names = [share.box for share in shares]
    if chosen is not None:
        return _known(chosen, names, "--broker-box")
    host = plant.broker.endpoint().host
    if host in names:
        return host
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not plant.broker.embedded:
            raise EdgebusError(f"the broker's host {host!r} is not a box of the plant (boxes: "
                               f"{', '.join(names)}) — name the box with --broker-box") from None
    return max(shares, key=lambda share: share.speed).box


def _known(box: str, names: list[str], option: str) -> str:
    if box not in names:
        raise EdgebusError(f"{option} {box!r} is not a box of the plant (boxes: "
                           f"{', '.join(names)})")
    return box


def coordinator_box(shares: list[BoxShare], broker: str, chosen: str | None = None) -> str:
    """The box the coordinator runs on: `chosen`, else the broker's."""
    return broker if chosen is None else _known(chosen, [s.box for s in shares],
                                                "--coordinator-box")
