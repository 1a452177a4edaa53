"""The planner's cost model of a model, measured on this machine: `edgebus plan`'s profile.

Time: the whole model runs as one fp32 stage (`TorchEngine`, the code path a
stage runs in production), and forward hooks time each decoder layer, the
embedding and the final norm + LM head separately, for a PREFILL_POSITIONS
prefill and for one decode step after it. Each time is the minimum over the
rounds, the least disturbed by other processes on shared cores, and it is
measured on one torch thread: the plan uses relative costs, and with two
threads on cores another process also used, decode measured ~10x slower
(OpenMP threads waiting for each other), one thread was undisturbed.

Memory: weight bytes per part and weight mode come from the model's shapes
(`weight_sizes.stored_bytes` on a meta-device skeleton, nothing loaded), and the
per-process baseline is the peak resident memory of a fresh Python that
imports what a stage agent imports and builds the model on the meta device
(measured in a child process: the caller's own memory, a test session's
say, says nothing of an agent's).

The measured part is cached as `edgebus-profile.json` in the model directory
and reused while the host, torch version and checkpoint files are the same;
`edgebus plan --profile` measures again.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, get_args

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from edgebus.errors import EdgebusError
from edgebus.processes import idle_agent_rss
from node_agent import packed
from node_agent.checkpoint import tensor_locations
from node_agent.kv_cache import KVCache
from node_agent.weight_sizes import stored_bytes
from plant_config.planner import PREFILL_POSITIONS, ModelCosts, PartBytes, PartCost
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


@dataclass(frozen=True)
class Measured:
    """What a profile measures, as cached: milliseconds per part and the process baseline."""

    layers: list[tuple[float, float]]   # (prefill ms, decode ms) per decoder layer
    embedding: tuple[float, float]
    head: tuple[float, float]           # final norm + LM head
    baseline_bytes: int
    key: dict[str, Any]                 # where and on what it was measured
    measured_at: str


def model_costs(model_dir: Path, *, remeasure: bool = False) -> tuple[ModelCosts, Measured, bool]:
    """The cost model of the model in `model_dir`, its measurements and whether they are new.

    Uses the cached profile unless `remeasure`, or unless it was measured on
    another machine, torch version or checkpoint; a fresh one is cached if
    the directory is writable.
    """
    key = _cache_key(model_dir)
    measured = None if remeasure else _read_cache(model_dir, key)
    fresh = measured is None
    if measured is None:
        measured = measure(model_dir)
        _write_cache(model_dir, measured)
    return costs_from(measured, weight_sizes(model_dir)), measured, fresh


def measure(model_dir: Path, *, rounds: int = ROUNDS) -> Measured:
    """Time every part of the model in `model_dir` on this machine (see the module doc)."""
    baseline = idle_agent_rss(model_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(PROFILE_THREADS)
    try:
        return _measure(model_dir, rounds, baseline)
    finally:
        torch.set_num_threads(threads)


def _measure(model_dir: Path, rounds: int, baseline: int) -> Measured:
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

    def pair(name: str | int) -> tuple[float, float]:
        return min(prefill[name]), min(decode[name])

    return Measured(layers=[pair(index) for index in range(num_layers)],
                    embedding=pair(_EMBEDDING), head=pair(_HEAD), baseline_bytes=baseline,
                    key=_cache_key(model_dir),
                    measured_at=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"))


def weight_sizes(model_dir: Path) -> tuple[tuple[PartBytes, ...], PartBytes, PartBytes, bool]:
    """Weight bytes per layer, of the embedding and of the head, in each mode; whether tied."""
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):  # shapes only: nothing is allocated
        skeleton = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    decoder = skeleton.get_decoder()
    head = skeleton.get_output_embeddings()

    def sizes(module: nn.Module, edge: bool = False) -> PartBytes:
        return PartBytes(**{mode: stored_bytes(module, mode, edge=edge)
                            for mode in get_args(WeightMode)})

    return (tuple(sizes(layer) for layer in decoder.layers), sizes(decoder.embed_tokens),
            sizes(nn.ModuleList([decoder.norm, head]), edge=True),
            head.weight is decoder.embed_tokens.weight)


def costs_from(measured: Measured,
               sizes: tuple[tuple[PartBytes, ...], PartBytes, PartBytes, bool]) -> ModelCosts:
    layer_bytes, embedding_bytes, head_bytes, tied = sizes
    if len(layer_bytes) != len(measured.layers):
        raise EdgebusError(f"the profile has {len(measured.layers)} layers, the model "
                           f"{len(layer_bytes)} — measure again with `edgebus plan --profile`")
    return ModelCosts(layers=tuple(PartCost(*pair) for pair in measured.layers),
                      embedding=PartCost(*measured.embedding), head=PartCost(*measured.head),
                      layer_bytes=layer_bytes, embedding_bytes=embedding_bytes,
                      head_bytes=head_bytes, tied=tied, baseline_bytes=measured.baseline_bytes,
                      packed_fp32=packed.available())


@contextmanager
def _timing(parts: dict[str | int, tuple[nn.Module, nn.Module]],
            into: dict[str | int, list[float]] | None) -> Iterator[None]:
    """Append each part's milliseconds in the enclosed forward pass to `into` (None: discard).

    A part runs from its first module's forward call to its last module's return.
    """
    started: dict[str | int, float] = {}
    handles = []
    for name, (first, last) in parts.items():
        def begin(*_: Any, name: str | int = name) -> None:
            started[name] = time.perf_counter()

        def end(*_: Any, name: str | int = name) -> None:
            if into is not None:
                into[name].append((time.perf_counter() - started[name]) * 1e3)

        handles += [first.register_forward_pre_hook(begin), last.register_forward_hook(end)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _cache_key(model_dir: Path) -> dict[str, Any]:
    """What a profile depends on: the machine, torch and its threads, the checkpoint files."""
    files = sorted({str(path) for path in tensor_locations(model_dir).values()})
    return {"host": platform.node(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "threads": PROFILE_THREADS,
            "prefill_positions": PREFILL_POSITIONS,
            "checkpoint": [[Path(f).name, os.stat(f).st_size, os.stat(f).st_mtime_ns]
                           for f in files]}


def _read_cache(model_dir: Path, key: dict[str, Any]) -> Measured | None:
    try:
        data = json.loads((model_dir / PROFILE_FILE).read_text(encoding="utf-8"))
        measured = Measured(layers=[(a, b) for a, b in data["layers"]],
                            embedding=tuple(data["embedding"]), head=tuple(data["head"]),
                            baseline_bytes=data["baseline_bytes"], key=data["key"],
                            measured_at=data["measured_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none, unreadable or of an older format: measure again
    return measured if measured.key == key else None


def _write_cache(model_dir: Path, measured: Measured) -> None:
    target = model_dir / PROFILE_FILE
    temporary = target.with_name(f".{PROFILE_FILE}.{os.getpid()}")
    try:
        temporary.write_text(json.dumps(asdict(measured), indent=1), encoding="utf-8")
        temporary.replace(target)  # atomic: a concurrent reader sees the old or the new file
    except OSError:
        temporary.unlink(missing_ok=True)  # a read-only model directory: plan without a cache
