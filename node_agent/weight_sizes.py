"""Bytes a stage's weights take in each weight mode, from the model's shapes alone.

The planner sizes stages with this before anything is loaded (it works on a
meta-device skeleton). Each mode is counted in the form its default engine
keeps (plant_config.schema.resolve_engine):

| mode | engine      | bytes of a matrix of E weights |
| ---  | ---         | --- |
| fp32 | torch       | 4 E; a tied head packed for oneDNN is a copy of its own |
| bf16 | torch       | 2 E |
| int8 | onnxruntime | E + 4 E / 32: codes and an fp32 scale per block of 32 |
| int4 | onnxruntime | E / 2 + 4.5 E / 32 (scale and zero point); embedding, head: int8 |

Norms, biases and the MoE router stay fp32 in every mode.
"""

from __future__ import annotations

import torch
from torch import nn

from node_agent import packed
from node_agent.engines.torch_weights import is_fused_experts
from plant_config.schema import WeightMode

# The block the onnxruntime engine quantizes in (node_agent/engines/onnx_weights.py).
BLOCK = 32
_SCALE_BYTES = 4


def stored_bytes(model: nn.Module, mode: WeightMode, *, edge: bool = False) -> int:
    """Bytes of parameters `model` holds in `mode`; `edge`: its matrices are the LM head
    (an embedding always is), which int4 keeps at 8 bits.

    A parameter shared by two modules (a tied head) counts once, except in
    fp32 with oneDNN, where the head is packed apart from the embedding's plain
    copy.
    """
    converted: dict[int, int] = {}  # id of a converted weight -> its bytes in `mode`
    packed_ids: set[int] = set()  # fp32 Linear weights, packed into copies of their own
    packed_bytes = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and mode == "fp32" and packed.available():
            packed_ids.add(id(module.weight))
            packed_bytes += matrix_bytes(module.weight.nelement(), mode)
        elif isinstance(module, nn.Linear | nn.Embedding):
            converted[id(module.weight)] = matrix_bytes(
                module.weight.nelement(), mode, edge=edge or isinstance(module, nn.Embedding))
        elif is_fused_experts(module):
            for name in ("gate_up_proj", "down_proj"):
                experts: torch.Tensor = getattr(module, name)                  # [E,N,K]
                converted[id(experts)] = matrix_bytes(experts.nelement(), mode)
    return packed_bytes + sum(
        converted.get(id(p), 0 if id(p) in packed_ids else p.nelement() * p.element_size())
        for p in model.parameters())


def matrix_bytes(elements: int, mode: WeightMode, *, edge: bool = False) -> int:
    """Bytes of a matrix of `elements` weights in `mode`."""
    if mode == "fp32":
        return 4 * elements
    if mode == "bf16":
        return 2 * elements
    scales = _SCALE_BYTES * elements // BLOCK
    if mode == "int8" or edge:
        return elements + scales
    return elements // 2 + scales + elements // BLOCK // 2  # codes, scales, zero points
