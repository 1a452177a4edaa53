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
weights are kept column-major: the same [out, in] tensors, laid out as their
transposes, because then `F.linear` hands MKL a matrix it need not transpose.
Measured here on one thread, a decode step of the whole SmolLM2-135M took
45 ms instead of 54 (the 49152x576 head alone 4.9 instead of 11.2 ms).
The sums come out in another order, like a batched step's do (see the
exactness notes in docs/architecture.md).

Shapes: B = requests in a batched decode step, T = token positions in this
call, H = hidden size, V = vocabulary size.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from edgebus.errors import CheckpointError
from node_agent.checkpoint import CheckpointReader
from node_agent.kv_cache import KVCache
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
        self._build(model_dir, column_major=weights == "fp32")
        if weights != "fp32":
            # After _build has returned: the skeleton, which still referenced the
            # fp32 embedding and head, is gone, so converting frees them.
            quantize(self, weights)
            return_freed_memory()
        self.eval()

    def _build(self, model_dir: Path, column_major: bool) -> None:
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

        self._load(CheckpointReader(model_dir, skeleton), owned,
                   tied_head_key=f"{prefix}.embed_tokens.weight"
                   if getattr(config, "tie_word_embeddings", False) else None,
                   column_major=column_major)

    def _load(self, checkpoint: CheckpointReader, owned: dict[str, nn.Module],
              tied_head_key: str | None, column_major: bool) -> None:
        wanted: list[tuple[str, nn.Module, str]] = []  # (model key, module, tensor name)
        for key_prefix, module in owned.items():
            for name, _ in [*module.named_parameters(), *module.named_buffers()]:
                key = key_prefix + name
                if key not in checkpoint and tied_head_key and module is self.lm_head:
                    key = tied_head_key
                wanted.append((key, module, name))
        linear = {key for key, module, name in wanted if column_major
                  and name.endswith("weight")
                  and isinstance(module.get_submodule(name.rpartition(".")[0]), nn.Linear)}
        # A tied head and embedding name one key: it is read once, set twice.
        tensors = checkpoint.load({key for key, _, _ in wanted}, self.dtype, linear)
        for key, module, name in wanted:
            _set_tensor(module, name, tensors[key])
        leftover = [n for n, t in [*self.named_parameters(), *self.named_buffers()] if t.is_meta]
        if leftover:
            raise CheckpointError(f"{checkpoint.model_dir}: no values for {leftover[:5]}: this "
                                  "model family computes tensors at init that edgebus does not "
                                  "rebuild yet")

    @property
    def param_bytes(self) -> int:
        """Bytes of parameters this stage holds, in its weight mode (a tied tensor counts once)."""
        unique = {p.data_ptr(): p.nelement() * p.element_size() for p in self.parameters()}
        return sum(unique.values())

    # -- forward ---------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, x: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """Run T >= 1 new positions [start, start+T) of one request.

        x: [1, T] token ids on the first stage, else [1, T, H] hidden states.
        Returns [1, T, H] hidden states, or [1, V] logits of the last position
        on the last stage.
        """
        t = x.shape[1]
        # SDPA's is_causal aligns the triangle top-left, which is only right when
        # nothing is cached yet; with history the mask must be spelled out.
        mask = None if start == 0 or t == 1 else _causal_mask(start, t)
        return self._run(x, cache, torch.arange(start, start + t).unsqueeze(0), mask)

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
             mask: torch.Tensor | None, **attention_kwargs: object) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x.to(self.dtype)  # [B,T,H]
        rope = self.rotary_emb(h, positions)
        for layer in self.layers:
            h = layer(h, attention_mask=mask, position_ids=positions, cache=cache,
                      use_cache=True, position_embeddings=rope, **attention_kwargs)
        if self.lm_head is None:
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


def return_freed_memory() -> None:
    """Hand freed heap pages back to the OS, so RSS shows what evicting caches freed.

    glibc keeps freed blocks for reuse: after converting weights (the fp32
    originals freed) or evicting caches, RSS would go on counting them.
    """
    libc = ctypes.util.find_library("c")
    if libc:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(libc).malloc_trim(0)


def _set_tensor(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_path, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_path) if owner_path else module
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
    else:
        owner._buffers[leaf] = tensor
