"""What a rehearsal prints: per box, measured beside what the planner's cost model predicts.

The prediction takes the planner's profile (`edgebus plan`, one thread of the
machine that profiled) and divides each CPU cost by the CPU share of the box
that pays it, as the planner divides by `speed`:

- a stage's forward pass: the profiled decode step of a group's rows (the
  coordinator's requests over its groups), on the line through the profiled
  steps of one row and of BATCH_ROWS rows;
- a hop: the CPU of one decode message in the sending agent, in Mosquitto and
  in the receiving agent (`MessageCost`), each on its own box's share.

The pipeline runs `groups` request groups, each stepping around a loop of
boxes (coordinator -> stages -> coordinator); each box serves one group at a
time, for the CPU one group step costs it on its share (its stages' forward
passes and messages; on their boxes, the coordinator's and Mosquitto's).
A llama.cpp step of a given batch takes the same time each time, so the loop
settles into a regular period: max(the boxes' times summed, groups x the
slowest box's), `cycle_time`. Exact mean value analysis with exponential
service times, which this replaced, charged each group for queueing that a
regular pipeline does not have: with as many groups as balanced boxes it
predicts (boxes + groups - 1) steps per cycle against the loop's `groups`,
3/5 of the rate on three boxes, and the 1.1B shape measured 167 % of it.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass

from edgebus.rehearse.rehearsal import Online
from edgebus.rehearse.sizing import BoxShare
from edgebus.rehearse.workload import ROWS_PER_GROUP, Measurement, decode_step_ms
from node_agent.coordinator.token_loop import prefill_chunks
from plant_config.first_start import first_start, seconds
from plant_config.layout import show
from plant_config.planner import MessageCost, ModelCosts, plant_boxes
from plant_config.schema import Plant
from plant_config.stage_memory import MIB

# Major faults a box may take in a workload without paging its weights: a library or
# two mapped late, never a pass's worth of weight pages (thousands).
PAGING_FAULTS = 100
# Below this share of what its cut reads, a box's first start read from the page cache, not
# its disk: a page of the model's another box has read, or another process maps.
CACHED_READS = 0.9
# A hop's CPU where the profile has none (no Mosquitto where it was measured):
# the prediction then leaves hops out, and says so.
_UNMEASURED = MessageCost(agent_ms=0.0, broker_ms=0.0)


def groups_for(requests: int, batch_groups: int) -> int:
    """Request groups the coordinator opens: at most `batch_groups`, each of ROWS_PER_GROUP
    rows or more (node_agent/groups.py)."""
    return max(1, min(batch_groups, requests // ROWS_PER_GROUP))


@dataclass(frozen=True)
class Prediction:
    step_ms: dict[str, float]   # per box: one decode step of its stage, on its CPU share
    hop_ms: float               # a hop as hop_ms() measures one: the cycle less the steps
    tok_s: float                # decoding, all requests together
    hops_profiled: bool         # whether the profile measured a message's CPU
    ttft_s: float               # the first request's prompt through every stage
    # First request sent to last answer: every prompt, then every decode step.
    wall_s: float
    answered_tok_s: float       # tokens answered over wall_s, as Measurement's
    # Where the requests draft (coordinator.speculation): the rate with every draft taken,
    # each request's drafts in flight behind its token as customers of their own.
    drafted_tok_s: float | None = None


def predict(plant: Plant, costs: ModelCosts, shares: list[BoxShare], requests: int,
            batch_groups: int, broker_box: str, coordinator_box: str, *,
            prompt_tokens: int, tokens: int) -> Prediction:
    """`requests` sent at once, each a prompt of `prompt_tokens` and `tokens` to answer."""
    cores = {share.box: share.cpu_cores for share in shares}
    message = costs.message or _UNMEASURED
    groups = groups_for(requests, batch_groups)
    # A group of fewer rows than the profiled batch steps faster: one request alone, a
    # single row, took a quarter of the 4-row step's prediction on SmolLM2.
    rows = max(1.0, requests / groups)
    step = {spec.node: costs.batch_step_ms(spec.layers, cores[spec.node], rows)
            for spec in plant.stages}
    # The first node of a stage serves it; standbys idle until a failover.
    serving = [stage.node_ids[0] for stage in plant.pipeline]
    hops = len(serving) + 1

    def demands(stage_ms: dict[str, float], messages: int) -> list[float]:
        """Wall ms each box spends on one pass of every stage: CPU ms (one core) on its
        share, where every agent takes in a message and sends one, and Mosquitto routes one
        per hop."""
        load = dict.fromkeys(cores, 0.0)
        for node in serving:
            load[node] += stage_ms[node] * cores[node] + messages * message.agent_ms
        load[coordinator_box] += messages * message.agent_ms
        load[broker_box] += messages * hops * message.broker_ms
        return [load[box] / cores[box] for box in load if load[box]]

    cycle_ms = cycle_time(demands(step, 1), groups)
    # A prompt goes through the stages in prefill_chunk pieces; the prompts of requests sent
    # together follow each other through the boxes as jobs through a flow shop, the slowest
    # box setting the pace. The decode steps are counted after them: where a request decodes
    # while later prompts still go through, both take the same boxes' CPU, so on the box
    # that paces the plant the two add up all the same.
    pieces = prefill_chunks(prompt_tokens, plant.coordinator.prefill_chunk) if prompt_tokens else []
    prompt = {spec.node: sum(costs.prompt_ms(spec.layers, cores[spec.node], piece)
                             for piece in pieces) for spec in plant.stages}
    prompt_demands = demands(prompt, len(pieces))
    ttft_ms = sum(prompt_demands)
    wall_ms = ttft_ms + (requests - 1) * max(prompt_demands) + (tokens - 1) * cycle_ms
    drafting = plant.coordinator.speculation
    drafted = None
    if drafting.drafts and requests <= drafting.max_in_flight:
        # Every position, drafted or not, is a step on every box (exact verification):
        # drafts add customers to the loop, never take work out of it.
        positions = requests * (drafting.drafts + 1)
        drafted = positions * 1000 / cycle_time(demands(step, 1), positions)
    return Prediction(step_ms=step,
                      hop_ms=(cycle_ms - sum(step[node] for node in serving)) / hops,
                      tok_s=requests * 1000 / cycle_ms, hops_profiled=costs.message is not None,
                      ttft_s=ttft_ms / 1000, wall_s=wall_ms / 1000,
                      answered_tok_s=requests * tokens * 1000 / wall_ms, drafted_tok_s=drafted)


def cycle_time(demands_ms: list[float], customers: int) -> float:
    """Time one of `customers` takes around a closed loop of single-server queues whose
    service times are these, the same every turn: the loop's period is the longer of its
    two kinds of circuit (max-plus algebra), every customer once around it (the sum of the
    times) or one box serving every customer in turn (`customers` x its time)."""
    return max(sum(demands_ms), customers * max(demands_ms))


def box_table(plant: Plant, measured: Measurement, prediction: Prediction) -> str:
    """Per box: share, layers, rows/s, busy fraction, decode pass measured and predicted,
    link bytes."""
    header = ("box", "layers", "cores", "rows/s", "busy", "ms/decode", "predicted",
              "KB in/step", "KB out/step", "disk reads")
    rows: list[tuple[str, ...]] = [header]
    wall = measured.wall_s
    for spec in plant.stages:
        before, after = measured.boxes[spec.node]
        steps = after.steps - before.steps
        cores = measured.cpu_cores[spec.node]
        rows.append((
            spec.node, f"{show(spec.layers)}", f"{cores:.2f}",
            f"{(after.rows - before.rows) / wall:.0f}",
            f"{busy_share(measured, spec.node):.0%}",
            f"{ms:.1f}" if (ms := decode_step_ms(before, after)) is not None else "-",
            f"{prediction.step_ms[spec.node]:.1f}",
            _kib_per(after.bytes_in - before.bytes_in, steps),
            _kib_per(after.bytes_out - before.bytes_out, steps),
            str(after.major_faults - before.major_faults)))
    return _columns(rows)


def first_start_table(plant: Plant, costs: ModelCosts, online: dict[str, Online]) -> str:
    """Per stage node: its first start (its process started to "online": the cut and the
    load) and the CPU its box used by then, beside the time its box's disk takes to read
    its share (the stage file) and the planner's estimate (the cut's read and write,
    plant_config/first_start.py), and what its box's io controller counted."""
    header = ("box", "disk MB/s r/w", "first start", "CPU", "share at read rate", "x share",
              "estimate (read + write)", "read MiB", "written MiB")
    rows: list[tuple[str, ...]] = [header]
    warnings = []
    boxes = {box.node: box for stage in plant_boxes(plant) for box in stage}
    for spec in plant.stages:
        started = online.get(spec.node)
        measured = started.seconds if started else None
        estimate = first_start(costs, boxes[spec.node], spec.layers)
        counted = started.disk if started else None
        if estimate and counted and counted.read < CACHED_READS * estimate.read_bytes:
            warnings.append(
                f"warning: box {spec.node} read {counted.read / MIB:.0f} of the "
                f"{estimate.read_bytes / MIB:.0f} MiB its cut reads from its disk; the rest "
                "was in the page cache (another box read it first, or another process on "
                "this machine maps or reads the model), so its first start is short of what "
                "its disk would take")
        rows.append((
            spec.node,
            f"{estimate.disk.read_mb_s:g} / {estimate.disk.write_mb_s:g}" if estimate else "-",
            f"{seconds(measured)} s" if measured is not None else "-",
            f"{seconds(started.cpu_s)} s" if started else "-",
            f"{seconds(estimate.later_s)} s" if estimate else "-",
            f"{measured / estimate.later_s:.2f}x" if estimate and measured is not None
            and estimate.later_s else "-",
            f"{seconds(estimate.total_s)} s" if estimate else "-",
            f"{counted.read / MIB:.0f}" if counted else "-",
            f"{counted.written / MIB:.0f}" if counted else "-"))
    return "\n".join([_columns(rows), *warnings])


def _kib_per(n_bytes: int, steps: float) -> str:
    return f"{n_bytes / steps / 1024:.1f}" if steps else "-"


def hop_ms(plant: Plant, measured: Measurement) -> float | None:
    """Mean time a step spends between stages: a request's token interval less every
    stage's decode pass, over its hops (coordinator -> stages -> coordinator)."""
    per_request_tok_s = measured.decode_tok_s / measured.requests
    if per_request_tok_s <= 0:
        return None
    interval = 1000 / per_request_tok_s
    compute = 0.0
    for stage in plant.pipeline:
        ms = decode_step_ms(*measured.boxes[stage.node_ids[0]])
        if ms is None:
            return None
        compute += ms
    return (interval - compute) / (len(plant.pipeline) + 1)


def summary(plant: Plant, measured: Measurement, prediction: Prediction) -> str:
    hops = hop_ms(plant, measured)
    ratio = measured.decode_tok_s / prediction.tok_s if prediction.tok_s else 0.0
    lines = [
        f"{measured.requests} requests x {measured.tokens // max(1, measured.requests)} tokens "
        f"in {measured.wall_s:.1f} s; TTFT median {statistics.median(measured.ttft_s):.2f} s, "
        f"max {max(measured.ttft_s):.2f} s",
        f"answered: measured {measured.tokens / measured.wall_s:.2f} tok/s from the first "
        f"request sent to the last answer, predicted {prediction.answered_tok_s:.2f} tok/s "
        f"({measured.tokens / measured.wall_s / prediction.answered_tok_s:.0%}; prompts and "
        "decode steps)",
        f"decode: measured {measured.decode_tok_s:.1f} tok/s, predicted "
        f"{prediction.tok_s:.1f} tok/s ({ratio:.0%} of the prediction)"
        + (f"; {hops:.1f} ms per hop between stages" if hops is not None else "")
        + (f", predicted {prediction.hop_ms:.1f}" if prediction.hops_profiled else
           ", not predicted: the profile has no message cost, Mosquitto was not installed "
           "when it was measured (`edgebus plan --profile` measures again)")]
    if prediction.drafted_tok_s is not None:
        lines.append(f"drafts: with every draft taken, at most {prediction.drafted_tok_s:.1f} "
                     f"tok/s predicted ({plant.coordinator.speculation.drafts} in flight); the "
                     "drafts taken, not this, set the measured rate")
    if measured.drafts_proposed:
        lines.append(f"drafts: {measured.drafts_accepted} of {measured.drafts_proposed} taken, "
                     f"{measured.drafts_accepted / max(1, measured.tokens):.0%} of the tokens; "
                     "frames of several positions verified (x their mean size): "
                     + verification(measured))
    cores = os.cpu_count() or 1
    if measured.host_load > cores:
        lines.append(f"warning: this machine was busy (load average {measured.host_load:.1f} on "
                     f"{cores} cores): the boxes got less CPU than their quotas, and the "
                     "measurement is low against the prediction; rehearse on a quiet machine")
    for box, (before, after) in measured.boxes.items():
        if (faults := after.major_faults - before.major_faults) > PAGING_FAULTS:
            lines.append(f"warning: box {box} read {faults} pages back from disk while it "
                         "answered: its memory limit holds its process, KV and buffers but not "
                         "all of its mapped weights, so every pass reads some of them again "
                         "(slower than predicted); give the box more memory or fewer layers")
    lines += [f"error: {error}" for error in measured.errors]
    return "\n".join(lines)


def verification(measured: Measurement) -> str:
    """Per box, the decode frames of several positions (a token and its drafts) it verified,
    and their mean size: "pi-1 12x3.2"."""
    parts = []
    for box, (before, after) in measured.boxes.items():
        frames = after.verify_frames - before.verify_frames
        positions = after.verify_positions - before.verify_positions
        parts.append(f"{box} {frames:.0f}" + (f"x{positions / frames:.1f}" if frames else ""))
    return ", ".join(parts)


def busy_share(measured: Measurement, box: str) -> float:
    """A box's CPU over its quota while the workload ran."""
    before, after = measured.boxes[box]
    return (after.cpu_s - before.cpu_s) / (measured.cpu_cores[box] * measured.wall_s)


def _columns(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
                     .rstrip() for row in rows)
