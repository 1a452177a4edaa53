"""Per-request key/value cache for the layers one stage owns.

HF attention modules call `cache.update(k, v, layer_idx, ...)` and attend over
what it returns, so this class is all a stage needs to give them memory. It
keeps only the layers this stage owns, indexed by their *global* layer number
(that is what `self_attn.layer_idx` holds).

Keys and values are kept contiguous and grow by concatenation, as HF's
DynamicCache does, so the attention kernels see exactly the layout they see
under `generate`: token-exactness depends on the same kernels doing the same
sums. The copy costs ~1 % of a decode step at a few hundred positions.
"""

from __future__ import annotations

from typing import Any

import torch


class KVCache:
    """Keys and values of one request, for one stage's layers."""

    def __init__(self) -> None:
        # layer_idx -> [batch, kv_heads, positions, head_dim]
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}
        # Bytes held, kept as a plain int so another thread can read it safely.
        self.nbytes = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `key_states`/`value_states` ([b, h, t, d]) and return all keys/values so far."""
        self.nbytes += (key_states.nelement() * key_states.element_size()
                        + value_states.nelement() * value_states.element_size())
        if layer_idx in self._keys:
            key_states = torch.cat([self._keys[layer_idx], key_states], dim=2)
            value_states = torch.cat([self._values[layer_idx], value_states], dim=2)
        self._keys[layer_idx] = key_states
        self._values[layer_idx] = value_states
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Token positions cached so far (the same for every layer between steps)."""
        return max((k.shape[2] for k in self._keys.values()), default=0)
