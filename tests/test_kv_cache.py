"""The per-request KV cache: history in order, per layer, with honest byte counts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from node_agent.kv_cache import GROW_POSITIONS, KVCache


def test_update_returns_the_whole_history_per_layer() -> None:
    cache = KVCache()
    k1, v1 = torch.randn(1, 3, 4, 8), torch.randn(1, 3, 4, 8)
    k2, v2 = torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)
    cache.update(k1, v1, layer_idx=10)
    keys, values = cache.update(k2, v2, layer_idx=10)
    assert torch.equal(keys, torch.cat([k1, k2], dim=2))
    assert torch.equal(values, torch.cat([v1, v2], dim=2))
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


def test_history_survives_growing_past_the_spare_room() -> None:
    cache = KVCache()
    chunks = [torch.randn(1, 2, t, 8) for t in (GROW_POSITIONS - 1, 1, 1, GROW_POSITIONS + 5, 1)]
    for chunk in chunks:
        keys, values = cache.update(chunk, -chunk, layer_idx=0)
    assert torch.equal(keys, torch.cat(chunks, dim=2))
    assert torch.equal(values, -torch.cat(chunks, dim=2))
    assert cache.get_seq_length() == sum(c.shape[2] for c in chunks)


def test_attention_over_the_cache_view_is_bit_identical_to_a_contiguous_history() -> None:
    """The exactness argument of the cache: SDPA sums the view as it sums a cat."""
    generator = torch.Generator().manual_seed(0)
    cache = KVCache()
    history = [torch.randn(1, 3, t, 64, generator=generator) for t in (44, 1, 1, 30)]
    for chunk in history:
        keys, values = cache.update(chunk, chunk * 0.5, layer_idx=0)
    query = torch.randn(1, 3, 1, 64, generator=generator)
    whole = torch.cat(history, dim=2)
    assert not keys.is_contiguous()  # a view into the spare-room buffer: the case in question
    assert torch.equal(F.scaled_dot_product_attention(query, keys, values),
                       F.scaled_dot_product_attention(query, whole, whole * 0.5))
