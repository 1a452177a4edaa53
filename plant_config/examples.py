"""Example plants `edgebus init --example NAME` writes: real box mixes, layers from the planner."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from edgebus.core.errors import PlantConfigError
from plant_config.layout import even_split
from plant_config.problems import from_validation_error, plant_error
from plant_config.schema import Plant, WeightMode

if TYPE_CHECKING:
    from plant_config.planner import ModelCosts, Plan


@dataclass(frozen=True)
class Example:
    broker: str
    # BoxSpec fields of each box, in pipeline order; each box runs one stage.
    boxes: tuple[dict[str, Any], ...]


# The example boxes' storage, MB/s (BoxSpec.disk). Replace them with the box's own: `dd
# if=A_BIG_FILE of=/dev/null bs=1M iflag=direct` reads it, `dd if=/dev/zero of=FILE bs=1M
# count=1024 oflag=direct` writes it (docs/plant-file.md).
# A Raspberry Pi 5's microSD card: the Pi 5 drives it in SDR104 mode, whose bus carries at
# most 104 MB/s, and sequential reads measure ~90 (a Pi 4's DDR50 bus held every card to
# ~44: pidramble.com's microSD benchmarks); writes are the card's, and a U3 / V30 card is
# rated for at least 30 MB/s sustained (the SD Association's speed classes), as good cards
# measured 32-40 MB/s on a Pi 4 (pidramble.com).
PI5_SD_CARD = {"read_mb_s": 90, "write_mb_s": 30}
# A Jetson Orin Nano developer kit with an NVMe drive in its M.2 Key M slot (PCIe Gen3 x4,
# ~3,900 MB/s on the link): a budget DRAM-less drive reads ~1,500 MB/s sequentially, and
# sustains 200-500+ MB/s of writes past its cache (edgeaistack.app, "NVMe vs SD card for
# Jetson"). Booted from its microSD card instead, it reads as the Pi 5 does.
ORIN_NANO_NVME = {"read_mb_s": 1500, "write_mb_s": 500}

EXAMPLES: dict[str, Example] = {
    # The seed's plant. 6 GiB of each 8 GB box leaves 2 GB for the OS,
    # Mosquitto and (on the Jetson) JetPack's services. The Jetson comes last:
    # the last stage also runs the LM head, which costs as much per decoded
    # token as ~6 SmolLM2 layers, so the fastest box should take it.
    "jetson-2pi": Example(
        broker="mqtts://jetson:8883",  # Mosquitto on the Jetson, TLS
        boxes=({"name": "pi-1", "memory_mb": 6144, "device": "rpi5", "speed": 1.0,
                "disk": PI5_SD_CARD},
               {"name": "pi-2", "memory_mb": 6144, "device": "rpi5", "speed": 1.0,
                "disk": PI5_SD_CARD},
               {"name": "jetson", "memory_mb": 6144, "device": "jetson-orin-nano",
                "speed": 3.0, "disk": ORIN_NANO_NVME})),
}


def example_plant(name: str, model_dir: str | os.PathLike[str], costs: ModelCosts, *,
                  broker: str | None = None, topic_root: str | None = None,
                  weights: WeightMode = "fp32") -> Plant:
    """The example plant `name` for the model in `model_dir`, its layers split by the planner."""
    # Here, not at the top: `edgebus` reads EXAMPLES for its --example choices on every
    # command, agents' included, and the planner brings numpy (a broker's 0.1 s of start).
    from plant_config.planner import plan, plant_boxes
    from plant_config.stage_memory import INIT_KV_REQUESTS

    if name not in EXAMPLES:
        raise PlantConfigError(f"no example plant {name!r} — choose one of "
                               f"{', '.join(sorted(EXAMPLES))}")
    example = EXAMPLES[name]
    ranges = even_split(costs.num_layers, len(example.boxes))  # replaced by the plan's
    data = {"plant_id": "plant", "topic_root": topic_root or "edgebus/plant",
            "broker": {"url": broker or example.broker},
            "model": Path(model_dir).expanduser().resolve(), "boxes": list(example.boxes),
            "stages": [{"node": box["name"], "layers": layers, "weights": weights}
                       for box, layers in zip(example.boxes, ranges, strict=True)]}
    plant = _validated(data)
    # llama.cpp nodes' budgets as `edgebus init` writes them after the plan (with_kv_budgets).
    kv_requests = INIT_KV_REQUESTS if weights == "gguf" else 0
    return with_plan(plant, plan(costs, plant_boxes(plant, kv_requests=kv_requests)))


def with_plan(plant: Plant, result: Plan) -> Plant:
    """`plant` with every stage node's layers taken from `result`."""
    layers = {box.node: stage.layers for stage in result.stages for box in stage.boxes}
    # Only what was set: defaults given back as values would read as set on purpose
    # (an external broker refuses an embedded broker's host and port).
    data = plant.model_dump(exclude_unset=True)
    data["stages"] = [{**stage, "layers": layers[stage["node"]]} for stage in data["stages"]]
    return _validated(data)


def _validated(data: dict[str, Any]) -> Plant:
    try:
        return Plant.model_validate(data)
    except ValidationError as exc:
        raise plant_error(None, from_validation_error(exc, Plant)) from None
