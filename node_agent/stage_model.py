"""One contiguous slice of a decoder-only transformer, loaded and run on its own.

Generic over HF models shaped `model.embed_tokens / model.layers / model.norm /
lm_head` (Llama, Qwen2, Mistral, DeepSeek...): the skeleton comes from
`AutoModelForCausalLM.from_config` on the meta device (no memory), this stage
keeps its modules, and only their tensors are read from disk.

The HF decoder layers are used as they are; this file only replaces the loop
around them (`LlamaModel.forward` and friends), which is what a pipeline stage
must own: it starts from token ids or from hidden states, and hands its KV
cache to the layers itself.

Weights are read in fp32 and then converted to the stage's weight mode
(fp32, bf16 or int8: `node_agent/quantize.py`). In fp32 the linear layers'
weights are packed for oneDNN as they are read (`node_agent/packed.py`):
a batched decode step takes 0.5-0.65x the time of plain weights.

Shapes: B = requests in a batched decode step, T = token positions in this
call, H = hidden size, V = vocabulary size.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from edgebus.errors import CheckpointError
from node_agent import memory, packed
from node_agent.checkpoint import CheckpointReader
from node_agent.kv_cache import KVCache
from node_agent.packed import PackedLinear
from node_agent.quantize import quantize
from node_agent.ragged import ATTENTION_NAME, BatchKV
from plant_config.schema import WeightMode


@dataclass(frozen=True)
class StageSlice:
    """Which part of the model a stage owns: layers [first, end)."""

    first: int
    end: int
    num_layers: int

    @property
    def has_embedding(self) -> bool:
        return self.first == 0

    @property
    def has_head(self) -> bool:
        return self.end == self.num_layers


class StageModel(nn.Module):
    """The modules one stage owns, with prefill and decode entry points."""

    def __init__(self, model_dir: Path, first: int, end: int,
                 dtype: torch.dtype = torch.float32, weights: WeightMode = "fp32") -> None:
        super().__init__()
        config = AutoConfig.from_pretrained(model_dir)
        self.config: PretrainedConfig = config
        self.slice = StageSlice(first, end, config.num_hidden_layers)
        self.dtype = dtype
        with memory.loading():
            self._build(model_dir, pack=weights == "fp32" and packed.available())
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
        prefix = _module_path(skeleton, decoder)
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
            self.lm_head = owned[f"{_module_path(skeleton, head)}."] = head
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
            packed_module = PackedLinear(rows, plain.out_features, plain.bias)
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
        """Run T >= 1 new positions [start, start+T) of one request.

        x: [1, T] token ids on the first stage, else [1, T, H] hidden states.
        Returns [1, T, H] hidden states, or on the last stage [1, V] logits of
        the last position; with `logits=False` (a prompt chunk before the last:
        nothing to sample) it skips the head and returns the hidden states.
        """
        t = x.shape[1]
        # SDPA's is_causal aligns the triangle top-left, which is only right when
        # nothing is cached yet; with history the mask must be spelled out.
        mask = None if start == 0 or t == 1 else _causal_mask(start, t)
        return self._run(x, cache, torch.arange(start, start + t).unsqueeze(0), mask,
                         head=logits)

    @torch.inference_mode()
    def decode(self, x: torch.Tensor, caches: list[KVCache], positions: list[int]
               ) -> torch.Tensor:
        """One new position for each of B requests, batched.

        x: [B, 1] ids or [B, 1, H]; request i is at `positions[i]` with history
        `caches[i]`. Returns [B, 1, H] hidden states, or [B, V] logits.
        """
        pos = torch.tensor(positions).unsqueeze(1)                                     # [B,1]
        if len(caches) == 1:  # the exact call an unbatched generate() step makes
            return self._run(x, caches[0], pos, None)
        batch = BatchKV(caches)
        return self._run(x, batch, pos, None, batch_kv=batch)

    def _run(self, x: torch.Tensor, cache: KVCache | BatchKV, positions: torch.Tensor,
             mask: torch.Tensor | None, head: bool = True, **attention_kwargs: object
             ) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x.to(self.dtype)  # [B,T,H]
        rope = self.rotary_emb(h, positions)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=positions, cache=cache,
                      use_cache=True, position_embeddings=rope, **attention_kwargs)
        if self.lm_head is None or not head:
            return h
        assert self.norm is not None
        logits: torch.Tensor = self.lm_head(self.norm(h[:, -1:]))[:, -1]               # [B,V]
        return logits.float()


def _causal_mask(start: int, t: int) -> torch.Tensor:
    """[1, 1, T, start+T] bool: query i (at position start+i) sees keys 0..start+i."""
    keys = torch.arange(start + t)
    queries = torch.arange(start, start + t).unsqueeze(1)
    return (keys <= queries)[None, None]


def _module_path(root: nn.Module, target: nn.Module) -> str:
    for name, module in root.named_modules():
        if module is target:
            return str(name)
    raise CheckpointError(f"{type(target).__name__} is not part of {type(root).__name__}")


def _rows(tensor: torch.Tensor, first: int, end: int) -> torch.Tensor:
    return tensor[first:end]


def _set_tensor(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    else:
        owner._buffers[leaf] = tensor
