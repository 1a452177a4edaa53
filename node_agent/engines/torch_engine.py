"""The torch engine: one contiguous slice of a decoder-only transformer, run by PyTorch eager.

The reference engine: in fp32 it is token-exact against transformers'
`generate`, because it runs transformers' own decoder layers.

Generic over HF models shaped `model.embed_tokens / model.layers / model.norm /
lm_head` (Llama, Qwen2, Mistral, DeepSeek...): the skeleton comes from
`AutoModelForCausalLM.from_config` on the meta device (no memory), this stage
keeps its modules, and only their tensors are read from disk.

The HF decoder layers are used as they are; this file only replaces the loop
around them (`LlamaModel.forward` and friends), which is what a pipeline stage
must own: it starts from token ids or from hidden states, and hands its KV
cache to the layers itself.

Weights are read in fp32 and then converted to the stage's weight mode
(fp32, bf16 or int8: `node_agent/engines/torch_weights.py`). In fp32 the linear layers'
weights are packed for oneDNN as they are read (`node_agent/packed.py`):
a batched decode step takes 0.5-0.65x the time of plain weights.

Shapes: B = requests in a batched decode step, T = token positions in this
call, H = hidden size, V = vocabulary size.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from edgebus.core.errors import CheckpointError
from node_agent import memory, packed
from node_agent.checkpoint import CheckpointReader
from node_agent.engines.base import Kernels, StageEngine, StageSlice, module_path
from node_agent.engines.torch_weights import quantize
from node_agent.kv_cache import KVCache
from node_agent.packed import PackedLinear
from node_agent.ragged import ATTENTION_NAME, BatchKV, Segment, causal_mask
from plant_config.schema import WeightMode


class TorchEngine(nn.Module, StageEngine):
    """The modules one stage owns, with prefill and decode entry points."""

    name = "torch"

    def __init__(self, model_dir: Path, first: int, end: int,
                 dtype: torch.dtype = torch.float32, weights: WeightMode = "fp32",
                 kernels: Kernels | None = None) -> None:
        super().__init__()
        config = AutoConfig.from_pretrained(model_dir)
        self.config: PretrainedConfig = config
        self.slice = StageSlice(first, end, config.num_hidden_layers)
        self.dtype, self.weights = dtype, weights
        self.kernels = kernels or Kernels(threads=torch.get_num_threads())
        with memory.loading():
            self._build(model_dir, pack=weights == "fp32" and self.kernels.packed
                        and packed.available())
            if weights != "fp32":
                # After _build has returned: the skeleton, which still referenced the
                # fp32 embedding and head, is gone, so converting frees them.
                quantize(self, weights)
        self.eval()

    def _build(self, model_dir: Path, pack: bool) -> None:
        config, dtype, first, end = self.config, self.dtype, self.slice.first, self.slice.end
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                config, attn_implementation=ATTENTION_NAME, dtype=dtype)
        decoder = skeleton.get_decoder()
        prefix = module_path(skeleton, decoder)
        head = skeleton.get_output_embeddings()

        # Each owned module, keyed by where its tensors live in the checkpoint.
        owned: dict[str, nn.Module] = {
            f"{prefix}.layers.{i}.": decoder.layers[i] for i in range(first, end)}
        self.embed_tokens: nn.Module | None = None
        self.norm: nn.Module | None = None
        self.lm_head: nn.Module | None = None
        if self.slice.has_embedding:
            self.embed_tokens = owned[f"{prefix}.embed_tokens."] = decoder.embed_tokens
        if self.slice.has_head:
            self.norm = owned[f"{prefix}.norm."] = decoder.norm
            self.lm_head = owned[f"{module_path(skeleton, head)}."] = head
        self.layers = nn.ModuleList([decoder.layers[i] for i in range(first, end)])
        # Rotary frequencies are a buffer computed at init, not stored in the
        # checkpoint: build this module for real so they come out right.
        self.rotary_emb = type(decoder.rotary_emb)(config=config)

        with CheckpointReader(model_dir, skeleton) as checkpoint:
            self._load(checkpoint, owned, tied_head_key=f"{prefix}.embed_tokens.weight"
                       if getattr(config, "tie_word_embeddings", False) else None, pack=pack)

    def _load(self, checkpoint: CheckpointReader, owned: dict[str, nn.Module],
              tied_head_key: str | None, pack: bool) -> None:
        wanted: list[tuple[str, nn.Module, str]] = []  # (model key, module, tensor name)
        for key_prefix, module in owned.items():
            for name, _ in [*module.named_parameters(), *module.named_buffers()]:
                key = key_prefix + name
                if key not in checkpoint and tied_head_key and module is self.lm_head:
                    key = tied_head_key
                wanted.append((key, module, name))
        # Linear weights to pack instead of setting: (owner, tensor name) -> checkpoint key.
        linear = {(module, name): key for key, module, name in wanted
                  if pack and name.rpartition(".")[2] == "weight"
                  and isinstance(module.get_submodule(name.rpartition(".")[0]), nn.Linear)}
        # A tied head and embedding name one key: it is read once, set twice.
        tensors = checkpoint.load({key for key, module, name in wanted
                                   if (module, name) not in linear}, self.dtype)
        for key, module, name in wanted:
            if (module, name) not in linear:
                _set_tensor(module, name, tensors[key])
        for (module, name), key in linear.items():
            # Rows of a tied weight come from the embedding's plain copy, else from disk.
            rows = (functools.partial(_rows, tensors[key]) if key in tensors else
                    functools.partial(checkpoint.rows, key, dtype=self.dtype))
            path = name.rpartition(".")[0]
            plain: nn.Linear = module.get_submodule(path)  # type: ignore[assignment]
            packed_module = PackedLinear(rows, plain.out_features, plain.bias,
                                         self.kernels.min_rows)
            if path:
                parent, _, leaf = path.rpartition(".")
                setattr(module.get_submodule(parent), leaf, packed_module)
            else:  # the owned module is the Linear itself: the LM head
                self.lm_head = packed_module
        leftover = [n for n, t in [*self.named_parameters(), *self.named_buffers()] if t.is_meta]
        if leftover:
            raise CheckpointError(f"{checkpoint.model_dir}: no values for {leftover[:5]}: this "
                                  "model family computes tensors at init that edgebus does not "
                                  "rebuild yet")

    def describe(self) -> dict[str, str | int | float]:
        return {"engine": self.name, "weights": self.weights, "device": "cpu",
                **self.kernels.describe(), "tuned": self.tuned, "weight_bytes": self.param_bytes}

    @property
    def param_bytes(self) -> int:
        """Bytes of parameters this stage holds, in its weight mode (a tied tensor counts once,
        packed weights apart: a tied head packed beside its embedding is a second copy)."""
        unique = {p.data_ptr(): p.nelement() * p.element_size() for p in self.parameters()}
        packed_bytes = sum(m.nbytes for m in self.modules() if isinstance(m, PackedLinear))
        return sum(unique.values()) + packed_bytes

    # -- forward ---------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, x: torch.Tensor, cache: KVCache, start: int, *,
                logits: bool = True) -> torch.Tensor:
        """Run T >= 1 new positions [start, start+T) of one request: the exact
        calls an unbatched generate() step makes.

        x: [1, T] token ids on the first stage, else [1, T, H] hidden states.
        Returns [1, T, H] hidden states, or on the last stage [1, V] logits of
        the last position; with `logits=False` (a prompt chunk before the last:
        nothing to sample) it skips the head and returns the hidden states.
        """
        t = x.shape[1]
        h = self._layers(x, cache, torch.arange(start, start + t).unsqueeze(0),
                         causal_mask(start, t))
        return self._logits(h[0, -1:]) if self.lm_head is not None and logits else h

    @torch.inference_mode()
    def step(self, xs: list[torch.Tensor], caches: list[KVCache], starts: list[int],
             logits: list[bool] | None = None) -> list[torch.Tensor | None]:
        """New positions of several requests as one forward pass: decode steps at
        different positions, and prompt chunks, together (node_agent/ragged.py).

        xs[i]: [1, T_i] ids or [1, T_i, H], request i's positions [starts[i],
        starts[i] + T_i) with history caches[i]. Returns per request [1, T_i, H]
        hidden states, or on the last stage [1, V] logits of its last position
        (None where logits[i] is False).
        """
        wanted = logits if logits is not None else [True] * len(xs)
        if len(xs) == 1:
            alone = self.prefill(xs[0], caches[0], starts[0], logits=wanted[0])
            return [None if self.lm_head is not None and not wanted[0] else alone]
        batch = BatchKV([Segment(cache, start, x.shape[1])
                         for x, cache, start in zip(xs, caches, starts, strict=True)])
        positions = torch.cat([torch.arange(seg.start, seg.start + seg.length)
                               for seg in batch.segments]).unsqueeze(0)             # [1,ΣT]
        h = self._layers(torch.cat(xs, dim=1), batch, positions, None, batch_kv=batch)  # [1,ΣT,H]
        ends = [offset + seg.length for offset, seg in zip(batch.offsets, batch.segments,
                                                            strict=True)]
        if self.lm_head is None:
            return [h[:, offset:end] for offset, end in zip(batch.offsets, ends, strict=True)]
        rows = [i for i, want in enumerate(wanted) if want]
        last = self._logits(h[0, [ends[i] - 1 for i in rows]])                          # [R,V]
        out: list[torch.Tensor | None] = [None] * len(xs)
        for row, i in enumerate(rows):
            out[i] = last[row:row + 1]
        return out

    def _layers(self, x: torch.Tensor, cache: KVCache | BatchKV, positions: torch.Tensor,
                mask: torch.Tensor | None, **attention_kwargs: object) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x.to(self.dtype)  # [B,T,H]
        rope = self.rotary_emb(h, positions)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=positions, cache=cache,
                      use_cache=True, position_embeddings=rope, **attention_kwargs)
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """[R, H] last positions' hidden states -> [R, V] fp32 logits."""
        assert self.norm is not None and self.lm_head is not None
        logits: torch.Tensor = self.lm_head(self.norm(h))
        return logits.float()


def _rows(tensor: torch.Tensor, first: int, end: int) -> torch.Tensor:
    return tensor[first:end]


def _set_tensor(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    else:
        owner._buffers[leaf] = tensor
