"""The planner's cost model of a model, measured on this machine: `edgebus plan`'s profile.

Time: the whole model runs as one fp32 stage (`TorchEngine`, the code path a
stage runs in production), and forward hooks time each decoder layer, the
embedding and the final norm + LM head separately, for a PREFILL_POSITIONS
prefill and for one decode step after it. Each time is the minimum over the
rounds, the least disturbed by other processes on shared cores, and it is
measured on one torch thread: the plan uses relative costs, and with two
threads on cores another process also used, decode measured ~10x slower
(OpenMP threads waiting for each other), one thread was undisturbed.

The same hooks time a decode step of BATCH_ROWS rows, the batch the
coordinator forms per request group: a step's cost is not the 1-row cost
times the rows, nor the 1-row cost (on SmolLM2 here, 1.0x it for the head, 1.1-1.2x
for a layer).

Messages: the CPU a decode message costs its agents and Mosquitto
(node_agent/message_cost.py). node_agent/costs.py caches and dispatches: a
GGUF file is profiled in llama.cpp instead, node_agent/gguf_profile.py.

Memory: weight bytes per part and weight mode come from the model's shapes
(`weight_sizes.stored_bytes` on a meta-device skeleton, nothing loaded), and the
per-process baseline is the peak resident memory of a fresh Python that
imports what a stage agent imports and builds the model on the meta device
(measured in a child process: the caller's own memory, a test session's
say, says nothing of an agent's).

The measured part is cached as `edgebus-profile.json` in the model directory
and reused while the host, torch version and checkpoint files are the same;
`edgebus plan --profile` measures again. `costs.model_costs` is the entry point.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, get_args

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from broker.mosquitto import mosquitto_binary
from edgebus.core.paths import GGUF_FILE
from edgebus.core.processes import idle_agent_rss
from node_agent import packed
from node_agent.checkpoint import tensor_locations
from node_agent.gguf_model import EMBEDDING, HEAD, part_bytes
from node_agent.kv_cache import KVCache
from node_agent.measured import Measured, Sizes, costs_from
from node_agent.message_cost import measure_message
from node_agent.weight_sizes import stored_bytes
from plant_config.planner import BATCH_ROWS, PREFILL_POSITIONS, ModelCosts, PartBytes
from plant_config.schema import WeightMode

PROFILE_FILE = "edgebus-profile.json"
# Untimed first round: it pays for allocator growth and oneDNN's kernel choice per shape.
WARMUP_ROUNDS = 1
# Timed rounds: the minimum of 3 shrugs off rounds disturbed by other
# processes; a round of SmolLM2-135M takes ~1.5 s here on one thread.
ROUNDS = 3
PROFILE_THREADS = 1  # see the module doc
# Decode steps per round: each is cheap, and more give the minimum more chances.
DECODE_STEPS = 8
# Token ids drawn for the timing prompt: any ids the vocabulary holds time the same.
_PROMPT_IDS = 1000
_EMBEDDING, _HEAD = "embedding", "head"


def cache_path(model_dir: Path) -> Path:
    return model_dir / PROFILE_FILE


def costs(measured: Measured, model_dir: Path) -> ModelCosts:
    return costs_from(measured, weight_sizes(model_dir), packed_fp32=packed.available())


def measure(model_dir: Path, *, rounds: int = ROUNDS) -> Measured:
    """Time every part of the model in `model_dir` on this machine (see the module doc)."""
    baseline = idle_agent_rss(model_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(PROFILE_THREADS)
    try:
        hidden = AutoConfig.from_pretrained(model_dir).hidden_size
        message = measure_message(hidden) if mosquitto_binary() is not None else None
        return _measure(model_dir, rounds, baseline, message)
    finally:
        torch.set_num_threads(threads)


def _measure(model_dir: Path, rounds: int, baseline: int,
             message: tuple[float, float] | None) -> Measured:
    from node_agent.engines.torch_engine import TorchEngine

    num_layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    model = TorchEngine(model_dir, 0, num_layers)
    assert model.embed_tokens is not None and model.norm is not None and model.lm_head is not None
    parts: dict[str | int, tuple[nn.Module, nn.Module]] = {
        index: (layer, layer) for index, layer in enumerate(model.layers)}
    parts[_EMBEDDING] = (model.embed_tokens, model.embed_tokens)
    parts[_HEAD] = (model.norm, model.lm_head)
    prefill: dict[str | int, list[float]] = {name: [] for name in parts}
    decode: dict[str | int, list[float]] = {name: [] for name in parts}
    batch: dict[str | int, list[float]] = {name: [] for name in parts}
    generator = torch.Generator().manual_seed(0)
    for round_index in range(WARMUP_ROUNDS + rounds):
        timed = round_index >= WARMUP_ROUNDS
        cache = KVCache()
        ids = torch.randint(0, _PROMPT_IDS, (1, PREFILL_POSITIONS), generator=generator)
        with _timing(parts, prefill if timed else None):
            model.prefill(ids, cache, 0)
        for step in range(DECODE_STEPS):
            with _timing(parts, decode if timed else None):
                model.decode(ids[:, :1], [cache], [PREFILL_POSITIONS + step])
        # The batch's rows are requests of their own, each with its prompt's cache.
        caches = [KVCache() for _ in range(BATCH_ROWS)]
        for row_cache in caches:
            model.prefill(ids, row_cache, 0)
        rows = ids[:1, :1].expand(BATCH_ROWS, 1)
        for step in range(DECODE_STEPS):
            with _timing(parts, batch if timed else None):
                model.decode(rows, caches, [PREFILL_POSITIONS + step] * BATCH_ROWS)

    def times(name: str | int) -> tuple[float, float, float]:
        return min(prefill[name]), min(decode[name]), min(batch[name])

    return Measured(layers=[times(index) for index in range(num_layers)],
                    embedding=times(_EMBEDDING), head=times(_HEAD), message=message,
                    baseline_bytes=baseline,
                    key=cache_key(model_dir),
                    measured_at=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"))


def weight_sizes(model_dir: Path) -> Sizes:
    """Weight bytes per layer, of the embedding and of the head, in each mode; whether tied."""
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):  # shapes only: nothing is allocated
        skeleton = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    decoder = skeleton.get_decoder()
    head = skeleton.get_output_embeddings()

    # An imported directory keeps its GGUF as shipped, whose bytes a gguf stage holds.
    in_file = part_bytes(model_dir / GGUF_FILE) if (model_dir / GGUF_FILE).is_file() else {}

    def sizes(module: nn.Module, part: str | int, edge: bool = False) -> PartBytes:
        return PartBytes(**{mode: stored_bytes(module, mode, edge=edge)
                            for mode in get_args(WeightMode) if mode != "gguf"},
                         gguf=in_file.get(part, 0))

    return (tuple(sizes(layer, i) for i, layer in enumerate(decoder.layers)),
            sizes(decoder.embed_tokens, EMBEDDING),
            sizes(nn.ModuleList([decoder.norm, head]), HEAD, edge=True),
            head.weight is decoder.embed_tokens.weight)


@contextmanager
def _timing(parts: dict[str | int, tuple[nn.Module, nn.Module]],
            into: dict[str | int, list[float]] | None) -> Iterator[None]:
    """Append each part's milliseconds in the enclosed forward pass to `into` (None: discard).

    A part runs from its first module's forward call to its last module's return,
    summed over the calls (a batched step may call a part once per row).
    """
    started: dict[str | int, float] = {}
    spent: dict[str | int, float] = dict.fromkeys(parts, 0.0)
    handles = []
    for name, (first, last) in parts.items():
        def begin(*_: Any, name: str | int = name) -> None:
            started[name] = time.perf_counter()

        def end(*_: Any, name: str | int = name) -> None:
            spent[name] += (time.perf_counter() - started[name]) * 1e3

        handles += [first.register_forward_pre_hook(begin), last.register_forward_hook(end)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
    if into is not None:
        for name, ms in spent.items():
            into[name].append(ms)


def cache_key(model_dir: Path) -> dict[str, Any]:
    """What a profile depends on: the machine, torch and its threads, the checkpoint files."""
    files = sorted({str(path) for path in tensor_locations(model_dir).values()})
    return {"host": platform.node(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "threads": PROFILE_THREADS,
            "prefill_positions": PREFILL_POSITIONS,
            "checkpoint": [[Path(f).name, os.stat(f).st_size, os.stat(f).st_mtime_ns]
                           for f in files]}


