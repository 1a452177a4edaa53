"""The torch engine's weight modes: turn a loaded stage's weight matrices into fp32, bf16 or int8.

On the boxes memory is the binding constraint, and a CPU decode step is bound
by reading the weights, so smaller weights save memory and time alike. The
matrices are every `nn.Linear` (projections, MLPs, shared experts, the LM head),
the token embedding and MoE routed experts (each expert's two matrices, out of
transformers' fused 3-D tensors); norms, the router and rotary tables stay fp32 (they
are a fraction of a percent of the bytes, and the router's choice of experts
is discrete, so it is the last place to add error).

- fp32: unchanged. The default, because only fp32 is token-exact against
  `generate` in fp32.
- bf16: weights stored bf16; a Linear runs in bf16 (AVX512-BF16 here) and
  hands fp32 back. Half the bytes.
- int8 weight-only: int8 weights with one scale per output channel
  (symmetric, absmax / 127), computed by torch's CPU kernel
  `aten._weight_int8pack_mm`, which reads int8 and takes bf16 activations.
  About a quarter of the bytes.

Chosen by measurement on this CPU (2 threads, SmolLM2-135M shapes, one
decode row; `docs/weight-modes.md` has the whole-model numbers):

| path for a [1, 576] x [1536, 576]^T matmul            | us   |
| ---                                                    | ---  |
| fp32 `F.linear`                                        | ~100 |
| `_weight_int8pack_mm`, bf16 activations                | ~45  |
| `_weight_int8pack_mm`, fp32 activations                | ~450 |
| `_weight_int8pack_mm`, fp16 activations                | ~750 |
| int8 dequantized to bf16 per matmul, then `F.linear`   | ~340 |

optimum-quanto qint8 was measured at 12.6 tok/s against 30 for fp32 on the
whole model; torch.ao dynamic quantization is fast too but also quantizes
activations to 8 bits per tensor, which changed the very first greedy token
(`docs/stage-compute.md`), and torch.ao.quantization is deprecated.

int4 is not a mode of this engine: `aten._weight_int4pack_mm_for_cpu` ran only
~1.3x faster than the int8 kernel here, where ONNX Runtime's MatMulNBits runs
4-bit blocks with int8 activations (node_agent/engines/onnx_weights.py).

A weight shared by two modules (SmolLM2's LM head is its embedding) is
converted once and stays shared.

Shapes: N = output features (vocabulary rows for an embedding), K = input
features, M = rows of activations.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plant_config.schema import ENGINE_MODES, WeightMode

WEIGHT_MODES: tuple[WeightMode, ...] = ENGINE_MODES["torch"]

# Symmetric int8: [-127, 127], so that negating a weight negates its code.
INT8_MAX = 127
# The int8 kernel's fast path takes bf16 activations and scales (fp32 and fp16
# ones are 10-16x slower here); it returns bf16.
KERNEL_DTYPE = torch.bfloat16
# fp32 elements converted at a time (64 KiB of temporaries): a whole-matrix
# temporary would add the largest matrix to the conversion's peak memory
# (SmolLM2's 49152 x 576 head: 113 MB), on boxes where memory is the limit.
CHUNK_ELEMENTS = 16384


class Bf16Linear(nn.Module):
    """A Linear with bf16 weights: y [..., N] fp32 = x [..., K] W^T (+ b), computed in bf16."""

    def __init__(self, weight: nn.Parameter, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight                                                            # [N,K]
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(KERNEL_DTYPE)                               # [M,K]
        if len(rows) == 1:
            # oneDNN multiplies one bf16 row by another kernel than two or more, which
            # rounds some sums differently (K=1536 here): padded, a request's row comes
            # out the same alone as batched with others (tests/test_engines.py).
            y = F.linear(torch.cat([rows, torch.zeros_like(rows)]), self.weight)[:1]
        else:
            y = F.linear(rows, self.weight)
        y = y.to(x.dtype).reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class Int8Linear(nn.Module):
    """A Linear with int8 weights and one scale per output channel."""

    def __init__(self, weight: nn.Parameter, scale: nn.Parameter,
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        self.weight = weight                                                  # [N,K] int8
        self.scale = scale                                                    # [N] bf16
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).to(KERNEL_DTYPE)                             # [M,K]
        y: torch.Tensor = torch.ops.aten._weight_int8pack_mm(rows, self.weight,
                                                             self.scale)               # [M,N]
        y = y.to(x.dtype).reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias


class Bf16Embedding(nn.Module):
    """Token embedding stored bf16; looked-up rows come back fp32."""

    def __init__(self, weight: nn.Parameter, padding_idx: int | None) -> None:
        super().__init__()
        self.weight = weight                                                            # [N,K]
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, self.padding_idx).float()


class Int8Embedding(nn.Module):
    """Token embedding stored int8 with one scale per row (a tied head's scales)."""

    def __init__(self, weight: nn.Parameter, scale: nn.Parameter,
                 padding_idx: int | None) -> None:
        super().__init__()
        self.weight = weight                                                  # [N,K] int8
        self.scale = scale                                                    # [N] bf16
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.weight, self.padding_idx).float()                # [...,K]
        return rows * self.scale[ids].float().unsqueeze(-1)


class ConvertedExperts(nn.Module):
    """MoE routed experts with each expert's two matrices converted like a Linear.

    transformers keeps E experts fused as gate_up_proj [E, 2I, H] and down_proj
    [E, H, I] and runs them through its experts interface, whose kernels take
    fp32 or bf16 tensors only. This runs what its eager loop runs (gate and up
    halves of gate_up, act(gate) * up, down, scaled by the routing weight,
    summed per token), one converted Linear per expert and matrix.
    """

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module],
                 act_fn: nn.Module) -> None:
        super().__init__()
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)
        self.act_fn = act_fn

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden_states [S, H]; top_k_index, top_k_weights [S, k]. Returns [S, H]."""
        out = torch.zeros_like(hidden_states)
        # In ascending order, as the eager loop adds them (float sums depend on order).
        for expert in sorted(set(top_k_index.flatten().tolist())):
            if expert >= len(self.gate_up):  # expert parallelism's "not on this rank"
                continue
            token, slot = torch.where(top_k_index == expert)                       # [s], [s]
            gate, up = self.gate_up[expert](hidden_states[token]).chunk(2, dim=-1)  # [s,I] x2
            routed = self.down[expert](self.act_fn(gate) * up)                          # [s,H]
            out.index_add_(0, token, routed * top_k_weights[token, slot, None])
        return out


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers experts module in the layout ConvertedExperts runs."""
    return (getattr(module, "is_concatenated", None) is True
            and getattr(module, "is_transposed", None) is False
            and getattr(module, "has_bias", None) is False
            and getattr(module, "has_gate", None) is True
            and getattr(module, "has_post_expert_norm", False) is False
            and all(isinstance(getattr(module, n, None), nn.Parameter)
                    and getattr(module, n).dim() == 3 for n in ("gate_up_proj", "down_proj")))


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    # A Parameter, not a buffer, so that `parameters()` (and param_bytes) count it.
    return nn.Parameter(tensor, requires_grad=False)


def _int8(weight: torch.Tensor) -> tuple[nn.Parameter, nn.Parameter | None]:
    """Per-row symmetric int8 codes [N, K] and scales [N] of an fp32 weight [N, K]."""
    # The scale is rounded to the kernel's bf16 first and the codes computed
    # against the rounded value, so code * scale is what the kernel multiplies.
    absmax = torch.linalg.vector_norm(weight, ord=float("inf"), dim=1)                  # [N]
    scale = (absmax / INT8_MAX).to(KERNEL_DTYPE)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row
    codes = torch.empty(weight.shape, dtype=torch.int8)                                # [N,K]
    rows = max(1, CHUNK_ELEMENTS // weight.shape[1])
    for start in range(0, weight.shape[0], rows):
        chunk = weight[start:start + rows] / scale[start:start + rows].float().unsqueeze(1)
        codes[start:start + rows] = chunk.round_().clamp_(-INT8_MAX, INT8_MAX)
    return _frozen(codes), _frozen(scale)


def quantize(model: nn.Module, mode: WeightMode) -> None:
    """Replace every nn.Linear, nn.Embedding and fused experts module under `model`
    by its `mode` form, in place.

    Each fp32 weight is freed once its last module is replaced (if nothing
    else holds it), so the peak is about one stage in fp32.
    """
    if mode not in WEIGHT_MODES:
        raise ValueError(f"the torch engine runs weights {', '.join(WEIGHT_MODES)}, not "
                         f"{mode!r}: int4 runs on engine onnxruntime")
    if mode == "fp32":
        return
    # fp32 weight's data_ptr -> (converted weight, int8 scales or None for bf16)
    converted: dict[int, tuple[nn.Parameter, nn.Parameter | None]] = {}
    targets = [(parent, name) for parent in model.modules()
               for name, child in parent.named_children()
               if isinstance(child, nn.Linear | nn.Embedding) or is_fused_experts(child)]
    for parent, name in targets:
        child = getattr(parent, name)
        if is_fused_experts(child):
            setattr(parent, name, ConvertedExperts(
                [_linear(*_matrix(w, mode), None) for w in child.gate_up_proj.detach()],
                [_linear(*_matrix(w, mode), None) for w in child.down_proj.detach()],
                child.act_fn))
            continue
        key = child.weight.data_ptr()
        if key not in converted:
            converted[key] = _matrix(child.weight.detach(), mode)
        setattr(parent, name, _convert(child, *converted[key]))


def _matrix(weight: torch.Tensor, mode: WeightMode) -> tuple[nn.Parameter, nn.Parameter | None]:
    """fp32 [N, K] -> (bf16 [N, K], None) or (int8 codes [N, K], scales [N])."""
    if mode == "bf16":
        return _frozen(weight.to(KERNEL_DTYPE)), None
    return _int8(weight)


def _convert(module: nn.Linear | nn.Embedding, weight: nn.Parameter,
             scale: nn.Parameter | None) -> nn.Module:
    if isinstance(module, nn.Embedding):
        if scale is None:
            return Bf16Embedding(weight, module.padding_idx)
        return Int8Embedding(weight, scale, module.padding_idx)
    return _linear(weight, scale, module.bias)


def _linear(weight: nn.Parameter, scale: nn.Parameter | None,
            bias: torch.Tensor | None) -> nn.Module:
    if scale is None:
        return Bf16Linear(weight, bias)
    return Int8Linear(weight, scale, bias)
