"""The ONNX Runtime engine: a stage's weights in ONNX Runtime's kernels, attention in torch.

Each layer range is cut at attention into parts (node_agent/engines/onnx_graphs.py);
a forward pass runs them in turn, with per-request attention between them:

    h [1, ΣT, H] ─ entry ─> q, k, v ─ attention ─> attn ─ mid ─> h, q, k, v ─ ... ─ exit ─> h
                                       (torch, each request over its own KVCache)

so continuous batching keeps working as in the torch engine: decode rows of
requests at different positions and a prompt chunk run as one call, each
weight read once for all of them, and each request's attention is the same
SDPA call over its own history (node_agent/ragged.py).

Why a separate engine: ONNX Runtime's MatMulNBits multiplies 4- and 8-bit
block-quantized weights with int8 activations (node_agent/engines/onnx_weights.py),
and its fp32 MatMul runs from pre-packed weights; measured here (SmolLM2, one
thread, whole model, decode; docs/weight-modes.md), 31 tok/s in fp32, 72 in int8
and 72 in int4, against 22 for the torch engine in fp32.

The graphs are built once per stage and kept in the model directory under
CACHE_DIR, keyed by layer range, weight mode, checkpoint and library versions;
later loads read them back in a second or two.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import numpy as np
import numpy.typing as npt
import onnx
import onnxruntime as ort
import torch
import torch.nn.functional as F
import transformers
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from edgebus.core.errors import EngineError
from edgebus.core.locks import exclusive
from node_agent.blockwise import BlockQuantized
from node_agent.checkpoint import CheckpointReader, tensor_locations
from node_agent.engines import onnx_fusion, onnx_graphs, onnx_weights
from node_agent.engines.base import StageEngine, StageSlice, module_path
from node_agent.engines.onnx_graphs import AFTER, BEFORE, HEAD, NORM, PartSpec
from node_agent.kv_cache import KVCache
from node_agent.ragged import BatchKV, Segment, causal_mask, first_key, sliding_window
from plant_config.schema import Device, WeightMode

CACHE_DIR = "edgebus-onnx"
# Written last into a stage's graph directory: its presence means complete.
MANIFEST = "manifest.json"
# Bump when the graphs written here change meaning, so cached ones are rebuilt.
GRAPH_FORMAT = 7  # 7: MatMulNBits at the CPU's accuracy_level()
MODES: tuple[WeightMode, ...] = ("fp32", "int8", "int4")
_PROVIDERS: dict[Device, list[str]] = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
}


@dataclass(frozen=True)
class _Runner:
    """One part's session and the inputs it declares (a part may not use cos/sin)."""

    session: ort.InferenceSession
    inputs: frozenset[str]
    flat_attn: bool  # takes attention output as [1, T, heads * D], not [1, T, heads, D]

    @classmethod
    def of(cls, session: ort.InferenceSession) -> _Runner:
        declared = {i.name: i.shape for i in session.get_inputs()}
        return cls(session, frozenset(declared), len(declared.get("attn", ())) == 3)

    def run(self, feeds: dict[str, npt.NDArray[np.float32]]) -> list[npt.NDArray[np.float32]]:
        out: list[npt.NDArray[np.float32]] = self.session.run(
            None, {k: v for k, v in feeds.items() if k in self.inputs})
        return out


class OnnxEngine(StageEngine):
    """Layers [first, end) of the model in `model_dir`, run by ONNX Runtime."""

    name = "onnxruntime"

    def __init__(self, model_dir: Path, first: int, end: int, *, weights: WeightMode = "fp32",
                 device: Device = "cpu", threads: int | None = None,
                 progress: bool = True) -> None:
        if weights not in MODES:
            raise EngineError(f"engine onnxruntime runs weights {', '.join(MODES)}, not "
                              f"{weights}: use `engine: torch` for {weights}")
        if device not in _PROVIDERS or _PROVIDERS[device][0] not in ort.get_available_providers():
            raise EngineError(f"ONNX Runtime here has no {device} execution provider (it has "
                              f"{', '.join(ort.get_available_providers())}): install the "
                              f"onnxruntime build for it, or set `device: cpu`")
        self.config = AutoConfig.from_pretrained(model_dir)
        self.slice = StageSlice(first, end, self.config.num_hidden_layers)
        self.weights, self.device = weights, device
        self.threads = threads or torch.get_num_threads()
        skeleton = _skeleton(self.config)
        decoder = skeleton.get_decoder()  # type: ignore[no-untyped-call]
        onnx_graphs.check_supported(self.config, decoder.layers[first])
        # Attention runs in torch, with each layer's own scaling.
        self._layers = [_Layer(i, self.config.num_attention_heads,
                               getattr(self.config, "num_key_value_heads", None)
                               or self.config.num_attention_heads,
                               float(decoder.layers[i].self_attn.scaling),
                               sliding_window(decoder.layers[i].self_attn, {}))
                        for i in range(first, end)]
        self.rotary_emb = type(decoder.rotary_emb)(config=self.config)
        parts = onnx_graphs.stage_parts(first, end, self.slice.has_head)
        graph_dir = _graphs(model_dir, skeleton, self.slice, parts, weights, progress=progress)
        options = _session_options(self.threads)
        self._parts = [_Runner.of(ort.InferenceSession(str(graph_dir / p.file_name), options,
                                                      providers=_PROVIDERS[device]))
                       for p in parts]
        self._head = self._parts.pop() if self.slice.has_head else None
        self._embedding: torch.Tensor | BlockQuantized | None = None
        if self.slice.has_embedding:
            self._embedding = _embedding(model_dir, skeleton, weights)
        self._graph_bytes = sum(f.stat().st_size for f in graph_dir.iterdir())

    @property
    def param_bytes(self) -> int:
        embedding = self._embedding
        held = (0 if embedding is None else embedding.nbytes if isinstance(
            embedding, BlockQuantized) else embedding.nelement() * embedding.element_size())
        return self._graph_bytes + held

    def describe(self) -> dict[str, str | int | float]:
        return {"engine": self.name, "weights": self.weights, "device": self.device,
                "threads": self.threads, "tuned": self.tuned, "weight_bytes": self.param_bytes}

    @torch.inference_mode()
    def step(self, xs: list[torch.Tensor], caches: list[KVCache], starts: list[int],
             logits: list[bool] | None = None) -> list[torch.Tensor | None]:
        segments = [Segment(cache, start, x.shape[1])
                    for x, cache, start in zip(xs, caches, starts, strict=True)]
        offsets = BatchKV(segments).offsets
        x = torch.cat(xs, dim=1)
        h = self._embed(x) if self.slice.has_embedding else x.float()               # [1,ΣT,H]
        positions = torch.cat([torch.arange(s.start, s.start + s.length)
                               for s in segments]).unsqueeze(0)                        # [1,ΣT]
        cos, sin = self.rotary_emb(h, positions)                                      # [1,ΣT,D]
        half = cos.shape[-1] // 2
        # Both forms of the rotary tables: a fused part takes the halves (onnx_fusion.py).
        feeds = {"h": h.numpy(), "cos": cos.numpy(), "sin": sin.numpy(),
                 onnx_fusion.COS_HALF: cos[0, :, :half].contiguous().numpy(),
                 onnx_fusion.SIN_HALF: sin[0, :, :half].contiguous().numpy(),
                 onnx_fusion.POSITIONS: torch.arange(positions.shape[1]).unsqueeze(0).numpy()}
        q, k, v = self._parts[0].run(feeds)
        for layer, part in zip(self._layers, self._parts[1:], strict=True):
            out = self._attend(layer, q, k, v, segments, offsets)              # [1,Hq,ΣT,Dv]
            transposed = out.transpose(1, 2)                                      # [1,ΣT,Hq,Dv]
            feeds["attn"] = (transposed.reshape(1, out.shape[2], -1) if part.flat_attn
                             else transposed.contiguous()).numpy()
            results = part.run(feeds)
            feeds["h"] = results[0]
            if len(results) == 4:
                q, k, v = results[1:]
        hidden = torch.from_numpy(feeds["h"])                                          # [1,ΣT,H]
        ends = [o + s.length for o, s in zip(offsets, segments, strict=True)]
        if self._head is None:
            return [hidden[:, o:e] for o, e in zip(offsets, ends, strict=True)]
        wanted = logits if logits is not None else [True] * len(xs)
        rows = [i for i, want in enumerate(wanted) if want]
        answer: list[torch.Tensor | None] = [None] * len(xs)
        if rows:
            last = hidden[0, [ends[i] - 1 for i in rows]].contiguous()                # [R,H]
            scores = torch.from_numpy(self._head.run({"h": last.numpy()})[0])            # [R,V]
            for row, i in enumerate(rows):
                answer[i] = scores[row:row + 1]
        return answer

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [1, T] -> [1, T, H] fp32."""
        table = self._embedding
        if isinstance(table, BlockQuantized):
            return torch.from_numpy(table.dequantize(ids[0].numpy())).unsqueeze(0)
        assert table is not None
        return table[ids]

    def _attend(self, layer: _Layer, q: npt.NDArray[np.float32], k: npt.NDArray[np.float32],
                v: npt.NDArray[np.float32], segments: list[Segment], offsets: list[int]
                ) -> torch.Tensor:
        """Each request's new keys and values appended to its cache, and its queries
        attending over its whole history, causal within its new positions.

        q, k, v: [1, ΣT, heads * D] (a fused part) or [1, heads, ΣT, D]. Returns
        [1, Hq, ΣT, Dv].
        """
        query, key, value = (self._heads(torch.from_numpy(a), n) for a, n in (
            (q, layer.heads), (k, layer.kv_heads), (v, layer.kv_heads)))
        outs = []
        for seg, o in zip(segments, offsets, strict=True):
            keys, values = seg.cache.update(key[:, :, o:o + seg.length],
                                            value[:, :, o:o + seg.length], layer.index)
            first = first_key(seg.start, layer.window)  # keys older than every window: unread
            mask = causal_mask(seg.start, seg.length, layer.window)
            outs.append(F.scaled_dot_product_attention(
                query[:, :, o:o + seg.length], keys[:, :, first:], values[:, :, first:],
                attn_mask=mask,
                is_causal=mask is None and seg.length > 1, scale=layer.scaling,
                enable_gqa=layer.heads != layer.kv_heads))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)

    @staticmethod
    def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
        """[1, T, heads * D] -> a [1, heads, T, D] view; [1, heads, T, D] as it is."""
        if x.dim() == 4:
            return x
        return x.view(1, x.shape[1], heads, -1).transpose(1, 2)


@dataclass(frozen=True)
class _Layer:
    """What attention needs of a decoder layer whose weights live in the graphs."""

    index: int      # global layer number: the KV cache's key
    heads: int
    kv_heads: int
    scaling: float
    window: int | None  # a sliding window's width (Mistral), None for full attention


def _session_options(threads: int) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # Spinning threads wait for the next op at full power. Between two parts the
    # stage runs attention in torch, and under `edgebus up` other stages share the
    # box's cores: spinning would take their time.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3  # warnings about unused initializers are noise
    return options


# -- building the graphs ------------------------------------------------------------


def _skeleton(config: PretrainedConfig) -> PreTrainedModel:
    """The whole model on the meta device (no memory), its layers exportable by parts."""
    with torch.device("meta"):
        model: PreTrainedModel = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, attn_implementation=onnx_graphs.TAP_ATTENTION, dtype=torch.float32)
    return model


def prepare_graphs(model_dir: Path, first: int, end: int, weights: WeightMode, *,
                   progress: bool = True) -> Path:
    """Build (unless cached) the graphs of layers [first, end) in `weights`, without loading
    them: the bench prepares a plant's stages one at a time before starting its agents."""
    config = AutoConfig.from_pretrained(model_dir)
    skeleton = _skeleton(config)
    layers = StageSlice(first, end, config.num_hidden_layers)
    parts = onnx_graphs.stage_parts(first, end, layers.has_head)
    return _graphs(model_dir, skeleton, layers, parts, weights, progress=progress)


def _graphs(model_dir: Path, skeleton: PreTrainedModel, layers: StageSlice, parts: list[PartSpec],
            weights: WeightMode, *, progress: bool) -> Path:
    """The directory of this stage's graphs, built now unless cached."""
    first, end = layers.first, layers.end
    name = f"layers-{first}-{end}-{weights}"
    digest = _digest(model_dir)
    target = model_dir / CACHE_DIR / f"{name}-{digest}"
    # Graphs of these layers for an older checkpoint or library version are never read
    # again: without this, every upgrade would leave a copy of the stage's weights behind.
    for stale in (model_dir / CACHE_DIR).glob(f"{name}-*"):
        if stale != target:
            shutil.rmtree(stale, ignore_errors=True)
    if (target / MANIFEST).is_file():
        return target

    def unwritable(exc: OSError) -> EngineError:
        return EngineError(f"cannot write the ONNX graphs of this stage under {target.parent} "
                           f"({exc.strerror}): make the model directory writable for the "
                           "agent's user, at least once, for the first load")

    # Agents on one box that load the same layers (a stage and its standby, test workers)
    # take turns: the second finds the first's graphs instead of exporting them again.
    with ExitStack() as held:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            held.enter_context(exclusive(target.parent / f".{name}.lock"))
        except OSError as exc:
            raise unwritable(exc) from exc
        if (target / MANIFEST).is_file():
            return target
        staging = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
        try:
            staging.mkdir()
        except OSError as exc:
            raise unwritable(exc) from exc
        try:
            built = [d for d in (model_dir / CACHE_DIR).glob(f"layers-*-{weights}-{digest}")
                     if (d / MANIFEST).is_file()]
            with tqdm(parts, desc=f"ONNX graphs of layers [{first}, {end}) in {weights}",
                      unit="graph", disable=not progress) as bar:
                _build(model_dir, skeleton, bar, weights, staging, built)
            (staging / MANIFEST).write_text(json.dumps(
                {"layers": [first, end], "weights": weights,
                 "parts": [p.file_name for p in parts], "key": _key(model_dir)}, indent=2) + "\n")
            os.rename(staging, target)
        except OSError:
            # An agent of an edgebus without this lock built the same stage first: use theirs.
            shutil.rmtree(staging, ignore_errors=True)
            if not (target / MANIFEST).is_file():
                raise
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


def _build(model_dir: Path, skeleton: PreTrainedModel, parts: Iterable[PartSpec],
           weights: WeightMode, out: Path, built: Sequence[Path]) -> None:
    """Each part's graph written in `out`, or linked from one of the `built` stages of the
    same checkpoint and mode that has it: a part's graph is its layers' alone."""
    decoder = skeleton.get_decoder()  # type: ignore[no-untyped-call]
    prefix = module_path(skeleton, decoder)
    head = skeleton.get_output_embeddings()  # type: ignore[no-untyped-call]
    tied = getattr(skeleton.config, "tie_word_embeddings", False)
    config = skeleton.config
    exporter = onnx_graphs.TemplateExporter(config, decoder.layers, decoder.norm, head)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    with CheckpointReader(model_dir, skeleton) as checkpoint:
        for part in parts:
            if _link_built(part.file_name, built, out):
                continue
            roles = {BEFORE: f"{prefix}.layers.{part.before}.",
                     AFTER: f"{prefix}.layers.{part.after}.",
                     NORM: f"{prefix}.norm.",
                     HEAD: f"{module_path(skeleton, head)}."}

            def name_of(role_name: str, roles: dict[str, str] = roles) -> str:
                role, _, rest = role_name.partition(".")
                name = roles[role] + rest
                if role == HEAD and name not in checkpoint and tied:
                    name = f"{prefix}.embed_tokens.{rest}"
                return name

            def matrix(role_name: str) -> onnx_weights.Matrix:
                name = name_of(role_name)
                return onnx_weights.matrix_in_mode(_read_matrix(checkpoint, name), weights,
                                                   edge=role_name.startswith(HEAD))

            def tensor(role_name: str) -> npt.NDArray[np.float32]:
                name = name_of(role_name)
                return checkpoint.load([name], torch.float32)[name].numpy()

            graph = onnx_fusion.fuse(onnx_weights.fill(exporter.template(part), matrix, tensor),
                                     heads=config.num_attention_heads, kv_heads=kv_heads,
                                     head_dim=head_dim)
            onnx.save(graph, str(out / part.file_name), save_as_external_data=True,
                      location=f"{part.file_name}.data", size_threshold=1024)


def _read_matrix(checkpoint: CheckpointReader, name: str) -> onnx_weights.Matrix:
    blocks = checkpoint.blocks(name)
    if blocks is not None:
        return blocks
    return checkpoint.load([name], torch.float32)[name].numpy()


def _embedding(model_dir: Path, skeleton: PreTrainedModel, weights: WeightMode
               ) -> torch.Tensor | BlockQuantized:
    """The token embedding in the stage's mode: fp32, or 8-bit blocks looked up row by row."""
    decoder = skeleton.get_decoder()  # type: ignore[no-untyped-call]
    name = f"{module_path(skeleton, decoder)}.embed_tokens.weight"
    with CheckpointReader(model_dir, skeleton) as checkpoint:
        table = onnx_weights.matrix_in_mode(_read_matrix(checkpoint, name), weights, edge=True)
    return table if isinstance(table, BlockQuantized) else torch.from_numpy(table)


def _link_built(file_name: str, built: Sequence[Path], out: Path) -> bool:
    """Whether a built stage's graph `file_name` (and its weights file) is now linked into
    `out`. Hard links: no copy and no second disk share, for the graphs one host builds for
    several stages (the whole model beside its three stages shares 30 of its 32 parts)."""
    for stage in built:
        graph = stage / file_name
        if not graph.is_file():
            continue
        files = [graph, *filter(Path.is_file, [stage / f"{file_name}.data"])]
        try:
            for source in files:
                os.link(source, out / source.name)
        except OSError:  # a file system without hard links: build it
            for source in files:
                (out / source.name).unlink(missing_ok=True)
            return False
        return True
    return False


def _key(model_dir: Path) -> dict[str, object]:
    """What the graphs depend on besides layers and mode: checkpoint files and libraries."""
    files = sorted({*tensor_locations(model_dir).values(), model_dir / "config.json"})
    return {"format": GRAPH_FORMAT,
            "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files],
            "torch": torch.__version__, "transformers": transformers.__version__,
            "onnx": onnx.__version__, "onnxruntime": version("onnxruntime")}


def _digest(model_dir: Path) -> str:
    return hashlib.sha256(json.dumps(_key(model_dir), sort_keys=True).encode()).hexdigest()[:12]
