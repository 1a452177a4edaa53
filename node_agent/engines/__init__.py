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
and fails over the same way whichever engine a node runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from node_agent.engines.base import ContextShape, Kernels, StageEngine, StageSlice
from plant_config.schema import Device, EngineName, WeightMode, resolve_engine

__all__ = ["ContextShape", "StageEngine", "StageSlice", "load_engine"]

# A node of the plant file's defaults: kv_budget_mb 512, max_prompt_tokens plus
# max_tokens_limit, and prefill_chunk (plant_config/schema.py).
DEFAULT_SHAPE = ContextShape(kv_budget_bytes=512 * 2**20, positions=5120, batch_positions=128)


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
    if tune:
        from node_agent.engines import tuning

        kernels, how = tuning.choose(model_dir, first, end, name, weights, device, threads)
    else:
        kernels, how = Kernels(threads or torch.get_num_threads()), "default"
    torch.set_num_threads(kernels.threads)
    stage = build(model_dir, first, end, name, weights, device, kernels)
    stage.tuned = how
    return stage


def build(model_dir: Path, first: int, end: int, engine: str, weights: WeightMode,
          device: Device, kernels: Kernels) -> StageEngine:
    """The `engine` ("torch" or "onnxruntime") for layers [first, end) with `kernels`."""
    if engine == "onnxruntime":
        from node_agent.engines.onnx_engine import OnnxEngine

        return OnnxEngine(model_dir, first, end, weights=weights, device=device,
                          threads=kernels.threads)
    from node_agent.engines.torch_engine import TorchEngine

    return TorchEngine(model_dir, first, end, weights=weights, kernels=kernels)
