"""Layer ranges: splitting a model's layers into stages, and explaining a bad split.

A range is `(first, last + 1)`. Problems found here are located relative to
the plant's `stages` list: `(1, "layers")` is `stages[1].layers`, `()` is
`stages` itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from edgebus.core.errors import PlantConfigError
from plant_config.problems import Problem

LayerRange = tuple[int, int]


def even_split(num_layers: int, n_stages: int) -> list[LayerRange]:
    """Contiguous ranges covering `num_layers`, sizes differing by at most one.

    Earlier stages get the extra layers because the last stage also runs the
    LM head, the largest matmul per token, while stage 0's embedding is only a
    table lookup.
    """
    if n_stages < 1:
        raise PlantConfigError(f"cannot split a model into {n_stages} stages: use at least 1")
    if n_stages > num_layers:
        raise PlantConfigError(
            f"cannot split the model's {num_layers} layers into {n_stages} stages: every stage "
            f"needs at least one layer — use at most {num_layers} stages")
    size, extra = divmod(num_layers, n_stages)
    ranges: list[LayerRange] = []
    first = 0
    for index in range(n_stages):
        stop = first + size + (1 if index < extra else 0)
        ranges.append((first, stop))
        first = stop
    return ranges


def layout_problems(ranges: Sequence[LayerRange]) -> list[Problem]:
    """What keeps `ranges` from being contiguous, in order and starting at layer 0."""
    problems: list[Problem] = []
    if ranges and ranges[0][0] > 0:
        problems.append(Problem((), f"{_layers_are(0, ranges[0][0])} owned by no stage — "
                                    "stages[0] must start at layer 0"))
    for index in range(1, len(ranges)):
        prev, cur = ranges[index - 1], ranges[index]
        if cur == prev:
            continue  # a replica: a standby node for the same stage
        before = f"stages[{index - 1}] {show(prev)}"
        if cur[0] < prev[0]:
            problems.append(Problem((index, "layers"), f"{show(cur)} starts before {before} — "
                                                       "list the stages in pipeline order, a "
                                                       "stage's replicas next to each other"))
        elif cur[0] < prev[1]:
            twice = _layers_are(cur[0], min(cur[1], prev[1]))
            problems.append(Problem((index, "layers"),
                                    f"{show(cur)} overlaps {before} — {twice} owned twice"))
        elif cur[0] > prev[1]:
            problems.append(Problem((), f"{_layers_are(prev[1], cur[0])} owned by no stage "
                                        f"(between {before} and stages[{index}] {show(cur)})"))
    return problems


def fit_problems(ranges: Sequence[LayerRange], num_layers: int, config: Path) -> list[Problem]:
    """What keeps a valid layout (see `layout_problems`) from covering exactly `num_layers`."""
    model = f"the model's num_hidden_layers = {num_layers} (from {config})"
    problems = [Problem((index, "layers"), f"{show(r)} goes beyond {model}")
                for index, r in enumerate(ranges) if r[1] > num_layers]
    if ranges and ranges[-1][1] < num_layers:
        problems.append(Problem((), f"{_layers_are(ranges[-1][1], num_layers)} owned by no "
                                    f"stage — {model}"))
    return problems


def show(layers: LayerRange) -> str:
    """A range as the plant file writes it: `[0, 10]`."""
    return f"[{layers[0]}, {layers[1]}]"


def _layers_are(first: int, stop: int) -> str:
    return f"layer {first} is" if stop - first == 1 else f"layers {first}-{stop - 1} are"
