"""The partition planner: which contiguous layers each box of a heterogeneous plant runs.

Pure functions over a measured cost model (`ModelCosts`, built by
`node_agent.profile`) and the plant's boxes. A stage's time is its share of
the model's per-request cost divided by its box's speed; a stage's memory is
its weights in its node's weight mode, its KV budget and the baseline every
agent process holds. The plan minimises the slowest stage's time subject to
every node's memory budget, exactly: dynamic programming over all contiguous
splits, O(stages x layers^2).

A pipeline stage with replicas is as slow as its slowest replica (the
coordinator may route a request to any of them) and must fit on every one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from edgebus.errors import PlantConfigError
from plant_config.layout import LayerRange, show
from plant_config.schema import Plant, WeightMode

MIB = 1 << 20

# The prefill the profile times: the coordinator's default prefill_chunk, the
# most positions a stage runs in one call.
PREFILL_POSITIONS = 128
# Decode steps a request is counted with against its one prefill chunk:
# `edgebus ask`'s default max_tokens. A short plant request (an alarm text
# and a few sentences back) is mostly decode steps, which a plan must balance.
REQUEST_TOKENS = 128
# Rows of the decode batch the profile also times: the request group the
# coordinator forms (node_agent/groups.py) when as many requests are in flight,
# which is what `edgebus rehearse` drives (its workload's ROWS_PER_GROUP).
BATCH_ROWS = 4


@dataclass(frozen=True)
class PartCost:
    """Time of one part of the model (a layer, the embedding, the head) on the profiling machine."""

    prefill_ms: float  # PREFILL_POSITIONS positions of one request
    decode_ms: float   # one position of one request
    batch_decode_ms: float  # one position of each of BATCH_ROWS requests, in one step

    @property
    def request_ms(self) -> float:
        """One request: a prefill chunk and REQUEST_TOKENS decode steps."""
        return self.prefill_ms + REQUEST_TOKENS * self.decode_ms


@dataclass(frozen=True)
class MessageCost:
    """CPU one decode message of BATCH_ROWS rows costs on the profiling machine, on loopback."""

    agent_ms: float   # the sending and the receiving agent together
    broker_ms: float  # Mosquitto, routing it


@dataclass(frozen=True)
class PartBytes:
    """Weight bytes of one part of the model in each weight mode."""

    fp32: int
    bf16: int
    int8: int
    int4: int
    gguf: int = 0  # the GGUF's own blocks, as the file holds them (0: no model.gguf)

    def __getitem__(self, mode: WeightMode) -> int:
        value: int = getattr(self, mode)
        return value


@dataclass(frozen=True)
class ModelCosts:
    """What the planner knows about a model: per-part time and weight bytes, per-process memory.

    `head` is the final norm and the LM head; with `tied` its matrix is the
    embedding's, held once by a stage that owns both, unless `packed_fp32`: an
    fp32 stage packs the head into a copy of its own (node_agent/packed.py).
    """

    layers: tuple[PartCost, ...]
    embedding: PartCost
    head: PartCost
    layer_bytes: tuple[PartBytes, ...]
    embedding_bytes: PartBytes
    head_bytes: PartBytes
    tied: bool
    # Resident memory of an agent process before it loads any weight.
    baseline_bytes: int
    # None: not measured, Mosquitto was not installed where the model was profiled.
    message: MessageCost | None = None
    packed_fp32: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def stage_ms(self, layers: LayerRange, speed: float) -> float:
        """Per-request time of a stage running `layers` on a box `speed` times the profiler's."""
        first, stop = layers
        total = sum(cost.request_ms for cost in self.layers[first:stop])
        if first == 0:
            total += self.embedding.request_ms
        if stop == self.num_layers:
            total += self.head.request_ms
        return total / speed

    def batch_step_ms(self, layers: LayerRange, speed: float) -> float:
        """One decode step of BATCH_ROWS rows of a stage running `layers` on a box `speed`
        times the profiler's."""
        first, stop = layers
        total = sum(cost.batch_decode_ms for cost in self.layers[first:stop])
        if first == 0:
            total += self.embedding.batch_decode_ms
        if stop == self.num_layers:
            total += self.head.batch_decode_ms
        return total / speed

    def weight_bytes(self, layers: LayerRange, mode: WeightMode) -> int:
        """Bytes of weights a stage running `layers` holds in weight mode `mode`."""
        first, stop = layers
        total = sum(part[mode] for part in self.layer_bytes[first:stop])
        if first == 0:
            total += self.embedding_bytes[mode]
        if stop == self.num_layers:
            total += self.head_bytes[mode]
            # One matrix, counted above already, where the engine shares it: not where
            # oneDNN packs the fp32 head apart, nor where onnxruntime's head graph holds
            # its own copy beside the embedding's lookup table (int8, int4).
            shared = mode in ("bf16", "gguf") or (mode == "fp32" and not self.packed_fp32)
            if first == 0 and self.tied and shared:
                total -= self.embedding_bytes[mode]
        return total


@dataclass(frozen=True)
class Box:
    """One node as the planner sees it: its box's budget and speed, its stage's settings."""

    node: str
    memory_bytes: int
    speed: float
    weights: WeightMode
    kv_bytes: int
    device: str | None = None

    def need_bytes(self, costs: ModelCosts, layers: LayerRange) -> int:
        """Memory this node needs to run `layers`: weights, KV budget, the process itself."""
        return costs.weight_bytes(layers, self.weights) + self.kv_bytes + costs.baseline_bytes


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage of a plan: its layers and the nodes (replicas) that run them."""

    layers: LayerRange
    boxes: tuple[Box, ...]
    time_ms: float                  # per request, on the slowest replica
    need_bytes: tuple[int, ...]     # per node, in the order of `boxes`


@dataclass(frozen=True)
class Plan:
    stages: tuple[StagePlan, ...]

    @property
    def slowest_ms(self) -> float:
        return max(stage.time_ms for stage in self.stages)

    def to_json(self) -> dict[str, Any]:
        """The plan as `edgebus plan --json` prints it: every node with its [first, last + 1]."""
        return {"stages": [{"node": box.node, "layers": list(stage.layers)}
                           for stage in self.stages for box in stage.boxes]}


def plant_boxes(plant: Plant) -> list[tuple[Box, ...]]:
    """The plant's pipeline stages in order, each as the boxes of its replica nodes."""
    if plant.boxes is None:
        raise PlantConfigError(
            "the plant file has no boxes: section — the planner needs each stage node's box: "
            "add `boxes: [{name: NODE, memory_mb: MIB, speed: 1.0}, ...]` (docs/plant-file.md)")
    by_name = {box.name: box for box in plant.boxes}
    return [tuple(Box(node=spec.node, memory_bytes=by_name[spec.node].memory_mb * MIB,
                      speed=by_name[spec.node].speed, weights=spec.weights,
                      kv_bytes=spec.kv_budget_mb * MIB, device=by_name[spec.node].device)
                  for spec in stage.nodes)
            for stage in plant.pipeline]


def evaluate(costs: ModelCosts, stages: Sequence[tuple[Box, ...]],
             ranges: Sequence[LayerRange]) -> Plan:
    """Time and memory of running `ranges` on `stages` (feasible or not)."""
    return Plan(tuple(
        StagePlan(layers, boxes, _replicas_ms(costs, boxes, layers),
                  tuple(box.need_bytes(costs, layers) for box in boxes))
        for boxes, layers in zip(stages, ranges, strict=True)))


def _replicas_ms(costs: ModelCosts, boxes: tuple[Box, ...], layers: LayerRange) -> float:
    """A stage's time: a request may be routed to any replica, so the slowest one's."""
    return max(costs.stage_ms(layers, box.speed) for box in boxes)


def plan(costs: ModelCosts, stages: Sequence[tuple[Box, ...]]) -> Plan:
    """The contiguous split with the lowest slowest-stage time that fits every node's memory.

    Raises PlantConfigError if no split fits, saying how much memory is
    missing at the least and on which boxes.
    """
    n_layers = costs.num_layers
    if not 1 <= len(stages) <= n_layers:
        raise PlantConfigError(f"cannot plan {len(stages)} stages over the model's {n_layers} "
                               f"layers: every stage needs at least one — use 1 to {n_layers} "
                               "stage nodes")

    def time_if_fits(index: int, layers: LayerRange) -> float:
        boxes = stages[index]
        if any(box.need_bytes(costs, layers) > box.memory_bytes for box in boxes):
            return math.inf
        return _replicas_ms(costs, boxes, layers)

    ranges, slowest = best_split(n_layers, len(stages), time_if_fits, max)
    if math.isfinite(slowest):
        return evaluate(costs, stages, ranges)
    raise _infeasible(costs, stages)


def _infeasible(costs: ModelCosts, stages: Sequence[tuple[Box, ...]]) -> PlantConfigError:
    """The error for a model that fits no split: the split missing the least memory, and where."""

    def shortfall(index: int, layers: LayerRange) -> float:
        # In whole MiB per box, as the message shows them, so the total is their sum.
        return sum(_mib_up(max(0, box.need_bytes(costs, layers) - box.memory_bytes))
                   for box in stages[index])

    ranges, missing = best_split(costs.num_layers, len(stages), shortfall, _add)
    closest = evaluate(costs, stages, ranges)
    short = [f"  {box.node}: {_mib_up(need - box.memory_bytes)} MiB over its memory_mb "
             f"{box.memory_bytes // MIB} with layers {show(stage.layers)} in {box.weights} "
             f"(weights {_mib_up(costs.weight_bytes(stage.layers, box.weights))} + KV budget "
             f"{box.kv_bytes // MIB} + process {_mib_up(costs.baseline_bytes)} MiB)"
             for stage in closest.stages
             for box, need in zip(stage.boxes, stage.need_bytes, strict=True)
             if need > box.memory_bytes]
    return PlantConfigError(
        f"the model does not fit these boxes: it needs at least {int(missing)} MiB "
        "more; the split that misses the least:\n" + "\n".join(short) + "\n"
        "— raise memory_mb, lower kv_budget_mb, choose a smaller weight mode (weights: bf16 "
        "or int8) or add a box")


def balanced_split(costs: ModelCosts, n_stages: int) -> list[LayerRange]:
    """The contiguous split over `n_stages` equal boxes with the lowest slowest-stage time.

    Not an even split: the last stage also runs the LM head, on SmolLM2 worth
    6-9 layers of decode time.
    """
    ranges, _ = best_split(costs.num_layers, n_stages,
                           lambda _, layers: costs.stage_ms(layers, 1.0), max)
    return ranges


def best_split(n_layers: int, n_stages: int, cost: Callable[[int, LayerRange], float],
               combine: Callable[[float, float], float]) -> tuple[list[LayerRange], float]:
    """The contiguous split of `n_layers` into `n_stages` non-empty ranges with the lowest
    total, where the total folds each stage's `cost(stage index, range)` (>= 0, inf for a
    range the stage cannot take) with `combine`: `max` for the slowest stage, addition for
    a sum. Ties go to the first split found, so the result is deterministic.
    """
    # best[s][j]: lowest total of stages 0..s-1 over layers [0, j); cut[s][j]: where stage
    # s-1 starts in that split. 0 is the identity of both max and + over costs >= 0.
    best = [[math.inf] * (n_layers + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for stage in range(1, n_stages + 1):
        # Every stage before and after this one keeps at least one layer.
        for stop in range(stage, n_layers - (n_stages - stage) + 1):
            for first in range(stage - 1, stop):
                if best[stage - 1][first] == math.inf:
                    continue
                total = combine(best[stage - 1][first], cost(stage - 1, (first, stop)))
                if total < best[stage][stop]:
                    best[stage][stop], cut[stage][stop] = total, first
    if best[n_stages][n_layers] == math.inf:
        return [], math.inf
    ranges: list[LayerRange] = []
    stop = n_layers
    for stage in range(n_stages, 0, -1):
        first = cut[stage][stop]
        ranges.append((first, stop))
        stop = first
    return ranges[::-1], best[n_stages][n_layers]


def _add(a: float, b: float) -> float:
    return a + b


def _mib_up(n_bytes: int) -> int:
    """Bytes in MiB, rounded up: a shortfall rounded down could leave the box still short."""
    return -(-n_bytes // MIB)


def plan_table(result: Plan, costs: ModelCosts, current: Plan | None = None) -> str:
    """A plan as `edgebus plan` prints it, with the cost model it came from.

    `current`: the plant file's own split, for comparison.
    """
    layer_decode = [cost.decode_ms for cost in costs.layers]
    layer_prefill = [cost.prefill_ms for cost in costs.layers]
    lines = [
        f"cost on the profiling machine: a layer {min(layer_prefill):.1f}-"
        f"{max(layer_prefill):.1f} ms per {PREFILL_POSITIONS}-position prefill, "
        f"{min(layer_decode):.2f}-{max(layer_decode):.2f} ms per decode step; embedding "
        f"{costs.embedding.prefill_ms:.1f} / {costs.embedding.decode_ms:.2f} ms; norm + LM head "
        f"{costs.head.prefill_ms:.1f} / {costs.head.decode_ms:.2f} ms; agent process "
        f"{_mib_up(costs.baseline_bytes)} MiB", ""]
    header = ("stage", "node", "device", "speed", "weights", "layers", "ms/request",
              "memory MiB", "memory_mb")
    rows = [header]
    for index, stage in enumerate(result.stages):
        for box, need in zip(stage.boxes, stage.need_bytes, strict=True):
            rows.append((str(index), box.node, box.device or "-", f"{box.speed:g}", box.weights,
                         f"{show(stage.layers)} ({stage.layers[1] - stage.layers[0]})",
                         f"{costs.stage_ms(stage.layers, box.speed):.0f}", str(_mib_up(need)),
                         str(box.memory_bytes // MIB)))
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
              .rstrip() for row in rows]
    lines += ["", f"slowest stage: {result.slowest_ms:.0f} ms per request (a "
                  f"{PREFILL_POSITIONS}-position prefill and {REQUEST_TOKENS} decode steps, "
                  "profiled time / box speed)"]
    if current is not None:
        over = [box.node for stage in current.stages
                for box, need in zip(stage.boxes, stage.need_bytes, strict=True)
                if need > box.memory_bytes]
        lines.append(f"the plant file's split: {current.slowest_ms:.0f} ms "
                     f"({current.slowest_ms / result.slowest_ms:.2f}x the plan's)"
                     + (f"; over memory_mb on {', '.join(over)}" if over else ""))
    return "\n".join(lines)
