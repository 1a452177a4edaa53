"""A part's weights, put into its exported template in the stage's weight mode.

Every linear layer of a template is `MatMul(x, Transpose(W))` (or a Gemm with
transB); it becomes, by the form its weight takes in the mode:

- fp32: `MatMul(x, W^T)`, W^T as a plain initializer.
- block-quantized (int8, int4, or GGUF blocks kept at import):
  ONNX Runtime's `MatMulNBits` at `accuracy_level()`, plus, for formats with a
  float minimum per block (Q4_1, Q4_K), that minimum's share:
  `blocksum(x) @ minimum^T`, where blocksum adds up x over each block
  (node_agent/blockwise.py explains why it is not a zero point).

What each mode stores (`matrix_in_mode`):

| mode | decoder matrices | embedding and LM head |
| ---  | ---              | ---                   |
| fp32 | fp32             | fp32                  |
| int8 | 8-bit, blocks of 32, symmetric | 8-bit  |
| int4 | 4-bit, blocks of 32, float minimum | 8-bit, as llama.cpp keeps them |

Weights kept from a GGUF run as they were stored, whatever the mode (fp32
dequantizes them): requantizing would round them a second time.

Shapes: N = output features, K = input features, M = rows of activations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import onnx
from onnx import helper, numpy_helper
from onnxruntime.capi._pybind_state import quantize_matmul_8bits

from node_agent.blockwise import BlockQuantized, pack_codes
from node_agent.engines.cpu_flags import host_cpu_flags
from plant_config.schema import WeightMode

Matrix = npt.NDArray[np.float32] | BlockQuantized

# Weights a block: llama.cpp's Q4_0/Q8_0 block. Smaller blocks follow the
# weights more closely and cost a scale (4 bytes) per block: at 32, 1/8 byte
# per weight over the 4-bit codes, so int4 is 0.156x fp32.
BLOCK = 32
# At level 4 MatMulNBits quantizes activations to int8 per block and multiplies in
# int32: on SmolLM2, one thread, whole model, 74 tok/s against ~45 at level 0, which
# dequantizes to fp32 first (Intel Xeon, AVX512-VNNI). A stage must compute a request's row
# alike whatever else is batched with it; on a CPU without VNNI (AMD EPYC Zen 3, AVX2 only)
# level 4 does not: three requests batched differed from each alone by 1.7 in logits of 31
# (tests/test_engines.py), while level 0 held. So level 4 only where VNNI does the product.
INT8_ACCURACY_LEVEL = 4
FP32_ACCURACY_LEVEL = 0
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni"})


def accuracy_level() -> int:
    """MatMulNBits' accuracy_level for this CPU (see INT8_ACCURACY_LEVEL)."""
    return INT8_ACCURACY_LEVEL if host_cpu_flags() & VNNI_FLAGS else FP32_ACCURACY_LEVEL
_MS_DOMAIN = "com.microsoft"


def matrix_in_mode(weight: Matrix, mode: WeightMode, *, edge: bool) -> Matrix:
    """The form `weight` [N, K] takes in `mode`; `edge`: the embedding or the LM head."""
    if isinstance(weight, BlockQuantized):
        return weight.dequantize() if mode == "fp32" else weight
    if mode == "fp32":
        return weight
    if mode == "int4" and not edge:
        return quantize_int4(weight)
    return quantize_int8(weight)


def quantize_int8(weight: npt.NDArray[np.float32]) -> BlockQuantized:
    """Symmetric round-to-nearest 8-bit blocks of fp32 [N, K], by ONNX Runtime's own C++
    quantizer (the one its MatMulNBits tooling uses)."""
    n, k = _blocks_of(weight)
    codes = np.zeros((n, k // BLOCK, BLOCK), np.uint8)
    scales = np.zeros((n, k // BLOCK), np.float32)
    unused_zeros = np.zeros((n, k // BLOCK), np.uint8)  # symmetric: the default 128
    quantize_matmul_8bits(codes, np.ascontiguousarray(weight.T, dtype=np.float32), scales,
                          unused_zeros, BLOCK, n, k, True)
    return BlockQuantized(codes, scales, None, None, 8, BLOCK, "int8")


def quantize_int4(weight: npt.NDArray[np.float32]) -> BlockQuantized:
    """4-bit blocks of fp32 [N, K] spanning each block's [min, max] with a float minimum,
    as GGUF's Q4_1: w ~ code * (max - min) / 15 + min.

    Not an integer zero point: rounding the minimum onto the code grid cost SmolLM2
    +25 % perplexity (symmetric) and +29 % (ONNX Runtime's asymmetric quantizer),
    where the float minimum keeps it within 1 % (docs/weight-modes.md).
    """
    n, k = _blocks_of(weight)
    blocks = weight.reshape(n, k // BLOCK, BLOCK)
    low, high = blocks.min(axis=-1), blocks.max(axis=-1)                            # [N,K/32]
    scales = ((high - low) / 15).astype(np.float32)
    safe = np.where(scales > 0, scales, 1).astype(np.float32)  # a constant block: all code 0
    codes = np.clip(np.rint((blocks - low[..., None]) / safe[..., None]), 0, 15)
    return BlockQuantized(pack_codes(codes.astype(np.uint8).reshape(n, k), 4, BLOCK),
                          scales, np.zeros((n, k // BLOCK), np.uint8),
                          low.astype(np.float32), 4, BLOCK, "int4")


def _blocks_of(weight: npt.NDArray[np.float32]) -> tuple[int, int]:
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"a matrix of {k} input features does not split into blocks of "
                         f"{BLOCK}")
    return n, k


def _packed_zeros(matrix: BlockQuantized) -> npt.NDArray[np.uint8] | None:
    """MatMulNBits' zero points: [N, ceil(blocks * bits / 8)], 4-bit ones two a byte."""
    if matrix.zeros is None:
        return None
    if matrix.bits == 8:
        return matrix.zeros
    n, blocks = matrix.zeros.shape
    even = np.zeros((n, blocks + blocks % 2), np.uint8)
    even[:, :blocks] = matrix.zeros
    return pack_codes(even, 4, even.shape[1]).reshape(n, -1)


def fill(template: onnx.ModelProto, matrix: Callable[[str], Matrix],
         tensor: Callable[[str], npt.NDArray[np.float32]]) -> onnx.ModelProto:
    """Put weights into `template` (modified and returned): `matrix(role_name)` for the
    weight of each linear layer, `tensor(role_name)` for every other weight (norms, biases).
    Initializers whose names have no role (constants of the export) stay as they are.

    Linear layers reading the same input in the same form (Q, K and V; gate and up)
    become one product over their stacked rows, split after: the activations are
    read and quantized once, and each output row is the same sum it was alone.
    """
    graph = template.graph
    initializers = {i.name: i for i in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    linear = {id(node): weight for node in graph.node
              if (weight := _linear_weight(node, producer, initializers)) is not None}
    # Products by input, in graph order; a group is emitted where its first member was.
    groups: dict[str, list[tuple[onnx.NodeProto, Matrix]]] = {}
    for node in graph.node:
        if id(node) in linear:
            groups.setdefault(node.input[0], []).append((node, matrix(linear[id(node)])))
    nodes: list[onnx.NodeProto] = []
    added: list[onnx.TensorProto] = []
    for node in graph.node:
        if id(node) not in linear:
            nodes.append(node)
        elif groups[node.input[0]][0][0] is node:
            for members in _fusable(groups[node.input[0]]):
                nodes += _products(node.input[0], members, added)
    used = {name for node in nodes for name in node.input}
    outputs = {o.name for o in graph.output}
    nodes = [n for n in nodes if any(out in used or out in outputs for out in n.output)]
    kept = []
    for init in graph.initializer:
        if init.name in linear.values() or init.name not in used:
            continue
        if "." in init.name:  # a role name: before.mlp.up_proj.bias, norm.weight, ...
            init = numpy_helper.from_array(np.ascontiguousarray(tensor(init.name)), init.name)
        kept.append(init)
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept + added)
    if not any(o.domain == _MS_DOMAIN for o in template.opset_import):
        template.opset_import.append(helper.make_opsetid(_MS_DOMAIN, 1))
    return template


def _form(weight: Matrix) -> tuple[object, ...]:
    """Matrices of one form can be stacked into one product."""
    if not isinstance(weight, BlockQuantized):
        return ("fp32", weight.shape[1])
    return (weight.bits, weight.block, weight.shape[1], weight.zeros is None,
            weight.minimums is None)


def _fusable(group: list[tuple[onnx.NodeProto, Matrix]]
             ) -> list[list[tuple[onnx.NodeProto, Matrix]]]:
    """`group` (products of one input) split into runs of one form, in order."""
    runs: dict[tuple[object, ...], list[tuple[onnx.NodeProto, Matrix]]] = {}
    for member in group:
        runs.setdefault(_form(member[1]), []).append(member)
    return list(runs.values())


def _stacked(weights: list[Matrix]) -> Matrix:
    """The matrices' rows one after another: [sum N, K]."""
    first = weights[0]
    if not isinstance(first, BlockQuantized):
        return np.concatenate(weights, axis=0)  # type: ignore[arg-type]
    blocks: list[BlockQuantized] = weights  # type: ignore[assignment]

    def rows(part: str) -> Any:
        arrays = [getattr(b, part) for b in blocks]
        return None if arrays[0] is None else np.ascontiguousarray(np.concatenate(arrays))

    return BlockQuantized(rows("codes"), rows("scales"), rows("zeros"), rows("minimums"),
                          first.bits, first.block, first.source)


def _products(x: str, members: list[tuple[onnx.NodeProto, Matrix]],
              added: list[onnx.TensorProto]) -> list[onnx.NodeProto]:
    """Nodes computing each member's output from x: one product, split if several."""
    if len(members) == 1:
        node, weight = members[0]
        return _product(x, node.output[0], f"{node.output[0]}.w", weight, added)
    fused = "+".join(node.output[0] for node, _ in members)
    sizes = [weight.shape[0] for _, weight in members]
    added.append(numpy_helper.from_array(np.array(sizes, np.int64), f"{fused}.sizes"))
    return [*_product(x, fused, f"{fused}.w", _stacked([w for _, w in members]), added),
            helper.make_node("Split", [fused, f"{fused}.sizes"],
                             [node.output[0] for node, _ in members], axis=-1)]


def _linear_weight(node: onnx.NodeProto, producer: dict[str, onnx.NodeProto],
                   initializers: dict[str, onnx.TensorProto]) -> str | None:
    """The weight initializer of a linear layer's product node, or None for other nodes."""
    if node.op_type == "MatMul" and len(node.input) == 2:
        source = producer.get(node.input[1])
        if (source is not None and source.op_type == "Transpose"
                and source.input[0] in initializers):
            return str(source.input[0])
    if node.op_type == "Gemm" and len(node.input) == 2 and node.input[1] in initializers:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if (attrs.get("transB") == 1 and not attrs.get("transA")
                and attrs.get("alpha", 1.0) == 1.0):
            return str(node.input[1])
    return None


def _product(x: str, y: str, name: str, weight: Matrix,
             added: list[onnx.TensorProto]) -> list[onnx.NodeProto]:
    """Nodes computing y = x W^T, with the initializers they need appended to `added`."""
    if not isinstance(weight, BlockQuantized):
        added.append(numpy_helper.from_array(np.ascontiguousarray(weight.T), f"{name}.T"))
        return [helper.make_node("MatMul", [x, f"{name}.T"], [y])]
    n, k = weight.shape
    inputs = [x, f"{name}.codes", f"{name}.scales"]
    added += [numpy_helper.from_array(weight.codes, f"{name}.codes"),
              numpy_helper.from_array(weight.scales.reshape(-1), f"{name}.scales")]
    zeros = _packed_zeros(weight)
    if zeros is not None:
        inputs.append(f"{name}.zeros")
        added.append(numpy_helper.from_array(zeros, f"{name}.zeros"))
    attrs: dict[str, Any] = {"K": k, "N": n, "bits": weight.bits, "block_size": weight.block,
                             "accuracy_level": accuracy_level()}
    if weight.minimums is None:
        return [helper.make_node("MatMulNBits", inputs, [y], domain=_MS_DOMAIN, **attrs)]
    # The minimum's share: each block's sum of x [M, K/block] times minimum^T [K/block, N],
    # added to [1, M, N] (a part's rows) or [M, N] (the head's) alike by broadcasting.
    blocks = k // weight.block
    added += [numpy_helper.from_array(np.array([-1, blocks, weight.block]), f"{name}.blocks"),
              numpy_helper.from_array(np.array([2]), f"{name}.axis"),
              numpy_helper.from_array(np.ascontiguousarray(weight.minimums.T),
                                      f"{name}.minimums")]
    return [
        helper.make_node("MatMulNBits", inputs, [f"{y}.coded"], domain=_MS_DOMAIN, **attrs),
        helper.make_node("Reshape", [x, f"{name}.blocks"], [f"{y}.in_blocks"]),
        helper.make_node("ReduceSum", [f"{y}.in_blocks", f"{name}.axis"], [f"{y}.block_sums"],
                         keepdims=0),
        helper.make_node("MatMul", [f"{y}.block_sums", f"{name}.minimums"], [f"{y}.offset"]),
        helper.make_node("Add", [f"{y}.coded", f"{y}.offset"], [y]),
    ]
