"""Per-request key/value cache for the layers one stage owns.

HF attention modules call `cache.update(k, v, layer_idx, ...)` and attend over
what it returns, so this class is all a stage needs to give them memory. It
keeps only the layers this stage owns, indexed by their *global* layer number
(that is what `self_attn.layer_idx` holds).

What a layer hands `update` is its business: keys and values
[b, kv_heads, t, head_dim] for Llama-shaped attention; for multi-head latent
attention (DeepSeek-V2/V3) the compressed latent [b, 1, t, kv_lora_rank] and
the rotary key [b, 1, t, qk_rope_head_dim], expanded into per-head keys and
values only after the cache (a quarter of the expanded form's bytes in the tiny
test model, 1/71 in DeepSeek-V3's shapes). Both grow along positions, dim 2.

Each layer's keys and values live in a buffer with room to spare, grown
GROW_POSITIONS at a time; `update` writes the new positions into it and
returns a view of the positions held. Concatenating instead (as HF's
DynamicCache does) copies the whole history on every token: 13 % of a
batch-8 decode step here, and the heap churn of freeing each old copy.
SDPA gives bit-identical results on the view and on a contiguous copy
(checked for the shapes used here), so attention sums exactly what it sums
under `generate`.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from node_agent.model_config import KV_ITEM_BYTES, kv_bytes_per_token

__all__ = ["GROW_POSITIONS", "KV_ITEM_BYTES", "KVCache", "kv_bytes_per_token"]

# Positions a cache's buffers grow by. Per request and stage, at most this
# many positions' worth (63 x 15 KiB for 10 SmolLM2 layers: ~1 MiB) is spare.
GROW_POSITIONS = 64


class KVCache:
    """Keys and values of one request's route `epoch`, for one stage's layers."""

    def __init__(self, epoch: int = 0) -> None:
        self.epoch = epoch
        # When a forward pass last used it (time.monotonic()): an idle cache
        # belongs to a request its coordinator abandoned.
        self.touched = time.monotonic()
        # layer_idx -> [batch, kv_heads, capacity, head_dim] (or MLA's latents, see above)
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        self._held: dict[int, int] = {}  # layer_idx -> positions filled
        # Bytes of the positions held (not the spare room), kept as a plain int
        # so another thread can read it safely.
        self.nbytes = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `key_states`/`value_states` ([b, h, t, d]) and return all keys/values so far."""
        self.nbytes += (key_states.nelement() * key_states.element_size()
                        + value_states.nelement() * value_states.element_size())
        held = self._held.get(layer_idx, 0)
        end = held + key_states.shape[2]
        keys, values = self._keys.get(layer_idx), self._values.get(layer_idx)
        if keys is None or values is None or end > keys.shape[2]:
            keys = self._keys[layer_idx] = _grown(keys, key_states, held, end)
            values = self._values[layer_idx] = _grown(values, value_states, held, end)
        keys[:, :, held:end] = key_states
        values[:, :, held:end] = value_states
        self._held[layer_idx] = end
        return keys[:, :, :end], values[:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Token positions cached so far (the same for every layer between steps)."""
        return max(self._held.values(), default=0)

    def truncate(self, positions: int) -> None:
        """Keep the first `positions`: the next update writes where the dropped ones were,
        so a position computed again is computed over the same buffer as the first time."""
        held = self.get_seq_length()
        if positions >= held:
            return
        self.nbytes = self.nbytes * positions // held
        for layer, filled in self._held.items():
            self._held[layer] = min(filled, positions)


def _grown(old: torch.Tensor | None, like: torch.Tensor, held: int, end: int) -> torch.Tensor:
    """A buffer shaped like `like` with room for `end` positions, holding old's first `held`."""
    shape = list(like.shape)
    shape[2] = -(-end // GROW_POSITIONS) * GROW_POSITIONS
    buffer = like.new_empty(shape)
    if old is not None:
        buffer[:, :, :held] = old[:, :, :held]
    return buffer
