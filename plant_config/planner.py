"""The partition planner: which contiguous layers each box of a heterogeneous plant runs.

Pure functions over a measured cost model (`ModelCosts`, built by
`node_agent.profile`) and the plant's boxes. A stage's time is its share of
the model's per-request cost divided by its box's speed; a stage's memory is
its weights in its node's weight mode, its KV budget and the baseline every
agent process holds; for a llama.cpp (`gguf`) node, what the box really holds
(plant_config/stage_memory.py): the mmapped stage GGUF, the KV llama.cpp
reserves at the plant's sequence limits, its buffers and vocabulary, the broker
and the coordinator where they share the box, and headroom. A llama.cpp node
whose budget holds no request of the plant's longest length cannot take the
layers at all (it would refuse to start). The plan minimises the slowest stage's time subject to
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

from edgebus.core.errors import PlantConfigError
from plant_config.layout import LayerRange, show
from plant_config.placement import Service, broker_box, services
from plant_config.schema import DiskSpec, Plant, WeightMode
from plant_config.stage_memory import (
    COORDINATOR_BYTES,
    EMBEDDED_BROKER_BYTES,
    HEADROOM_BYTES,
    MIB,
    MOSQUITTO_BYTES,
    ContextShape,
    LlamaCppShape,
    context_shape,
    standin_bytes,
)

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

    def rows_ms(self, rows: float) -> float:
        """One decode step of `rows` requests: the two profiled batches' line through it
        (each row adds its activations' share; the weights are read once a step)."""
        per_row = (self.batch_decode_ms - self.decode_ms) / (BATCH_ROWS - 1)
        return self.decode_ms + (rows - 1) * per_row

    def positions_ms(self, positions: float) -> float:
        """One prompt chunk of `positions` positions of one request: the line through the
        profiled one-position step and PREFILL_POSITIONS-position chunk."""
        per_position = (self.prefill_ms - self.decode_ms) / (PREFILL_POSITIONS - 1)
        return self.decode_ms + (positions - 1) * per_position


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
    # The GGUF's shape, which sizes a llama.cpp node's KV and buffers (None: not a GGUF).
    llamacpp: LlamaCppShape | None = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def stage_ms(self, layers: LayerRange, speed: float) -> float:
        """Per-request time of a stage running `layers` on a box `speed` times the profiler's."""
        return self._stage_ms(layers, lambda cost: cost.request_ms) / speed

    def batch_step_ms(self, layers: LayerRange, speed: float, rows: float = BATCH_ROWS) -> float:
        """One decode step of `rows` requests of a stage running `layers` on a box `speed`
        times the profiler's."""
        return self._stage_ms(layers, lambda cost: cost.rows_ms(rows)) / speed

    def prompt_ms(self, layers: LayerRange, speed: float, positions: float) -> float:
        """One request's prompt of `positions` positions through a stage running `layers`
        on a box `speed` times the profiler's."""
        return self._stage_ms(layers, lambda cost: cost.positions_ms(positions)) / speed

    def _stage_ms(self, layers: LayerRange, part_ms: Callable[[PartCost], float]) -> float:
        first, stop = layers
        total = sum(part_ms(cost) for cost in self.layers[first:stop])
        if first == 0:
            total += part_ms(self.embedding)
        if stop == self.num_layers:
            total += part_ms(self.head)
        return total

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
        # Uncounted, llama.cpp's own copies of the stand-ins put Llama-3-8B's first and last
        # stages 282 MiB over their counts, and the OOM killer ended them on 2 GiB boxes.
        if mode == "gguf":
            total += self.standin_bytes(layers)
        return total

    def standin_bytes(self, layers: LayerRange) -> int:
        """The matrix of zeros a stage file of `layers` holds only because llama.cpp insists on
        it (stage_memory.STANDIN_TYPES): a first stage's head, an untied last stage's
        embedding. The cut writes it without reading it from the GGUF."""
        first, stop = layers
        first_stage = first == 0 and stop < self.num_layers
        untied_last_stage = first > 0 and stop == self.num_layers and not self.tied
        if self.llamacpp is None or not (first_stage or untied_last_stage):
            return 0
        return standin_bytes(self.llamacpp.hidden, self.llamacpp.vocab)


@dataclass(frozen=True)
class Memory:
    """What a node holds running a range of layers, item by item, in bytes."""

    weights: int
    kv: int
    buffers: int = 0   # llama.cpp's compute and logits buffers and its vocabulary
    process: int = 0   # the agent process before any of the above
    services: int = 0  # the broker and the coordinator, where they share the box
    headroom: int = 0  # kept free so the box does not evict its mmapped weights
    # llama.cpp's share of one request of the plant's longest length, where the KV budget
    # holds none (0: it holds at least one, or the engine grows its KV as it goes)
    unheld_share: int = 0

    @property
    def total(self) -> int:
        return (self.weights + self.kv + self.buffers + self.process + self.services
                + self.headroom)

    def describe(self) -> str:
        """E.g. "weights 1335 + KV 135 + llama.cpp buffers 210 + process 64 MiB"."""
        items = [("weights", self.weights), ("KV", self.kv),
                 ("llama.cpp buffers", self.buffers), ("process", self.process),
                 ("broker and coordinator", self.services), ("headroom", self.headroom)]
        return " + ".join(f"{name} {_mib_up(value)}" for name, value in items if value) + " MiB"


@dataclass(frozen=True)
class Box:
    """One node as the planner sees it: its box's budget and speed, its stage's settings.

    `positions`, `batch_positions`: the plant's longest request and a call's most
    positions, which size a llama.cpp node's context (0: not known, a node whose
    KV budget is counted as it is). `services`: what else runs on the box.
    """

    node: str
    memory_bytes: int
    speed: float
    weights: WeightMode
    kv_bytes: int
    device: str | None = None
    positions: int = 0
    batch_positions: int = 0
    services: tuple[Service, ...] = ()
    # A llama.cpp node's KV budget raised to hold this many requests of its range where
    # `kv_bytes` holds fewer, as `edgebus init` writes it (0: `kv_bytes` as it is).
    kv_requests: int = 0
    # The box's storage (plant_config/first_start.py); None: not in the plant file.
    disk: DiskSpec | None = None

    def memory(self, costs: ModelCosts, layers: LayerRange) -> Memory:
        """What this node holds running `layers`."""
        first, stop = layers
        weights = costs.weight_bytes(layers, self.weights)
        shape = costs.llamacpp
        services_bytes = sum(_service_bytes(service, shape) for service in self.services)
        if self.weights != "gguf" or shape is None or not self.positions:
            return Memory(weights=weights, kv=self.kv_bytes, process=costs.baseline_bytes,
                          services=services_bytes)
        per_position = shape.kv_per_position(first, stop)
        share = ContextShape(0, self.positions, self.batch_positions).share_bytes(per_position)
        context = ContextShape(max(self.kv_bytes, self.kv_requests * share), self.positions,
                               self.batch_positions)
        vocabulary = first == 0 or stop == costs.num_layers
        reserved = context.reserved_bytes(per_position)
        return Memory(
            weights=weights, kv=reserved,
            buffers=(shape.context_bytes(context, vocabulary=vocabulary)
                     + (shape.empty_vocabulary_bytes() if vocabulary else 0)),
            process=costs.baseline_bytes, services=services_bytes,
            headroom=HEADROOM_BYTES,
            unheld_share=0 if reserved else share)

    def need_bytes(self, costs: ModelCosts, layers: LayerRange) -> int:
        """Memory this node needs to run `layers`: weights, KV, the process and the rest."""
        return self.memory(costs, layers).total

    def fits(self, costs: ModelCosts, layers: LayerRange) -> bool:
        """Whether this node can run `layers`: within its memory, its KV holding a request."""
        memory = self.memory(costs, layers)
        return memory.total <= self.memory_bytes and not memory.unheld_share


def _service_bytes(service: Service, shape: LlamaCppShape | None) -> int:
    if service == "mosquitto":
        return MOSQUITTO_BYTES
    if service == "embedded-broker":
        return EMBEDDED_BROKER_BYTES
    return COORDINATOR_BYTES + (shape.vocabulary_bytes() if shape is not None else 0)


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


def plant_boxes(plant: Plant, *, memory_scale: float = 1.0,
                placed: dict[str, tuple[Service, ...]] | None = None,
                kv_requests: int = 0) -> list[tuple[Box, ...]]:
    """The plant's pipeline stages in order, each as the boxes of its replica nodes.

    `memory_scale`: each box's memory_mb times this (a rehearsal's --memory-scale);
    `placed`: what else runs on which box (default: the broker where the plant file
    puts it, the coordinator with it; placement.py); `kv_requests`: llama.cpp nodes'
    budgets as `edgebus init` will raise them (Box.kv_requests).
    """
    if plant.boxes is None:
        raise PlantConfigError(
            "the plant file has no boxes: section — the planner needs each stage node's box: "
            "add `boxes: [{name: NODE, memory_mb: MIB, speed: 1.0}, ...]` (docs/plant-file.md)")
    if placed is None:
        broker = broker_box(plant)
        placed = services(plant, broker, broker)
    by_name = {box.name: box for box in plant.boxes}
    return [tuple(Box(node=spec.node,
                      memory_bytes=int(by_name[spec.node].memory_mb * memory_scale * MIB),
                      speed=by_name[spec.node].speed, weights=spec.weights,
                      kv_bytes=spec.kv_budget_mb * MIB, device=by_name[spec.node].device,
                      positions=context_shape(plant, spec.node).positions,
                      batch_positions=context_shape(plant, spec.node).batch_positions,
                      services=placed.get(spec.node, ()), kv_requests=kv_requests,
                      disk=by_name[spec.node].disk)
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
        if not all(box.fits(costs, layers) for box in boxes):
            return math.inf
        return _replicas_ms(costs, boxes, layers)

    ranges, slowest = best_split(n_layers, len(stages), time_if_fits, max)
    if math.isfinite(slowest):
        return evaluate(costs, stages, ranges)
    raise _infeasible(costs, stages)


def _infeasible(costs: ModelCosts, stages: Sequence[tuple[Box, ...]]) -> PlantConfigError:
    """The error for a model that fits no split: the split missing the least memory, and where."""

    def shortfall(index: int, layers: LayerRange) -> float:
        # In whole MiB per box, as the message shows them, so the total is their sum; a KV
        # budget that holds no request is short of one request's share.
        return sum(_mib_up(max(0, memory.total - box.memory_bytes))
                   + _mib_up(max(0, memory.unheld_share - box.kv_bytes))
                   for box in stages[index] for memory in [box.memory(costs, layers)])

    ranges, missing = best_split(costs.num_layers, len(stages), shortfall, _add)
    closest = evaluate(costs, stages, ranges)
    short = shortfalls(costs, closest)
    modes = {box.weights for boxes in stages for box in boxes}
    return PlantConfigError(
        f"the model does not fit these boxes: it needs at least {int(missing)} MiB "
        "more; the split that misses the least:\n" + "\n".join(short) + "\n"
        f"— {_remedies(modes)}")


def shortfalls(costs: ModelCosts, result: Plan) -> list[str]:
    """What each node of `result` lacks, a line for each (none: every node fits)."""
    return [line for stage in result.stages for box in stage.boxes
            for line in _box_shortfall(costs, box, stage.layers)]


def _box_shortfall(costs: ModelCosts, box: Box, layers: LayerRange) -> list[str]:
    """What `box` lacks running `layers`, a line for each kind: its memory, its KV budget."""
    memory = box.memory(costs, layers)
    lines = []
    if memory.unheld_share:
        lines.append(f"  {box.node}: kv_budget_mb {box.kv_bytes // MIB} holds no request of "
                     f"{box.positions} positions on layers {show(layers)} "
                     f"({_mib_up(memory.unheld_share)} MiB each), where llama.cpp reserves "
                     "whole requests up front")
    if memory.total > box.memory_bytes:
        lines.append(f"  {box.node}: {_mib_up(memory.total - box.memory_bytes)} MiB over its "
                     f"memory_mb {box.memory_bytes // MIB} with layers {show(layers)} in "
                     f"{box.weights} ({memory.describe()})")
    return lines


# Weight modes from the most bytes a weight to the fewest (weight-modes.md).
_SMALLER_MODES: dict[WeightMode, str] = {
    "fp32": "weights: bf16, int8 or int4", "bf16": "weights: int8 or int4",
    "int8": "weights: int4", "int4": "", "gguf": ""}


def _remedies(modes: set[WeightMode]) -> str:
    """What to change, for the weight modes the plant runs: a smaller mode than each."""
    remedies = ["raise memory_mb"]
    if "gguf" in modes:
        remedies += ["size kv_budget_mb to whole requests (one at least) or lower the "
                     "positions a request may reach (coordinator max_prompt_tokens + "
                     "max_tokens_limit)",
                     "cut a smaller GGUF type from the model (Q4_0 or Q4_K_M: ~0.56 bytes a "
                     "weight, against Q8_0's 1.06 and F16's 2)"]
    else:
        remedies.append("lower kv_budget_mb")
    smaller = sorted({_SMALLER_MODES[mode] for mode in modes} - {""})
    if smaller:
        remedies.append("choose a smaller weight mode (" + "; ".join(smaller) + ")")
    return ", ".join(remedies) + " or add a box"


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
