"""Block-quantized matrices: the form 4- and 8-bit weights take between disk and kernel.

A matrix W [N, K] is cut along K into blocks of `block` weights, and each
weight is a small unsigned code:

    W[n, k] = (code[n, k] - zero[n, b]) * scale[n, b] + minimum[n, b],   b = k // block

This one form holds, without a rounding of their own, the GGUF block formats
llama.cpp ships (`from_gguf`) and the round-to-nearest quantization a stage
applies to fp32 weights (`node_agent/engines/onnx_weights.py`):

| GGUF  | block | bits | zero | minimum | maps losslessly |
| ---   | ---   | ---  | ---  | ---     | ---             |
| Q4_0  | 32    | 4    | 8    | none    | yes             |
| Q8_0  | 32    | 8    | 128  | none    | yes (codes shifted by 128) |
| Q4_1  | 32    | 4    | 0    | m       | yes, with the float minimum kept beside the codes |
| Q4_K  | 32    | 4    | 0    | -dmin*m | yes, the 6-bit sub-block scales multiplied out |
| Q6_K  | 16    | 8    | 32   | none    | yes, 6-bit codes held in 8 bits |

"Maps losslessly" means the blocks dequantize, in float32, to the very bits
gguf-py's dequantization gives (the values transformers reads from the GGUF):
tests/test_keep_quantized.py checks each type so, and `edgebus model
import-gguf --keep-quantized` checks every matrix it keeps again.

Q4_1 and Q4_K add a float `minimum` per block: an integer zero point cannot
hold it (m / d is not an integer), so requantizing to one would round every
block a second time. The ONNX Runtime engine runs the minimum as its own
small product (`minimum` times each block's sum of activations) beside the
4-bit kernel, which is how llama.cpp computes Q4_1 too.

Codes are packed along K as ONNX Runtime's MatMulNBits takes them: [N,
K/block, block*bits/8] bytes, two 4-bit codes a byte with the lower index in
the low nibble.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

# GGUF quantization types that map onto this form, by gguf-py's type name.
GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")
# llama.cpp's k-quants come in super-blocks of 256 weights.
_QK_K = 256

Array = npt.NDArray[np.uint8]


@dataclass(frozen=True)
class BlockQuantized:
    """W [N, K] as codes, per-block scales, zero points and (optionally) minimums."""

    codes: npt.NDArray[np.uint8]               # [N, K/block, block*bits/8], packed along K
    scales: npt.NDArray[np.float32]            # [N, K/block]
    zeros: npt.NDArray[np.uint8] | None        # [N, K/block]; None: 2**(bits-1)
    minimums: npt.NDArray[np.float32] | None   # [N, K/block]; None: no offset
    bits: int
    block: int
    source: str  # how it was made: "Q4_1", "rtn-int4", ... (reported, never interpreted)

    @property
    def shape(self) -> tuple[int, int]:
        n, blocks, _ = self.codes.shape
        return n, blocks * self.block

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.codes, self.scales, self.zeros, self.minimums)
                   if a is not None)

    def unpacked_codes(self, rows: npt.NDArray[np.int64] | slice = slice(None)
                       ) -> npt.NDArray[np.uint8]:
        """[n, K] codes of `rows`."""
        packed = self.codes[rows]
        if self.bits == 8:
            return packed.reshape(packed.shape[0], -1)
        low, high = packed & 0x0F, packed >> 4                              # [n, K/b, b/2] x2
        return np.stack([low, high], axis=-1).reshape(packed.shape[0], -1)

    def dequantize(self, rows: npt.NDArray[np.int64] | slice = slice(None)
                   ) -> npt.NDArray[np.float32]:
        """[n, K] float32 weights of `rows`, computed in float32 as gguf-py computes them."""
        codes = self.unpacked_codes(rows).astype(np.float32)
        n = codes.shape[0]
        blocks = codes.reshape(n, -1, self.block)                                 # [n,K/b,b]
        zeros = (np.float32(2 ** (self.bits - 1)) if self.zeros is None
                 else self.zeros[rows].astype(np.float32)[..., None])
        out = (blocks - zeros) * self.scales[rows][..., None]
        if self.minimums is not None:
            out = out + self.minimums[rows][..., None]
        return np.ascontiguousarray(out.reshape(n, -1), dtype=np.float32)

    def permute_rows(self, order: npt.NDArray[np.int64]) -> BlockQuantized:
        """The same matrix with its rows taken in `order` (a GGUF file may store Q and K
        rows in llama.cpp's rotary order)."""
        def pick(a: npt.NDArray[Any] | None) -> npt.NDArray[Any] | None:
            return None if a is None else np.ascontiguousarray(a[order])

        return BlockQuantized(np.ascontiguousarray(self.codes[order]),
                              np.ascontiguousarray(self.scales[order]), pick(self.zeros),
                              pick(self.minimums), self.bits, self.block, self.source)


def pack_codes(codes: npt.NDArray[np.uint8], bits: int, block: int) -> npt.NDArray[np.uint8]:
    """[N, K] unpacked codes -> [N, K/block, block*bits/8] packed along K."""
    n, k = codes.shape
    if bits == 8:
        return np.ascontiguousarray(codes.reshape(n, k // block, block))
    pairs = codes.reshape(n, k // block, block // 2, 2)
    return np.ascontiguousarray(pairs[..., 0] | (pairs[..., 1] << 4))


def from_gguf(raw: npt.NDArray[np.uint8], qtype: str, rows: int, cols: int) -> BlockQuantized:
    """The GGUF tensor of type `qtype` holding W [rows, cols] (raw bytes as gguf-py reads
    them: one row of blocks per matrix row), unchanged in value."""
    if cols % (_QK_K if qtype.endswith("_K") else 32):
        raise ValueError(f"{qtype} rows of {cols} weights do not split into whole blocks")
    data = np.ascontiguousarray(raw).reshape(rows, -1).view(np.uint8)
    converter = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q8_0": _q8_0, "Q4_K": _q4_k,
                 "Q6_K": _q6_k}.get(qtype)
    if converter is None:
        raise ValueError(f"{qtype} is not one of the block formats kept as they are "
                         f"({', '.join(GGUF_TYPES)})")
    return converter(data, rows, cols)


def _blocks(data: Array, rows: int, size: int) -> Array:
    return data.reshape(rows, -1, size)


def _half(blocks: Array, offset: int) -> npt.NDArray[np.float32]:
    """The fp16 field at byte `offset` of every block, as float32 [rows, blocks]."""
    return np.ascontiguousarray(blocks[..., offset:offset + 2]).view(np.float16)[..., 0] \
        .astype(np.float32)


def _gguf_nibbles(qs: Array) -> npt.NDArray[np.uint8]:
    """GGUF's 4-bit block [.., 16 bytes] (weight j in byte j's low nibble, weight j+16 in
    its high nibble) -> [.., 32] codes in weight order."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.uint8)


def _q4_0(data: Array, rows: int, cols: int) -> BlockQuantized:
    blocks = _blocks(data, rows, 18)                        # d: f16, qs: 16 bytes
    codes = _gguf_nibbles(blocks[..., 2:]).reshape(rows, cols)
    return BlockQuantized(pack_codes(codes, 4, 32), _half(blocks, 0), None, None, 4, 32, "Q4_0")


def _q4_1(data: Array, rows: int, cols: int) -> BlockQuantized:
    blocks = _blocks(data, rows, 20)                        # d, m: f16, qs: 16 bytes
    codes = _gguf_nibbles(blocks[..., 4:]).reshape(rows, cols)
    zeros = np.zeros((rows, cols // 32), np.uint8)
    return BlockQuantized(pack_codes(codes, 4, 32), _half(blocks, 0), zeros, _half(blocks, 2),
                          4, 32, "Q4_1")


def _q8_0(data: Array, rows: int, cols: int) -> BlockQuantized:
    blocks = _blocks(data, rows, 34)                        # d: f16, qs: 32 x int8
    signed = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
    codes = (signed.astype(np.int16) + 128).astype(np.uint8).reshape(rows, cols)
    return BlockQuantized(pack_codes(codes, 8, 32), _half(blocks, 0), None, None, 8, 32, "Q8_0")


def _k_scales(packed: Array) -> tuple[Array, Array]:
    """Q4_K's 12 bytes of eight 6-bit scales and eight 6-bit minimums -> [.., 8] each
    (llama.cpp's get_scale_min_k4)."""
    s = packed.astype(np.uint8)
    scales = np.concatenate([s[..., 0:4] & 63,
                             (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mins = np.concatenate([s[..., 4:8] & 63,
                           (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return scales, mins


def _q4_k(data: Array, rows: int, cols: int) -> BlockQuantized:
    blocks = _blocks(data, rows, 144)          # d, dmin: f16; scales: 12 bytes; qs: 128 bytes
    d, dmin = _half(blocks, 0)[..., None], _half(blocks, 2)[..., None]       # [rows, S, 1]
    sc, mn = _k_scales(blocks[..., 4:16])                                      # [rows, S, 8]
    qs = blocks[..., 16:].reshape(rows, -1, 4, 32)         # 4 chunks of 32 bytes = 64 weights
    # Chunk c holds sub-block 2c in its low nibbles and 2c+1 in its high nibbles.
    codes = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, cols).astype(np.uint8)
    scales = (d * sc.astype(np.float32)).reshape(rows, -1)
    minimums = (-(dmin * mn.astype(np.float32))).reshape(rows, -1)
    zeros = np.zeros((rows, cols // 32), np.uint8)
    return BlockQuantized(pack_codes(codes, 4, 32), scales.astype(np.float32), zeros,
                          minimums.astype(np.float32), 4, 32, "Q4_K")


def _q6_k(data: Array, rows: int, cols: int) -> BlockQuantized:
    blocks = _blocks(data, rows, 210)       # ql: 128 bytes, qh: 64 bytes, scales: 16 x int8, d
    ql = blocks[..., :128].reshape(rows, -1, 2, 64)                   # two halves of 128
    qh = blocks[..., 128:192].reshape(rows, -1, 2, 32)
    scales = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    d = _half(blocks, 208)[..., None]
    # llama.cpp's dequantize_row_q6_K: per half, four runs of 32 weights.
    low = [ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4]
    high = [(qh >> shift) & 3 for shift in (0, 2, 4, 6)]
    runs = [(lo | (hi << 4)).astype(np.uint8) for lo, hi in zip(low, high, strict=True)]
    codes = np.stack(runs, axis=3).reshape(rows, cols)                   # 6-bit, 0..63
    return BlockQuantized(pack_codes(codes, 8, 16), (d * scales).reshape(rows, -1),
                          np.full((rows, cols // 16), 32, np.uint8), None, 8, 16, "Q6_K")
