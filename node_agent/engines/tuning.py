"""Kernel options measured on the box at a stage's first load, not set by constants.

Which kernel path is fastest depends on the CPU: oneDNN-packed fp32 weights
ran 1.4-1.7x faster than plain ones on an EPYC and 1.15x slower on a Xeon
(issue 12), padding 1-2 rows to 4 helped on the EPYC only, and how many
threads pay depends on the box's cores and memory. So before it serves, a
stage times each candidate (`candidates`) on a sample of its own layers:

- a decode step of one row (a single stream) and of BATCH_ROWS rows (a batch
  under load), each the fastest of TIMED_STEPS after WARMUP_STEPS;
- the candidate with the smallest sum of the two wins.

The result is cached in the model directory (TUNING_FILE, beside the
planner's profile) under this machine, CPU, engine, weight mode, layers and
library versions, and the stage reports its choice in its status
(`engine.threads`, `engine.packed`, `engine.min_rows`, `engine.tuned`).

Only options that leave the arithmetic alone are candidates: the engine is
chosen per weight mode (plant_config.schema.resolve_engine), because two
engines quantize and sum differently and a stage's replicas must answer alike.
Thread counts are candidates only where the plant does not fix them
(`threads:`, or `edgebus up`, which divides a box's cores among its stages).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import platform
import time
from dataclasses import asdict
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from node_agent import packed
from node_agent.engines.base import MIN_ROWS, Kernels, StageEngine
from node_agent.engines.torch_side import build
from node_agent.kv_cache import KVCache
from plant_config.schema import Device, WeightMode

log = logging.getLogger(__name__)

TUNING_FILE = "edgebus-tuning.json"
# Layers a torch candidate is timed on: every layer runs the same kernels, and loading
# a sample, not the stage, keeps a 7B stage's first start from packing it three times.
SAMPLE_LAYERS = 2
BATCH_ROWS = 8          # a group of concurrent requests (node_agent/groups.py)
PROMPT_POSITIONS = 32   # history each row attends over while timed
WARMUP_STEPS = 3        # the first steps pay for allocation and kernel selection
TIMED_STEPS = 8         # the fastest of these: the least disturbed by other processes


def cpu_model() -> str:
    """The CPU's marketing name, as /proc/cpuinfo gives it (Linux), else platform's guess."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def candidates(engine: str, weights: WeightMode, threads: int | None) -> list[Kernels]:
    """The kernel options worth timing for `engine` running `weights`."""
    counts = [threads] if threads else _thread_counts()
    if engine == "torch" and weights == "fp32" and packed.available():
        # Packed and padded to MIN_ROWS, packed unpadded, plain F.linear (MKL).
        layouts = [(True, MIN_ROWS), (True, 1), (False, 1)]
        return [Kernels(n, p, m) for n in counts for p, m in layouts]
    return [Kernels(n) for n in counts]


def _thread_counts() -> list[int]:
    cores = len(os.sched_getaffinity(0))
    return sorted({1, cores, *(n for n in (2, 4, 8, 16) if n < cores)})


def choose(model_dir: Path, first: int, end: int, engine: str, weights: WeightMode,
           device: Device, threads: int | None) -> tuple[Kernels, str]:
    """The kernel options for this stage on this box, and whether they were measured now,
    cached, or fixed (one candidate only)."""
    options = candidates(engine, weights, threads)
    if len(options) == 1:
        return options[0], "fixed"
    key = json.dumps({"host": platform.node(), "cpu": cpu_model(), "cores": os.cpu_count(),
                      "engine": engine, "weights": weights, "device": device,
                      "layers": [first, end], "threads": threads,
                      "torch": torch.__version__, "onnxruntime": _version("onnxruntime")},
                     sort_keys=True)
    path = model_dir / TUNING_FILE
    with _locked(path):  # stages starting together on one box take turns, so none
        cached = _read(path).get(key)  # times its candidates while another loads
        if cached is not None:
            return Kernels(**cached["choice"]), "cached"
        timings = [(_time(model_dir, first, end, engine, weights, device, k), k)
                   for k in options]
        best = min(timings, key=lambda pair: pair[0])[1]
        _write(path, key, {"choice": asdict(best), "cpu": cpu_model(),
                           "measured_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
                           "ms": [[asdict(k), round(ms, 3)] for ms, k in timings]})
    log.info("measured %d kernel options for layers [%d, %d) in %s on %s: %s", len(options),
             first, end, weights, cpu_model(), best)
    return best, "measured"


def _time(model_dir: Path, first: int, end: int, engine: str, weights: WeightMode,
          device: Device, kernels: Kernels) -> float:
    """Milliseconds of a one-row plus a BATCH_ROWS-row decode step with `kernels`."""

    previous = torch.get_num_threads()
    torch.set_num_threads(kernels.threads)
    try:
        sample_end = min(end, first + SAMPLE_LAYERS) if engine == "torch" else end
        stage = build(model_dir, first, sample_end, engine, weights, device, kernels)
        return _step_ms(stage, 1) + _step_ms(stage, BATCH_ROWS)
    finally:
        torch.set_num_threads(previous)


def _step_ms(stage: StageEngine, rows: int) -> float:
    hidden = stage.config.hidden_size
    caches = [KVCache() for _ in range(rows)]

    def inputs(positions: int) -> list[torch.Tensor]:
        if stage.slice.has_embedding:
            return [torch.arange(100, 100 + positions).unsqueeze(0) for _ in range(rows)]
        return [torch.randn(1, positions, hidden) for _ in range(rows)]

    stage.step(inputs(PROMPT_POSITIONS), caches, [0] * rows)
    position, best = PROMPT_POSITIONS, float("inf")
    for step in range(WARMUP_STEPS + TIMED_STEPS):
        started = time.perf_counter()
        stage.step(inputs(1), caches, [position] * rows)
        if step >= WARMUP_STEPS:
            best = min(best, time.perf_counter() - started)
        position += 1
    return best * 1000


def _version(package: str) -> str | None:
    try:
        return version(package)
    except Exception:
        return None


class _locked:
    """An exclusive lock on `path`'s sibling lock file, held for the with block."""

    def __init__(self, path: Path) -> None:
        self._path = path.with_name(f".{path.name}.lock")
        self._fd = -1

    def __enter__(self) -> None:
        try:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:  # a read-only model directory: measure, just not in turns
            log.warning("cannot lock %s (%s): stages may time their kernels at once",
                        self._path, exc.strerror)
            return
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        if self._fd >= 0:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, key: str, entry: dict[str, Any]) -> None:
    data = _read(path)
    data[key] = entry
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        temporary.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(temporary, path)
    except OSError as exc:
        log.warning("cannot cache the kernel choice in %s (%s): the next start measures "
                    "again", path, exc.strerror)
