"""The per-request KV cache: history in order, per layer, with honest byte counts."""

from __future__ import annotations

import torch

from node_agent.kv_cache import KVCache


def test_update_returns_the_whole_history_per_layer() -> None:
    cache = KVCache()
    k1, v1 = torch.randn(1, 3, 4, 8), torch.randn(1, 3, 4, 8)
    k2, v2 = torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)
    cache.update(k1, v1, layer_idx=10)
    keys, values = cache.update(k2, v2, layer_idx=10)
    assert torch.equal(keys, torch.cat([k1, k2], dim=2))
    assert torch.equal(values, torch.cat([v1, v2], dim=2))
    assert keys.is_contiguous()
    other, _ = cache.update(k2, v2, layer_idx=11)  # another layer starts its own history
    assert torch.equal(other, k2)
    assert cache.get_seq_length() == 5


def test_nbytes_counts_what_is_held() -> None:
    cache = KVCache()
    assert cache.nbytes == 0
    for layer in (3, 4):
        for t in (7, 1, 1):
            cache.update(torch.zeros(1, 2, t, 16), torch.zeros(1, 2, t, 16), layer_idx=layer)
    held = 2 * 2 * (2 * 9 * 16 * 4)  # layers x (keys, values) x [1, 2, 9, 16] fp32
    assert cache.nbytes == held
