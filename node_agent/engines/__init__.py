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

from pathlib import Path

from node_agent.engines.base import StageEngine, StageSlice
from plant_config.schema import Device, EngineName, WeightMode, resolve_engine

__all__ = ["StageEngine", "StageSlice", "load_engine"]


def load_engine(model_dir: Path, first: int, end: int, *, engine: EngineName = "auto",
                weights: WeightMode = "fp32", device: Device = "cpu",
                threads: int | None = None) -> StageEngine:
    """Layers [first, end) of the model in `model_dir`, loaded by the engine the plant names."""
    if resolve_engine(engine, weights) == "onnxruntime":
        from node_agent.engines.onnx_engine import OnnxEngine

        return OnnxEngine(model_dir, first, end, weights=weights, device=device, threads=threads)
    from node_agent.engines.torch_engine import TorchEngine

    return TorchEngine(model_dir, first, end, weights=weights)
