"""Per-request key/value cache for the layers one stage owns.

HF attention modules call `cache.update(k, v, layer_idx, ...)` and attend over
what it returns, so this class is all a stage needs to give them memory. It
keeps only the layers this stage owns, indexed by their *global* layer number
(that is what `self_attn.layer_idx` holds).

Storage grows by doubling so a decode step costs an in-place write, not a
re-allocation of the whole history (torch.cat would copy O(n) every token).
"""

from __future__ import annotations

from typing import Any

import torch

# First allocation, in token positions. Small enough that a short request in a
# 30-layer model costs little; doubling reaches 4096 in five steps.
INITIAL_CAPACITY = 128


class KVCache:
    """Keys and values of one request, for one stage's layers."""

    def __init__(self) -> None:
        # layer_idx -> [batch, kv_heads, capacity, head_dim]
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        self._length: dict[int, int] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `key_states`/`value_states` ([b, h, t, d]) and return all keys/values so far."""
        start = self._length.get(layer_idx, 0)
        end = start + key_states.shape[2]
        keys = self._reserve(self._keys, layer_idx, key_states, end)
        values = self._reserve(self._values, layer_idx, value_states, end)
        keys[:, :, start:end] = key_states
        values[:, :, start:end] = value_states
        self._length[layer_idx] = end
        return keys[:, :, :end], values[:, :, :end]

    @staticmethod
    def _reserve(store: dict[int, torch.Tensor], layer_idx: int, like: torch.Tensor,
                 needed: int) -> torch.Tensor:
        buf = store.get(layer_idx)
        if buf is not None and buf.shape[2] >= needed:
            return buf
        capacity = INITIAL_CAPACITY if buf is None else buf.shape[2]
        while capacity < needed:
            capacity *= 2
        grown = like.new_empty((*like.shape[:2], capacity, like.shape[3]))
        if buf is not None:
            grown[:, :, : buf.shape[2]] = buf
        store[layer_idx] = grown
        return grown

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Token positions cached so far (the same for every layer between steps)."""
        return max(self._length.values(), default=0)

    @property
    def nbytes(self) -> int:
        """Bytes held, counting reserved capacity: that is what the box pays."""
        return sum(t.nelement() * t.element_size()
                   for store in (self._keys, self._values) for t in store.values())
