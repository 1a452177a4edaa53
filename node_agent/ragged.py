"""Batched decode over requests whose histories differ in length.

Continuous batching runs one decode step of B requests as one forward pass:
the linear layers (where the weights are read, and a decode step on a CPU is
bound by reading weights) see a [B, 1, H] batch, while attention stays per
request, over that request's own keys and values. No padding, no copying KV
histories into a padded block, and each request's attention is the very
kernel call an unbatched step makes.

HF attention modules call `cache.update(...)` and then the configured
attention function with the layer's kwargs; `BatchKV` stands in for the cache
and `ragged_attention` (registered as ATTENTION_NAME) finds the per-request
keys and values through the `batch_kv` kwarg the stage passes to its layers.

Multi-head latent attention (DeepSeek-V2/V3) caches something else: the
compressed latent [b, 1, t, kv_lora_rank] and the shared rotary key
[b, 1, t, qk_rope_head_dim], which the module expands (`expand_kv`, through
`kv_b_proj`) into keys [b, heads, t, qk_head_dim] and values
[b, heads, t, v_head_dim] *after* `cache.update`. A request's history here is
therefore what was cached, and is expanded per request the same way, over all
of that request's positions, as an unbatched step does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from node_agent.kv_cache import KVCache

ATTENTION_NAME = "edgebus_ragged"


class BatchKV:
    """The KV caches of B requests, seen by the attention modules as one cache."""

    def __init__(self, caches: list[KVCache]) -> None:
        self.caches = caches
        self._current: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append row i ([B, h, 1, d]) to request i's cache; attention reads `history`.

        Returns this step's rows only: MLA modules expand them before attention,
        which then ignores them for the per-request histories.
        """
        self._current[layer_idx] = [
            cache.update(key_states[i:i + 1], value_states[i:i + 1], layer_idx)
            for i, cache in enumerate(self.caches)]
        return key_states, value_states

    def history(self, layer_idx: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per request: all keys and values of `layer_idx`, this step's included."""
        return self._current[layer_idx]


def ragged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None, *,
                     batch_kv: BatchKV | None = None, **kwargs: Any
                     ) -> tuple[torch.Tensor, None]:
    """SDPA, run per request when the layer is given a BatchKV.

    query: [B, heads, 1, d]. Returns [B, 1, heads, d_v] like sdpa_attention_forward
    (d_v = the value head size, which MLA makes smaller than d).
    """
    if batch_kv is None:
        out, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return out, None
    history = batch_kv.history(module.layer_idx)  # type: ignore[arg-type]
    expand = getattr(module, "expand_kv", None)  # MLA: the cache holds latents
    rows = []
    for i, (k, v) in enumerate(history):
        if expand is not None:
            k, v = expand(k, v)
        rows.append(sdpa_attention_forward(module, query[i:i + 1], k, v, None, **kwargs)[0])
    return torch.cat(rows), None


AttentionInterface.register(ATTENTION_NAME, ragged_attention)
