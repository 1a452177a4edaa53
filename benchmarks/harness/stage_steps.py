"""Each llama.cpp stage's decode step against the same layers inside the whole model.

The llamacpp engine's promise is that cutting the model costs nothing inside
a stage: the stages' steps should add up to the whole model's. Measured in
this process, round-robin (one whole-model step, then one step of each stage,
then again), so a change in the machine's load hits all of them alike; each
stage runs its own stage GGUF exactly as its agent would, Python included.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from node_agent.engines import ContextShape, load_engine

# Decode steps timed after the prompt; the first WARMUP_STEPS are not counted (the
# first calls of a context grow its buffers).
STEPS = 48
WARMUP_STEPS = 4
PROMPT = list(range(100, 132))
# A context for one request of the prompt and the steps; a small one, as the numbers
# are per step and do not depend on the context's size.
SHAPE = ContextShape(kv_budget_bytes=64 * 2**20, positions=256, batch_positions=64)


@dataclass(frozen=True)
class StageSteps:
    """Median decode step of the whole model and of each stage, in ms, at `threads`."""

    model: str
    threads: int
    layers: list[tuple[int, int]]
    whole_ms: float
    stage_ms: list[float]

    @property
    def sum_ms(self) -> float:
        return sum(self.stage_ms)


def measure(model_dir: Path, name: str, layers: list[tuple[int, int]], threads: int
            ) -> StageSteps:
    """Time `layers` of `model_dir` as llamacpp stages and the whole model, `threads` each."""
    num_layers = layers[-1][1]
    whole = load_engine(model_dir, 0, num_layers, weights="gguf", threads=threads, shape=SHAPE)
    stages = [load_engine(model_dir, a, b, weights="gguf", threads=threads, shape=SHAPE)
              for a, b in layers]
    whole_cache = whole.new_cache(0)
    caches = [stage.new_cache(0) for stage in stages]
    times: list[list[float]] = [[] for _ in range(len(stages) + 1)]
    x, start = torch.tensor([PROMPT]), 0
    for step in range(STEPS + WARMUP_STEPS + 1):
        began = time.perf_counter()
        logits = whole.step([x], [whole_cache], [start])[0]
        ended = [time.perf_counter() - began]
        h = x
        for stage, cache in zip(stages, caches, strict=True):
            began = time.perf_counter()
            out = stage.step([h], [cache], [start])[0]
            ended.append(time.perf_counter() - began)
            assert out is not None
            h = out
        if step > WARMUP_STEPS:  # step 0 is the prompt
            for column, seconds in zip(times, ended, strict=True):
                column.append(seconds * 1e3)
        assert logits is not None
        start += x.shape[1]
        x = logits.argmax(-1, keepdim=True)
    for engine, cache in [(whole, whole_cache), *zip(stages, caches, strict=True)]:
        engine.free_cache(cache)
        engine.close()
    medians = [statistics.median(column) for column in times]
    return StageSteps(model=name, threads=threads, layers=layers, whole_ms=medians[0],
                      stage_ms=medians[1:])
