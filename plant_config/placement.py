"""Which box of a plant the broker and the coordinator run on, where they share a stage's
memory: what the planner counts on that box, and where `edgebus rehearse` starts them.
"""

from __future__ import annotations

import ipaddress
from typing import Literal

from plant_config.schema import Plant

Service = Literal["mosquitto", "embedded-broker", "coordinator"]


def fastest_box(plant: Plant) -> str:
    """The first of the fastest boxes in the plant file's order: where a plant would put
    Mosquitto and the coordinator when nothing says otherwise."""
    assert plant.boxes is not None
    return max(plant.boxes, key=lambda box: box.speed).name


def broker_box(plant: Plant) -> str | None:
    """The box the broker runs on as far as the plant file tells: the one its URL's host
    names (`mqtt://jetson:1883`: box `jetson`), the fastest for the embedded broker or an
    address; None for a host that is no box of the plant (the broker runs elsewhere)."""
    if plant.boxes is None:
        return None
    host = plant.broker.endpoint().host
    if host in {box.name for box in plant.boxes}:
        return host
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if not plant.broker.embedded:
            return None
    return fastest_box(plant)


def services(plant: Plant, broker: str | None, coordinator: str | None
             ) -> dict[str, tuple[Service, ...]]:
    """What runs beside the stage on each box: the broker on `broker`, the coordinator on
    `coordinator` (None: on no box of the plant)."""
    placed: dict[str, tuple[Service, ...]] = {}
    if broker is not None:
        placed[broker] = ("embedded-broker" if plant.broker.embedded else "mosquitto",)
    if coordinator is not None:
        placed[coordinator] = (*placed.get(coordinator, ()), "coordinator")
    return placed
