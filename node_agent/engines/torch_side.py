"""The engines of the `torch` extra, built: torch's and onnxruntime's.

Called by `load_engine` (node_agent/engines/__init__.py) and by the kernel
tuning (tuning.py), which times each option on a stage it builds here.
"""

from __future__ import annotations

from pathlib import Path

from node_agent.engines.base import Kernels, StageEngine
from plant_config.schema import Device, WeightMode


def build(model_dir: Path, first: int, end: int, engine: str, weights: WeightMode,
          device: Device, kernels: Kernels) -> StageEngine:
    """The `engine` ("torch" or "onnxruntime") for layers [first, end) with `kernels`."""
    if engine == "onnxruntime":
        from node_agent.engines.onnx_engine import OnnxEngine

        return OnnxEngine(model_dir, first, end, weights=weights, device=device,
                          threads=kernels.threads)
    from node_agent.engines.torch_engine import TorchEngine

    return TorchEngine(model_dir, first, end, weights=weights, kernels=kernels)
