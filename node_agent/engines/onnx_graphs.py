"""A stage's layers as ONNX graphs cut at attention, exported by torch.onnx from transformers' code.

Attention is where continuous batching needs per-request state: each
request's queries attend over its own keys and values, at its own position
(node_agent/ragged.py). Everything else in a decoder layer (norms, the
Q/K/V/O projections, rotary embedding, the MLP: all the weights) treats the
packed positions [1, sum(T), H] as independent rows. So a stage's layers
are cut at every attention into *parts*, and the ONNX Runtime engine runs
the parts in ONNX Runtime and attention in torch between them:

    entry   : the pre-attention half of layer a          h -> q, k, v
    mid (i) : the post-attention half of layer i-1, then  (h, attn) -> h, q, k, v
              the pre-attention half of layer i
    exit    : the post-attention half of layer b-1        (h, attn) -> h
    head    : final norm + LM head, on the rows to sample [R, H] -> [R, V]

The parts are not written by hand: transformers' own decoder layer is
exported with an attention function that, while tracing, either hands out
the layer's query, key and value (`_Tap.capture`) or returns the attention
output given as a graph input (`_Tap.inject`), and with a cache that stores
nothing. What a layer computes around attention (Llama, Qwen2's biases,
Mistral...) comes out as that family's code computes it.

Exporting takes seconds a graph, so each distinct layer structure is
exported once, as a *template* whose weights are named by role
(`before.mlp.up_proj.weight`), and every layer's part is the template with
that layer's weights put in (`node_agent/engines/onnx_weights.py`). Only
middle parts (and the head) are exported: an entry or exit part is cut
from the middle part that runs its layer twice.

Shapes: T = positions in the call, H = hidden size, Hq/Hkv = query and
key/value heads, D = head size, R = rows whose logits are wanted.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import onnx
import torch
from torch import nn
from transformers import AttentionInterface, PretrainedConfig

from edgebus.core.errors import EngineError
from node_agent.engines.onnx_fusion import drop_unread

if TYPE_CHECKING:
    from torch.onnx._internal.exporter._registration import ONNXRegistry

# The attention implementation the exported layers run: see _Tap.
TAP_ATTENTION = "edgebus_tap"
# Sample positions to trace with; every length axis is exported as dynamic.
_TRACE_POSITIONS = 3
# What the exporter logs below ERROR is progress, of no use to a plant engineer.
_CHATTY_LOGGERS = ("torch.onnx", "onnx_ir")
# The middle part's input and output: the residual stream before and after it.
MID_INPUT, MID_OUTPUT = "h", "h_out"
# Roles of a template's weights, by the attribute that holds the module in _Part.
BEFORE, AFTER, NORM, HEAD = "before", "after", "norm", "head"


class _PassCache:
    """A cache that keeps nothing: the tapped layer hands this step's keys and values on."""

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return key, value


class _Tap:
    """The attention function of exported layers: capture q, k, v, or return a given output."""

    def __init__(self) -> None:
        self._inject: torch.Tensor | None = None
        self.captured: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @contextlib.contextmanager
    def inject(self, attn: torch.Tensor) -> Iterator[None]:
        self._inject = attn
        try:
            yield
        finally:
            self._inject = None

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: torch.Tensor | None,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
        """query [1, Hq, T, D], key/value [1, Hkv, T, D] -> [1, T, Hq, Dv]."""
        if self._inject is not None:
            return self._inject, None
        self.captured = (query, key, value)
        # Nothing downstream of this is exported: the capturing part returns q, k, v.
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1],
                               value.shape[-1]), None


_TAP = _Tap()
AttentionInterface.register(TAP_ATTENTION, _TAP)


class _Part(nn.Module):
    """The post-attention half of `before`, then the pre-attention half of `after`."""

    def __init__(self, before: nn.Module | None, after: nn.Module | None) -> None:
        super().__init__()
        self.before, self.after = before, after

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """h [1, T, H], cos/sin [1, T, D], attn [1, T, Hq, Dv] -> (h, q, k, v) or a subset."""
        rope, out = (cos, sin), []
        if self.before is not None:
            assert attn is not None
            with _TAP.inject(attn):
                h = self.before(h, position_embeddings=rope, cache=_PassCache())
            out.append(h)
        if self.after is not None:
            self.after(h, position_embeddings=rope, cache=_PassCache())
            assert _TAP.captured is not None
            out.extend(_TAP.captured)
        return tuple(out)


class _Head(nn.Module):
    def __init__(self, norm: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [R, H] -> [R, V]."""
        logits: torch.Tensor = self.head(self.norm(h))
        return logits


@dataclass(frozen=True)
class PartSpec:
    """One graph of a stage: which layers it takes its weights from."""

    kind: str                 # "entry", "mid", "exit" or "head"
    before: int | None        # layer whose post-attention half it runs
    after: int | None         # layer whose pre-attention half it runs

    @property
    def file_name(self) -> str:
        return f"{self.kind}-{self.before}-{self.after}.onnx"


def stage_parts(first: int, end: int, has_head: bool) -> list[PartSpec]:
    """The graphs of layers [first, end), in the order a forward pass runs them."""
    parts = [PartSpec("entry", None, first)]
    parts += [PartSpec("mid", i - 1, i) for i in range(first + 1, end)]
    parts.append(PartSpec("exit", end - 1, None))
    if has_head:
        parts.append(PartSpec("head", None, None))
    return parts


def check_supported(config: PretrainedConfig, layer: nn.Module) -> None:
    """Refuse, saying what to do, a model whose attention this engine cannot cut at."""
    attention = getattr(layer, "self_attn", None)
    if getattr(config, "kv_lora_rank", None) or hasattr(attention, "expand_kv"):
        raise EngineError(
            f"{config.model_type} uses multi-head latent attention, whose cache holds latents "
            "that a stage expands after the cache: engine onnxruntime does not run it yet; use "
            "`engine: torch` for this model")
    if attention is None or not hasattr(attention, "layer_idx"):
        raise EngineError(f"{type(layer).__name__} has no `self_attn` module with a layer "
                          "index: engine onnxruntime cannot cut it at attention; use "
                          "`engine: torch`")


# Templates exported in this process, middle parts and heads by module structure:
# stages of one model (and tests loading many) share them.
_TEMPLATES: dict[str, onnx.ModelProto] = {}


class TemplateExporter:
    """Exports each distinct part structure once and hands out copies (weights by role)."""

    def __init__(self, config: PretrainedConfig, layers: nn.ModuleList,
                 norm: nn.Module | None, head: nn.Module | None) -> None:
        self.config, self.layers, self.norm, self.head = config, layers, norm, head

    def template(self, part: PartSpec) -> onnx.ModelProto:
        """The graph of `part`, with weights named by role (BEFORE, AFTER, NORM, HEAD)."""
        if part.kind == "head":
            # A module's repr names its classes and every shape.
            key = f"head|{self.norm!r}|{self.head!r}"
            if key not in _TEMPLATES:
                _TEMPLATES[key] = _weightless(self._export_head())
            return _copy(_TEMPLATES[key])
        before = None if part.before is None else self.layers[part.before]
        after = None if part.after is None else self.layers[part.after]
        # An entry part is the pre-attention half of its layer and an exit part the
        # post-attention half, node for node as a middle part runs them: both are cut from
        # the middle part of their layer twice. A model whose layers are alike is exported
        # as that one part and its head, not as four parts (an export costs seconds).
        first, second = before or after, after or before
        assert first is not None and second is not None
        key = f"mid|{first!r}|{second!r}"
        if key not in _TEMPLATES:
            _TEMPLATES[key] = _weightless(self._export_mid(first, second))
        if part.kind == "entry":
            return _cut(_TEMPLATES[key], ["q", "k", "v"], start=MID_OUTPUT)
        if part.kind == "exit":
            return _cut(_TEMPLATES[key], [MID_OUTPUT])
        return _copy(_TEMPLATES[key])

    def _export_head(self) -> onnx.ModelProto:
        assert self.norm is not None and self.head is not None
        return _torch_export(_Head(_real(self.norm), _real(self.head)),
                             (torch.zeros(_TRACE_POSITIONS, self.config.hidden_size),),
                             ["h"], ["logits"], {"h": {0: "rows"}})

    def _export_mid(self, before: nn.Module, after: nn.Module) -> onnx.ModelProto:
        cfg = self.config
        heads: int = cfg.num_attention_heads
        head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        t = _TRACE_POSITIONS
        # Distinct tensors: export would trace one tensor passed twice as one input.
        args = (torch.zeros(1, t, cfg.hidden_size), torch.zeros(1, t, head_dim),
                torch.zeros(1, t, head_dim), torch.zeros(1, t, heads, head_dim))
        names = [MID_INPUT, "cos", "sin", "attn"]
        return _torch_export(_Part(_real(before), _real(after)), args, names,
                             [MID_OUTPUT, "q", "k", "v"],
                             {name: {1: "positions"} for name in names})


def _weightless(template: onnx.ModelProto) -> onnx.ModelProto:
    """`template` without the values of its weights (those named by role): every part puts
    its own in (onnx_weights.fill), and each part's copy of the export's uninitialised
    storage cost a copy of two layers' weights (28 MB a part on SmolLM2)."""
    for init in template.graph.initializer:
        if "." in init.name:
            init.ClearField("raw_data")
    return template


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    graph = onnx.ModelProto()
    graph.CopyFrom(model)
    return graph


def _cut(mid: onnx.ModelProto, outputs: list[str], start: str | None = None) -> onnx.ModelProto:
    """The nodes of the middle part `mid` that compute `outputs`; from the value `start`,
    which becomes the input MID_INPUT, if given (the pre-attention half).

    The middle part's input is read by the pre-attention half only for its length, the
    positions a call runs (torch.export takes every "positions" size from the first input
    that has it): `start` has the same shape, so such a read stays, of the new input.
    """
    cut = _copy(mid)
    graph = cut.graph
    needed, kept = set(outputs), []
    for node in reversed(graph.node):
        if any(out in needed for out in node.output):
            kept.append(node)
            needed.update(name for name in node.input if name and name != start)
    kept.reverse()
    if start is not None:
        if any(node.op_type != "Shape" for node in kept if MID_INPUT in node.input):
            raise EngineError("the pre-attention half of this model's layers reads the "
                              "layer before it: engine onnxruntime cannot cut it at "
                              "attention; use `engine: torch`")
        for node in kept:
            node.input[:] = [MID_INPUT if name == start else name for name in node.input]
    del graph.node[:]
    graph.node.extend(kept)
    drop_unread(graph)
    results = [o for o in graph.output if o.name in outputs]
    del graph.output[:]
    graph.output.extend(results)
    made = {out for node in kept for out in node.output}
    values = [v for v in graph.value_info if v.name in made]
    del graph.value_info[:]
    graph.value_info.extend(values)
    return cut


def _real(module: nn.Module) -> nn.Module:
    """A copy of a meta-device module with (uninitialised) real storage: export traces it
    without computing, and the weights it records are replaced by role afterwards."""
    return copy.deepcopy(module).to_empty(device="cpu")


def _torch_export(module: nn.Module, args: tuple[torch.Tensor, ...], inputs: list[str],
                  outputs: list[str], dynamic: dict[str, dict[int, str]]) -> onnx.ModelProto:
    """torch.onnx's dynamo export, unoptimised so weights keep their module names.

    What `torch.onnx.export(dynamo=True)` does, less two costs it pays on every call: it
    builds its registry of ATen decompositions again (~0.6 CPU-s of a 1.5 s export of a
    tiny Llama's part, 2-core EPYC), and writes the graph to a file to be read back. The
    graphs are the same, node for node (compared on the tiny Llama's and Mistral's parts).
    These are torch.onnx's internal functions: torch is pinned to one minor line
    (pyproject.toml), and test_engines.py's exports go through them.
    """
    # Imported at the first export (onnxscript's ~1.8 s): a stage whose graphs are cached
    # on disk never exports.
    from torch.onnx._constants import ONNX_DEFAULT_OPSET
    from torch.onnx._internal.exporter import _core, _dynamic_shapes

    module.eval()
    with warnings.catch_warnings(), _quiet_exporter(), torch.inference_mode(False):
        warnings.simplefilter("ignore")
        try:
            shapes, named_axes = _dynamic_shapes.convert_str_to_export_dim(dynamic)
            program = _core.export(module, args, registry=_registry(), dynamic_shapes=shapes,
                                   input_names=inputs, output_names=outputs, optimize=False,
                                   verbose=False, opset_version=ONNX_DEFAULT_OPSET)
            if named_axes:
                program._rename_dynamic_axes(dynamic)
        except Exception as exc:
            raise EngineError(f"torch.onnx cannot export this model's layers "
                              f"({type(exc).__name__}: {str(exc)[:300]}): use `engine: torch` "
                              "for it") from exc
        return program.model_proto


@functools.cache
def _registry() -> ONNXRegistry:
    """torch.onnx's decompositions, as `torch.onnx.export` builds them for its default opset."""
    from torch.onnx._constants import ONNX_DEFAULT_OPSET
    from torch.onnx._internal.exporter._registration import ONNXRegistry

    return ONNXRegistry.from_torchlib(opset_version=ONNX_DEFAULT_OPSET)


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """torch.onnx prints progress to stdout and warns that torchvision's ops are not
    registered (edgebus uses none), and the onnx_ir passes it runs log an INFO line
    per graph pass ("Removed 61 unused nodes"), which flooded `edgebus up`'s output:
    keep all of it out of an agent's journal."""
    loggers = [logging.getLogger(name) for name in _CHATTY_LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
            yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
