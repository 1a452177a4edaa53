"""Rewrites of an exported part into ONNX Runtime's fused operators.

A decode step of a small model is made of many small operators, and each
costs ONNX Runtime a few microseconds however little it computes: as
exported, a SmolLM2 part had ~65 nodes, and its 4 matrix products took a
third of its time (profiled, one thread). These rewrites replace what
transformers' Llama-family code exports, node for node, by the operators
ONNX Runtime's own LLM graphs use:

- RMSNorm: Pow, ReduceMean, Add, Sqrt, Reciprocal, Mul, Mul
  -> SimplifiedLayerNormalization;
- rotary embedding: Reshape, Transpose, two Slices, Neg, Concat, Mul, Mul, Add
  -> com.microsoft RotaryEmbedding on the flat [1, T, heads * D] projection,
  fed this call's cos/sin rows (`cos_half`, `sin_half`, `positions`);
- the attention input and the V output stay flat, [1, T, heads * D]: the
  engine makes the per-head views in torch, where a view costs nothing.

A pattern that does not match (another family's norm, a partial rotary) is
left as exported: slower, never wrong. Residual additions are not fused into
the norms (SkipSimplifiedLayerNormalization): a stage boundary falls between
the two, and the fused and unfused kernels need not round alike, so a split
could answer differently from one process.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import numpy.typing as npt
import onnx
from onnx import TensorProto, helper, numpy_helper

# Inputs the fused graphs take, which the engine feeds every part.
POSITIONS, COS_HALF, SIN_HALF = "positions", "cos_half", "sin_half"
_MS_DOMAIN = "com.microsoft"
# transformers' rotate_half: the second half of each head negated, then the first.
_NOT_INTERLEAVED = 0


class _Graph:
    """Lookups over a graph's nodes while it is being rewritten."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.producer = {out: node for node in graph.node for out in node.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for node in graph.node:
            for name in node.input:
                self.consumers[name].append(node)
        self.initializers = {i.name: i for i in graph.initializer}
        self.removed: set[int] = set()
        self.added: list[tuple[onnx.NodeProto, onnx.NodeProto]] = []  # (new, where)

    def const(self, name: str) -> npt.NDArray[np.generic] | None:
        """The value of `name` if it is fixed when the graph is built: an initializer, a
        Constant, or a Reshape or Cast of those (as torch.onnx exports reduction axes)."""
        if name in self.initializers:
            return numpy_helper.to_array(self.initializers[name])
        node = self.producer.get(name)
        if node is None:
            return None
        if node.op_type == "Constant":
            attr = node.attribute[0]
            if attr.name == "value":
                return numpy_helper.to_array(attr.t)
            if attr.name in ("value_float", "value_floats", "value_int", "value_ints"):
                return np.array(helper.get_attribute_value(attr))
        if node.op_type == "Reshape":
            data, shape = self.const(node.input[0]), self.const(node.input[1])
            if data is not None and shape is not None:
                return data.reshape([int(d) for d in shape.reshape(-1)])
        if node.op_type == "Cast":
            data = self.const(node.input[0])
            to = helper.get_attribute_value(node.attribute[0])
            if data is not None:
                return data.astype(helper.tensor_dtype_to_np_dtype(to))
        return None

    def only(self, name: str, op: str) -> onnx.NodeProto | None:
        """The single consumer of `name`, if it is an `op` node."""
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and users[0].op_type == op else None

    def made_by(self, name: str, op: str) -> onnx.NodeProto | None:
        node = self.producer.get(name)
        return node if node is not None and node.op_type == op else None

    def replace(self, old: list[onnx.NodeProto], new: onnx.NodeProto) -> None:
        """`new` takes the place of the last of `old` (all of which go)."""
        self.removed.update(id(n) for n in old)
        self.added.append((new, old[-1]))

    def commit(self) -> None:
        where = {id(anchor): new for new, anchor in self.added}
        nodes = []
        for node in self.graph.node:
            if id(node) in where:
                nodes.append(where[id(node)])
            if id(node) not in self.removed:
                nodes.append(node)
        del self.graph.node[:]
        self.graph.node.extend(nodes)


def fuse(model: onnx.ModelProto, *, heads: int, kv_heads: int, head_dim: int) -> onnx.ModelProto:
    """Apply every rewrite that matches (in place); returns `model`."""
    graph = model.graph
    g = _Graph(graph)
    _rms_norms(g)
    g.commit()
    g = _Graph(graph)
    for output, count in (("q", heads), ("k", kv_heads)):
        _rotary(g, output, count, head_dim)
    _flat_output(g, "v")
    _flat_input(g, "attn")
    g.commit()
    _drop_dead(graph)
    if not any(o.domain == _MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(_MS_DOMAIN, 1))
    return model


def _rms_norms(g: _Graph) -> None:
    """x * 1 / sqrt(mean(x^2) + eps) * weight -> SimplifiedLayerNormalization."""
    for power in list(g.graph.node):
        if power.op_type != "Pow" or not _is(g.const(power.input[1]), 2.0):
            continue
        x = power.input[0]
        mean = g.only(power.output[0], "ReduceMean")
        add = mean and g.only(mean.output[0], "Add")
        eps = add and g.const(add.input[1])
        sqrt = add and g.only(add.output[0], "Sqrt")
        recip = sqrt and g.only(sqrt.output[0], "Reciprocal")
        scaled = recip and g.only(recip.output[0], "Mul")
        out = scaled and g.only(scaled.output[0], "Mul")
        if not (mean and add and sqrt and recip and scaled and out) or eps is None \
                or x not in scaled.input or not _last_axis(g, mean):
            continue
        weight = next((i for i in out.input if i != scaled.output[0]), "")
        if weight not in g.initializers:
            continue
        g.replace([power, mean, add, sqrt, recip, scaled, out], helper.make_node(
            "SimplifiedLayerNormalization", [x, weight], [out.output[0]], axis=-1,
            epsilon=float(np.asarray(eps).reshape(-1)[0]), stash_type=1))


def _last_axis(g: _Graph, mean: onnx.NodeProto) -> bool:
    axes = g.const(mean.input[1]) if len(mean.input) > 1 else None
    if axes is None:
        attr = next((a for a in mean.attribute if a.name == "axes"), None)
        axes = None if attr is None else np.array(helper.get_attribute_value(attr))
    return axes is not None and np.asarray(axes).reshape(-1).tolist() == [-1]


def _is(value: npt.NDArray[np.generic] | None, expected: float) -> bool:
    return value is not None and value.size == 1 and float(value.reshape(-1)[0]) == expected


def _rotary(g: _Graph, output: str, heads: int, head_dim: int) -> None:
    """Graph output `output` = rotate_half rotary of a per-head view of a flat projection
    -> RotaryEmbedding on the flat projection, and the output stays flat."""
    add = g.made_by(output, "Add")
    if add is None:
        return
    muls = [g.made_by(i, "Mul") for i in add.input]
    if not all(muls):
        return
    plain = rotated = None
    for mul in muls:
        assert mul is not None
        if any(_unsqueezed_input(g, i) == "cos" for i in mul.input):
            plain = mul
        elif any(_unsqueezed_input(g, i) == "sin" for i in mul.input):
            rotated = mul
    if plain is None or rotated is None:
        return
    heads_view = next((g.made_by(i, "Transpose") for i in plain.input
                       if g.made_by(i, "Transpose")), None)
    shaped = heads_view and g.made_by(heads_view.input[0], "Reshape")
    halves = next((g.made_by(i, "Concat") for i in rotated.input if g.made_by(i, "Concat")),
                  None)
    if not (heads_view and shaped and halves and g.made_by(halves.input[0], "Neg")):
        return
    if list(helper.get_attribute_value(heads_view.attribute[0])) != [0, 2, 1, 3]:
        return
    g.replace([add], helper.make_node(
        "RotaryEmbedding", [shaped.input[0], POSITIONS, COS_HALF, SIN_HALF], [output],
        domain=_MS_DOMAIN, num_heads=heads, interleaved=_NOT_INTERLEAVED))
    _declare_input(g, POSITIONS, TensorProto.INT64, [1, "positions"])
    for name in (COS_HALF, SIN_HALF):
        _declare_input(g, name, TensorProto.FLOAT, ["positions", head_dim // 2])
    _unshape_output(g, output)


def _unsqueezed_input(g: _Graph, name: str) -> str | None:
    node = g.made_by(name, "Unsqueeze")
    return None if node is None else str(node.input[0])


def _flat_output(g: _Graph, output: str) -> None:
    """Graph output = Transpose(Reshape(flat)) -> the flat tensor itself."""
    heads_view = g.made_by(output, "Transpose")
    shaped = heads_view and g.made_by(heads_view.input[0], "Reshape")
    if not (heads_view and shaped):
        return
    g.replace([heads_view], helper.make_node("Identity", [shaped.input[0]], [output]))
    _unshape_output(g, output)


def _flat_input(g: _Graph, name: str) -> None:
    """Graph input [1, T, heads, D] only reshaped to [1, T, heads * D] -> take it flat."""
    users = g.consumers.get(name, [])
    declared = next((i for i in g.graph.input if i.name == name), None)
    if declared is None or len(users) != 1 or users[0].op_type != "Reshape":
        return
    dims = declared.type.tensor_type.shape.dim
    if len(dims) != 4 or not (dims[2].dim_value and dims[3].dim_value):
        return
    width = dims[2].dim_value * dims[3].dim_value
    g.replace([users[0]], helper.make_node("Identity", [name], [users[0].output[0]]))
    declared.CopyFrom(helper.make_tensor_value_info(name, TensorProto.FLOAT,
                                                    [1, "positions", width]))


def _declare_input(g: _Graph, name: str, dtype: int, shape: list[int | str]) -> None:
    if not any(i.name == name for i in g.graph.input):
        g.graph.input.append(helper.make_tensor_value_info(name, dtype, shape))


def _unshape_output(g: _Graph, name: str) -> None:
    for out in g.graph.output:
        if out.name == name:
            out.CopyFrom(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))


def _drop_dead(graph: onnx.GraphProto) -> None:
    """Remove nodes nothing reads, and inputs and initializers nothing reads, to a fixpoint."""
    outputs = {o.name for o in graph.output}
    while True:
        used = {name for node in graph.node for name in node.input} | outputs
        live = [n for n in graph.node if any(out in used for out in n.output)]
        if len(live) == len(graph.node):
            break
        del graph.node[:]
        graph.node.extend(live)
    drop_unread(graph)


def drop_unread(graph: onnx.GraphProto) -> None:
    """Remove the inputs and initializers no node reads."""
    used = {name for node in graph.node for name in node.input}
    kept_inputs = [i for i in graph.input if i.name in used]
    del graph.input[:]
    graph.input.extend(kept_inputs)
    # Deleted in place: a rebuilt list would copy every weight of the part once more
    # (~0.6 s of SmolLM2's fp32 graphs, whose weights are 0.5 GB).
    for index in reversed(range(len(graph.initializer))):
        if graph.initializer[index].name not in used:
            del graph.initializer[index]
