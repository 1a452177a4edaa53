"""Whether each box of a rehearsal holds what the planner counts for it, checked before
anything starts: a box that cannot is refused with the numbers, not left to the kernel's
OOM killer ("exited with code -9") or to evicting its own mmapped weights.
"""

from __future__ import annotations

from edgebus.rehearse.rehearsal import Options
from edgebus.rehearse.sizing import box_shares, broker_box, coordinator_box
from plant_config import Plant
from plant_config.placement import services
from plant_config.planner import ModelCosts, evaluate, plant_boxes, shortfalls
from plant_config.stage_memory import MIB


def check_boxes(plant: Plant, costs: ModelCosts, options: Options
                ) -> tuple[list[str], dict[str, str]]:
    """(a line for every box that cannot hold its part of `plant` as rehearsed with
    `options`, empty when all can; what the plan counts for each node, in words)."""
    shares = box_shares(plant, cpu_total=options.cpu_total, memory_scale=options.memory_scale)
    broker = broker_box(plant, shares, options.broker_box)
    coordinator = coordinator_box(shares, broker, options.coordinator_box)
    stages = plant_boxes(plant, memory_scale=options.memory_scale,
                         placed=services(plant, broker, coordinator))
    result = evaluate(costs, stages, [stage.layers for stage in plant.pipeline])
    planned = {box.node: f"the plan counts {-(-need // MIB)} MiB for its box "
                         f"({box.memory(costs, stage.layers).describe()})"
               for stage in result.stages
               for box, need in zip(stage.boxes, stage.need_bytes, strict=True)}
    return shortfalls(costs, result), planned
