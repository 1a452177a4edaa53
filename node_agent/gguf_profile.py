"""The planner's cost model of a GGUF file, measured in llama.cpp: `edgebus plan`'s profile of
a plant whose `model:` names a .gguf (node_agent/costs.py picks it).

Time: the whole file runs as one llamacpp stage (`LlamaCppEngine`, the code a
stage runs) on PROFILE_THREADS thread, as the torch profile runs one fp32
stage (node_agent/profile.py), and an eval callback marks when llama.cpp's
graph has computed the token embedding (`embd`) and each layer's output
(`l_out-i`). A layer's time runs from the mark before it to its own; the
head's (final norm, LM head, logits out) from the last layer's mark to the
call's return; the embedding's from the call to its mark, with the call's own
work before the graph runs (splitting the batch, building the graph). Marking
computes the graph in pieces and calls Python for every node (~15 a layer),
so the marked parts are scaled to add up to the same calls run by a second
context without the callback, loaded once the first is closed (the profile
holds the model once, however large).

Calls, as the torch profile times them: a PREFILL_POSITIONS-position prompt,
DECODE_STEPS one-position steps, and DECODE_STEPS steps of BATCH_ROWS requests
in one call; each time is the minimum over ROUNDS, the least disturbed by
other processes on shared cores.

Memory: a stage's weight bytes are the file's tensors of its layers
(gguf_memory.weight_sizes: the embedding on the first stage, the head on the
last); the process baseline is an idle llama.cpp stage agent's, measured once
(stage_memory.IDLE_AGENT_BYTES: no torch, which such a stage never imports);
the file's shape (gguf_memory.llamacpp_shape) sizes the KV and the buffers llama.cpp
reserves at the plant's limits (plant_config/stage_memory.py). The other
weight modes' bytes are 0: a GGUF plant runs gguf only (plant_config/schema.py
refuses the rest).

Cached in `$EDGEBUS_HOME/profiles/`, one file per GGUF path (the GGUF's own
directory may be read-only), reused while the host, llama-cpp-python version
and the file are the same.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from broker.mosquitto import mosquitto_binary
from edgebus.core.errors import EngineError
from edgebus.core.paths import edgebus_home
from node_agent.engines.base import ContextShape
from node_agent.engines.llamacpp import library
from node_agent.engines.llamacpp.engine import LlamaCppEngine
from node_agent.gguf_memory import llamacpp_shape, weight_sizes
from node_agent.gguf_model import read_config
from node_agent.measured import Measured, costs_from
from node_agent.message_cost import measure_message
from node_agent.model_config import LLAMACPP_KV_ITEM_BYTES, kv_bytes_per_token
from plant_config.planner import BATCH_ROWS, PREFILL_POSITIONS, ModelCosts
from plant_config.stage_memory import IDLE_AGENT_BYTES

log = logging.getLogger(__name__)

PROFILE_DIR = "profiles"  # under $EDGEBUS_HOME
# As the torch profile (node_agent/profile.py), and for its reasons: one thread is what
# stayed undisturbed on cores other processes used; an untimed round pays for first
# allocations; the minimum of 3 rounds of 8 decode steps shrugs off disturbed ones.
# With one thread llama.cpp computes on the calling thread, so the profile reads that
# thread's CPU time (CLOCK), not the wall clock: what a box's CPU quota meters, and what
# other processes on the profiling machine do not inflate. Wall time did: a profile made
# at a load average of ~8 on the 2-core EPYC had every decode step 1.7x (prefill 2.5x)
# the one made quiet, and the rehearsal predicted 45.6 tok/s where 77.2 were measured.
PROFILE_THREADS = 1
CLOCK = time.thread_time
WARMUP_ROUNDS = 1
ROUNDS = 3
DECODE_STEPS = 8
# Token ids drawn for the timing prompt: any ids the vocabulary holds time the same.
_PROMPT_IDS = 1000
def cache_path(path: Path) -> Path:
    digest = hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:16]
    return edgebus_home() / PROFILE_DIR / f"{Path(path).stem}.{digest}.json"


def cache_key(path: Path) -> dict[str, Any]:
    """What a profile depends on: the machine, llama.cpp and its threads, the file."""
    stat = Path(path).stat()
    return {"host": platform.node(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "llama_cpp_python": library.library_version(), "threads": PROFILE_THREADS,
            "clock": "thread_cpu",
            "prefill_positions": PREFILL_POSITIONS, "batch_rows": BATCH_ROWS,
            "checkpoint": [[Path(path).name, stat.st_size, stat.st_mtime_ns]]}


def costs(measured: Measured, path: Path) -> ModelCosts:
    # The baseline of profiles cached before it was a measured constant is replaced too.
    return replace(costs_from(measured, weight_sizes(path)), baseline_bytes=IDLE_AGENT_BYTES,
                   llamacpp=llamacpp_shape(path))


def measure(path: Path, *, rounds: int = ROUNDS) -> Measured:
    """Time every part of the GGUF at `path` on this machine (see the module doc)."""
    config = read_config(path)
    message = measure_message(config.hidden_size) if mosquitto_binary() is not None else None
    layers = config.num_hidden_layers
    marker = _Marker(layers)
    positions = PREFILL_POSITIONS + 2 * DECODE_STEPS
    per_position = kv_bytes_per_token(config, (0, layers), LLAMACPP_KV_ITEM_BYTES)
    probe = ContextShape(kv_budget_bytes=0, positions=positions,
                         batch_positions=PREFILL_POSITIONS)
    shape = ContextShape(kv_budget_bytes=BATCH_ROWS * probe.sequence_positions * per_position,
                         positions=positions, batch_positions=PREFILL_POSITIONS)
    kinds = ("prefill", "decode", "batch")
    parts: dict[str, list[list[float]]] = {kind: [] for kind in kinds}  # per call, per part
    totals: dict[str, list[float]] = {kind: [] for kind in kinds}  # per call, unmarked
    prompt = np.random.default_rng(0).integers(0, min(_PROMPT_IDS, config.vocab_size),
                                               (1, PREFILL_POSITIONS))
    # One context at a time, so the profile holds the model once: a llama.cpp engine reads
    # its weights into memory of its own, and two would need twice the model (2 x 17 GB
    # for Qwen3-30B-A3B, which no planning machine of issue 33 had). The thread-CPU clock
    # makes rounds run apart comparable.
    for marked in (True, False):
        engine = LlamaCppEngine(path, 0, layers, shape=shape, threads=PROFILE_THREADS,
                                observer=marker.callback if marked else None)
        try:
            for round_index in range(WARMUP_ROUNDS + rounds):
                for kind, ms in _round(engine, prompt, marker if marked else None):
                    if round_index < WARMUP_ROUNDS:
                        continue
                    if marked:
                        parts[kind].append(ms)
                    else:
                        totals[kind].append(sum(ms))
        finally:
            engine.close()
    # Per part, its least disturbed call; then scaled to the unmarked calls' least total.
    scaled = []
    for kind in kinds:
        fastest = np.min(np.array(parts[kind]), axis=0)
        log.info("profile: %s marked %.2f ms, unmarked %.2f ms", kind, fastest.sum(),
                 min(totals[kind]))
        scaled.append(fastest * min(totals[kind]) / fastest.sum())
    per_part = np.stack(scaled, axis=1)  # [embedding, layers..., head] x (prefill, decode, batch)

    def times(row: int) -> tuple[float, float, float]:
        prefill, decode, batch = (float(ms) for ms in per_part[row])
        return prefill, decode, batch

    return Measured(layers=[times(1 + layer) for layer in range(layers)],
                    embedding=times(0), head=times(layers + 1), message=message,
                    baseline_bytes=IDLE_AGENT_BYTES, key=cache_key(path),
                    measured_at=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"))


def _round(engine: LlamaCppEngine, prompt: np.ndarray, marker: _Marker | None
           ) -> list[tuple[str, list[float]]]:
    """One round's calls: a prompt, DECODE_STEPS steps of its request, DECODE_STEPS steps of
    BATCH_ROWS requests; per call its kind and its parts' ms (one part, the whole call,
    without a marker)."""
    caches = [engine.new_cache(0) for _ in range(BATCH_ROWS)]
    row = prompt[:, :1]
    calls: list[tuple[str, list[float]]] = []

    def call(kind: str, xs: list[np.ndarray], row_caches: list[Any], starts: list[int]) -> None:
        if marker is not None:
            marker.marks.clear()
        began = CLOCK()
        engine.run(xs, row_caches, starts)
        ended = CLOCK()
        calls.append((kind, [ms * 1e3 for ms in np.diff(
            [began, *(marker.check() if marker is not None else []), ended])]))

    try:
        call("prefill", [prompt], caches[:1], [0])
        # The batch's other requests start from a one-token prompt: a prompt each would
        # triple the profile's time, and attention over PREFILL_POSITIONS keys weighs
        # little beside the weights each step reads.
        engine.run([row] * (BATCH_ROWS - 1), caches[1:], [0] * (BATCH_ROWS - 1))
        for step in range(DECODE_STEPS):
            call("decode", [row], caches[:1], [PREFILL_POSITIONS + step])
        for step in range(DECODE_STEPS):
            starts = [PREFILL_POSITIONS + DECODE_STEPS + step, *[1 + step] * (BATCH_ROWS - 1)]
            call("batch", [row] * BATCH_ROWS, caches, starts)
    finally:
        for cache in caches:
            engine.free_cache(cache)
    return calls


class _Marker:
    """The eval callback that marks when the embedding and each layer are computed."""

    def __init__(self, layers: int) -> None:
        self.names = [b"embd", *(f"l_out-{i}".encode() for i in range(layers))]
        wanted = set(self.names)
        self.marks: list[float] = []
        _, ggml = library.capture_callback()
        get_name = ggml.ggml_get_name
        get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]

        def observe(tensor: int, ask: bool, _user: int) -> bool:
            if ask:  # would we look at this node once computed: then compute up to it
                return get_name(tensor) in wanted
            self.marks.append(CLOCK())
            return True  # go on with the graph

        self.callback = library.llama().ggml_backend_sched_eval_callback(observe)

    def check(self) -> list[float]:
        """This call's marks, one per name in order, or why llama.cpp's graph had others."""
        if len(self.marks) != len(self.names):
            raise EngineError(f"the profile expected llama.cpp's graph to pass "
                              f"{len(self.names)} marked nodes (embd, l_out-0, ...), it "
                              f"passed {len(self.marks)}: this architecture's graph names its "
                              "nodes otherwise")
        return self.marks
