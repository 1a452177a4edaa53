"""fp32 linear layers with their weights packed in oneDNN's blocked layout.

`F.linear` on a plain [out, in] weight runs MKL's GEMM, which copies ("packs")
the weight into its own blocked layout on every call: for the few rows of a
decode batch that copy costs as much as the product. Packing once at load
time and calling oneDNN's linear on the packed weight skips it. Measured
here, one thread, the whole SmolLM2-135M as one stage, a decode step:

| batch | plain weights | packed |
| --- | --- | --- |
| 1 | 48 ms | 50 ms; 46 ms padded to MIN_ROWS |
| 4 | 85 ms | 48 ms |
| 8 | 100 ms | 64 ms |
| 16 | 137 ms | 92 ms |

oneDNN sums in another order than MKL, as a batched GEMM already does
against one-row GEMV: the exactness tests against `generate` cover it.

A weight is packed in blocks of ROWS_PER_BLOCK output rows, each read from
the checkpoint on its own, so packing never holds a whole plain copy of a
large matrix beside its packed one (SmolLM2's 49152 x 576 head is 113 MB).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from node_agent.engines.base import MIN_ROWS

# Output rows packed at a time: 4096 x 576 fp32 is 9 MiB of transient memory;
# every decoder weight of SmolLM2 is one block, the head twelve.
ROWS_PER_BLOCK = 4096


def available() -> bool:
    """Whether this torch has oneDNN (x86 and aarch64 builds do)."""
    return bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]


class PackedLinear(nn.Module):
    """y [..., N] = x [..., K] W^T (+ b), with W held as oneDNN-packed row blocks."""

    def __init__(self, rows: Callable[[int, int], torch.Tensor], out_features: int,
                 bias: torch.Tensor | None, min_rows: int = MIN_ROWS) -> None:
        """`rows(first, end)` gives W[first:end] ([end - first, K] fp32), block by block;
        products of fewer than `min_rows` rows are padded to it."""
        super().__init__()
        self.out_features = out_features
        self.min_rows = min_rows
        starts = range(0, out_features, ROWS_PER_BLOCK)
        # Opaque oneDNN tensors: not parameters (they have no storage to share).
        self.blocks = [
            torch.ops.mkldnn._reorder_linear_weight(  # the batch size is only a tuning hint
                rows(first, min(first + ROWS_PER_BLOCK, out_features)).contiguous(), 8)
            for first in starts]
        # The bias goes into the product, as F.linear adds it.
        self.biases = [None if bias is None else
                       bias.detach()[first:first + ROWS_PER_BLOCK].contiguous()
                       for first in starts]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.blocks, *self.biases]
                   if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., K] -> [..., N]."""
        rows = x.numel() // x.shape[-1]
        if rows >= self.min_rows:
            return self._product(x)
        # An output row depends on its own input row only: the zero rows change nothing.
        flat = x.reshape(rows, x.shape[-1])                                          # [R,K]
        padded = torch.cat([flat, flat.new_zeros(self.min_rows - rows, flat.shape[1])])  # [m,K]
        return self._product(padded)[:rows].reshape(*x.shape[:-1], self.out_features)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.ops.mkldnn._linear_pointwise(x, block, bias, "none", [], "")
                 for block, bias in zip(self.blocks, self.biases, strict=True)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
