"""What a rehearsal prints: per box, measured beside what the planner's cost model predicts.

The prediction takes the planner's profile (`edgebus plan`: each layer's
decode time on one thread of the machine that profiled) and divides each
stage's time by its box's CPU share here, as the planner divides by `speed`.
The pipeline then runs `groups` request groups, each a batch of up to
ROWS_PER_GROUP rows (which cost what one row costs). A group's step takes at
least one trip through every stage, and the slowest stage serves every group
in turn, so a group steps every max(sum of stages, groups x slowest stage).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from edgebus.rehearse.sizing import BoxShare
from edgebus.rehearse.workload import ROWS_PER_GROUP, Measurement
from plant_config.layout import show
from plant_config.planner import ModelCosts
from plant_config.schema import Plant


def stage_decode_ms(costs: ModelCosts, layers: tuple[int, int]) -> float:
    """One decode step of a stage running `layers`, on the profiling machine's one thread."""
    first, stop = layers
    total = sum(part.decode_ms for part in costs.layers[first:stop])
    if first == 0:
        total += costs.embedding.decode_ms
    if stop == costs.num_layers:
        total += costs.head.decode_ms
    return total


def groups_for(requests: int, batch_groups: int) -> int:
    """Request groups the coordinator opens: at most `batch_groups`, each of ROWS_PER_GROUP
    rows or more (node_agent/groups.py)."""
    return max(1, min(batch_groups, requests // ROWS_PER_GROUP))


@dataclass(frozen=True)
class Prediction:
    step_ms: dict[str, float]   # per box: one decode step of its stage, on its CPU share
    tok_s: float                # all requests together


def predict(plant: Plant, costs: ModelCosts, shares: list[BoxShare], requests: int,
            batch_groups: int) -> Prediction:
    cores = {share.box: share.cpu_cores for share in shares}
    step = {spec.node: stage_decode_ms(costs, spec.layers) / cores[spec.node]
            for spec in plant.stages}
    # The first node of a stage serves it; standbys idle until a failover.
    serving = [step[stage.node_ids[0]] for stage in plant.pipeline]
    groups = groups_for(requests, batch_groups)
    interval_ms = max(sum(serving), groups * max(serving))
    return Prediction(step_ms=step, tok_s=requests * 1000 / interval_ms)


def box_table(plant: Plant, measured: Measurement, prediction: Prediction) -> str:
    """Per box: share, layers, rows/s, busy fraction, forward-pass and hop times, link bytes."""
    header = ("box", "layers", "cores", "rows/s", "busy", "ms/step", "predicted",
              "KB in/step", "KB out/step")
    rows: list[tuple[str, ...]] = [header]
    wall = measured.wall_s
    for spec in plant.stages:
        before, after = measured.boxes[spec.node]
        steps = after.steps - before.steps
        cores = measured.cpu_cores[spec.node]
        rows.append((
            spec.node, f"{show(spec.layers)}", f"{cores:.2f}",
            f"{(after.rows - before.rows) / wall:.0f}",
            f"{(after.cpu_s - before.cpu_s) / (cores * wall):.0%}",
            f"{(after.compute_s - before.compute_s) * 1000 / steps:.1f}" if steps else "-",
            f"{prediction.step_ms[spec.node]:.1f}",
            _kib_per(after.bytes_in - before.bytes_in, steps),
            _kib_per(after.bytes_out - before.bytes_out, steps)))
    return _columns(rows)


def _kib_per(n_bytes: int, steps: float) -> str:
    return f"{n_bytes / steps / 1024:.1f}" if steps else "-"


def hop_ms(plant: Plant, measured: Measurement) -> float | None:
    """Mean time a step spends between stages: a request's token interval less every
    stage's forward pass, over its hops (coordinator -> stages -> coordinator)."""
    per_request_tok_s = measured.decode_tok_s / measured.requests
    if per_request_tok_s <= 0:
        return None
    interval = 1000 / per_request_tok_s
    compute = 0.0
    for stage in plant.pipeline:
        before, after = measured.boxes[stage.node_ids[0]]
        steps = after.steps - before.steps
        if steps:
            compute += (after.compute_s - before.compute_s) * 1000 / steps
    return (interval - compute) / (len(plant.pipeline) + 1)


def summary(plant: Plant, measured: Measurement, prediction: Prediction) -> str:
    hops = hop_ms(plant, measured)
    ratio = measured.decode_tok_s / prediction.tok_s if prediction.tok_s else 0.0
    lines = [
        f"{measured.requests} requests x {measured.tokens // max(1, measured.requests)} tokens "
        f"in {measured.wall_s:.1f} s; TTFT median {statistics.median(measured.ttft_s):.2f} s, "
        f"max {max(measured.ttft_s):.2f} s",
        f"decode: measured {measured.decode_tok_s:.1f} tok/s, predicted "
        f"{prediction.tok_s:.1f} tok/s ({ratio:.0%} of the prediction)"
        + (f"; {hops:.1f} ms per hop between stages" if hops is not None else "")]
    lines += [f"error: {error}" for error in measured.errors]
    return "\n".join(lines)


def _columns(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
                     .rstrip() for row in rows)
