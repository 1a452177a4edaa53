"""What runs a stage's layers: one engine per module, behind `StageEngine` (base.py).

| `engine:`     | module          | weights          | what it is for |
| ---           | ---             | ---              | --- |
| `torch`       | torch_engine.py | fp32, bf16, int8 | the reference: transformers' own layers, |
|               |                 |                  | token-exact in fp32 against `generate` |
| `onnxruntime` | onnx_engine.py  | fp32, int8, int4 | speed: ONNX Runtime's pre-packed fp32 |
|               |                 |                  | and int8-activation 4/8-bit kernels |
| `auto`        |                 |                  | torch for fp32 and bf16, onnxruntime for |
|               |                 |                  | int8 and int4 (schema.resolve_engine) |

Both keep each request's keys and values in a `KVCache` and run attention
per request in torch (node_agent/ragged.py), so the stage agent batches
and fails over the same way whichever engine a node runs. `llamacpp`
(llamacpp/) keeps them in llama.cpp and needs neither torch nor
transformers: this package imports them only for the engines that do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgebus.core.errors import EngineError
from node_agent.engines.base import ContextShape, Kernels, StageEngine, StageSlice
from node_agent.engines.torch_side import build
from node_agent.model_config import LLAMACPP_KV_ITEM_BYTES, kv_bytes_per_token
from plant_config.schema import Device, EngineName, WeightMode, resolve_engine
from plant_config.stage_memory import INIT_KV_REQUESTS, context_shape

if TYPE_CHECKING:
    from plant_config import Plant

__all__ = ["INIT_KV_REQUESTS", "ContextShape", "KvReservation", "StageEngine", "StageSlice",
           "context_shape", "kv_reservation", "load_engine"]

# What the `torch` extra installs (pyproject.toml) for the torch and onnxruntime engines. A
# base install, as a llama.cpp box has, lacks them: a stage of those engines says which extra
# to add rather than die of ModuleNotFoundError ('onnx', for `weights: int8`).
TORCH_EXTRA_MODULES = frozenset({"torch", "transformers", "safetensors", "accelerate",
                                 "onnxruntime", "onnx", "onnxscript"})
# For tools and tests that load an engine outside a plant (agents pass their node's
# shape): a request or two of 2048 positions, the plant's default prefill_chunk. llama.cpp
# allocates the whole budget at load, so it is kept small.
DEFAULT_SHAPE = ContextShape(kv_budget_bytes=128 * 2**20, positions=2048, batch_positions=128)


@dataclass(frozen=True)
class KvReservation:
    """What a request reserves of a node's KV budget, as the coordinator books it."""

    per_position: int  # bytes per position of the request's longest length
    per_request: int  # bytes whatever its length (llama.cpp's fixed share of its context)
    budget: int  # bytes the node may book

    def need(self, positions: int) -> int:
        return self.per_request + self.per_position * positions


def kv_reservation(plant: Plant, node_id: str, config: Any) -> KvReservation:
    """How `node_id`'s engine spends its KV budget: by position (torch, onnxruntime), or
    in equal shares made up front, one per request (llamacpp)."""
    spec = plant.node(node_id)
    if resolve_engine(spec.engine, spec.weights) != "llamacpp":
        return KvReservation(kv_bytes_per_token(config, spec.layers), 0,
                             spec.kv_budget_mb * 2**20)
    shape = context_shape(plant, node_id)
    per_position = kv_bytes_per_token(config, spec.layers, LLAMACPP_KV_ITEM_BYTES)
    share = shape.sequence_positions * per_position
    return KvReservation(0, share, share * shape.sequences(per_position))


def with_kv_budgets(plant: Plant, config: Any) -> Plant:
    """`plant` with each llama.cpp node's `kv_budget_mb` raised where it would hold fewer
    than INIT_KV_REQUESTS requests (`config`: the model's)."""
    stages = []
    for spec in plant.stages:
        if resolve_engine(spec.engine, spec.weights) == "llamacpp":
            wanted = -(-INIT_KV_REQUESTS * kv_reservation(plant, spec.node, config).per_request
                       // 2**20)
            if wanted > spec.kv_budget_mb:
                spec = spec.model_copy(update={"kv_budget_mb": wanted})
        stages.append(spec)
    return plant.model_copy(update={"stages": stages})


def load_engine(model_dir: Path, first: int, end: int, *, engine: EngineName = "auto",
                weights: WeightMode = "fp32", device: Device = "cpu",
                threads: int | None = None, tune: bool = False,
                shape: ContextShape | None = None) -> StageEngine:
    """Layers [first, end) of the model in `model_dir`, loaded by the engine the plant names.

    `threads`: fixed by the plant (None: this process's torch threads, or measured).
    `tune`: time the kernel options on this box first (node_agent/engines/tuning.py);
    agents do, tests and tools that compare engines do not.
    `shape`: what the node may hold, which llamacpp sizes its context by
    (None: DEFAULT_SHAPE).
    """
    name = resolve_engine(engine, weights)
    if name == "llamacpp":
        from node_agent.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(model_dir, first, end, shape=shape or DEFAULT_SHAPE,
                              threads=threads or os.cpu_count() or 1, device=device)
    try:
        return _load_torch_side(model_dir, first, end, name, weights, device, threads, tune)
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in TORCH_EXTRA_MODULES:
            raise
        raise EngineError(
            f"engine {name} (weights: {weights}) needs the `torch` extra, and {exc.name} is "
            "not installed: pip install torch==2.13.0 \"edgebus[torch]\" (on aarch64 torch's "
            "CPU build comes from PyTorch's own index: README.md), or give the stage "
            "`weights: gguf`, which llama.cpp runs on the base install") from None


def _load_torch_side(model_dir: Path, first: int, end: int, name: str, weights: WeightMode,
                     device: Device, threads: int | None, tune: bool) -> StageEngine:
    """The torch or onnxruntime engine, as `load_engine` describes it."""
    # Imported here: a llama.cpp box has no torch (docs/deploy.md).
    import torch

    if tune:
        from node_agent.engines import tuning

        kernels, how = tuning.choose(model_dir, first, end, name, weights, device, threads)
    else:
        kernels, how = Kernels(threads or torch.get_num_threads()), "default"
    torch.set_num_threads(kernels.threads)
    stage = build(model_dir, first, end, name, weights, device, kernels)
    stage.tuned = how
    return stage

