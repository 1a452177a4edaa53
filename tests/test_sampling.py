"""Token choice: greedy is argmax, seeded sampling is reproducible and follows the distribution."""

from __future__ import annotations

import numpy as np
import torch

from node_agent.sampling import candidates_wanted, sample_token, top_candidates


def test_greedy_candidate_is_argmax_with_lowest_id_on_ties() -> None:
    logits = np.array([[0.5, 2.0, -1.0, 2.0]], dtype=np.float32)
    ids, values = top_candidates(logits, 1)
    assert ids.tolist() == [[1]]
    assert values.tolist() == [[2.0]]


def test_top_candidates_are_sorted() -> None:
    logits = np.array([[0.1, 3.0, 2.0, -5.0, 1.0]], dtype=np.float32)
    ids, values = top_candidates(logits, 3)
    assert ids.tolist() == [[1, 2, 4]]
    assert values.tolist() == [[3.0, 2.0, 1.0]]


def test_equal_logits_are_ordered_by_id() -> None:
    logits = np.array([[1.0, 2.0, 1.0, 2.0, 1.0]], dtype=np.float32)
    assert top_candidates(logits, 4)[0].tolist() == [[1, 3, 0, 2]]


def test_top_candidates_are_what_torch_topk_chose_before() -> None:
    """The numpy top-k that replaced torch.topk picks the same candidates, in the same
    order, so seeded sampling draws what it drew before (logits without ties)."""
    logits = torch.randn(1, 49152, generator=torch.Generator().manual_seed(7))
    for k in (1, 2, 40, 64, 1000):
        values, ids = torch.topk(logits, k, dim=-1)
        got_ids, got_values = top_candidates(logits.numpy(), k)
        assert got_ids.tolist() == ids.tolist()
        assert np.array_equal(got_values, values.numpy())


def test_candidates_wanted() -> None:
    assert candidates_wanted(0.0, 40, 64) == 1
    assert candidates_wanted(0.7, 0, 64) == 64
    assert candidates_wanted(0.7, 5, 64) == 5


IDS = np.array([10, 11, 12, 13])
LOGITS = np.log(np.array([0.5, 0.25, 0.15, 0.10]))


def _draws(n: int, seed: int, **kw: float) -> list[int]:
    rng = np.random.default_rng(seed)
    return [sample_token(IDS, LOGITS, rng=rng, **kw) for _ in range(n)]  # type: ignore[arg-type]


def test_temperature_zero_is_greedy() -> None:
    assert set(_draws(50, 0, temperature=0.0, top_k=0, top_p=1.0)) == {10}


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    kw = dict(temperature=1.0, top_k=0, top_p=1.0)
    assert _draws(200, 7, **kw) == _draws(200, 7, **kw)
    assert _draws(200, 7, **kw) != _draws(200, 8, **kw)


def test_sampling_follows_the_distribution() -> None:
    draws = _draws(20000, 1, temperature=1.0, top_k=0, top_p=1.0)
    freq = [draws.count(i) / len(draws) for i in IDS]
    assert np.allclose(freq, [0.5, 0.25, 0.15, 0.10], atol=0.02)


def test_top_k_and_top_p_cut_the_tail() -> None:
    assert set(_draws(3000, 2, temperature=1.0, top_k=2, top_p=1.0)) == {10, 11}
    # 0.5 + 0.25 reaches top_p = 0.7: the nucleus is the first two.
    assert set(_draws(3000, 3, temperature=1.0, top_k=0, top_p=0.7)) == {10, 11}
    assert set(_draws(500, 4, temperature=1.0, top_k=0, top_p=0.1)) == {10}


def test_low_temperature_sharpens() -> None:
    draws = _draws(2000, 5, temperature=0.2, top_k=0, top_p=1.0)
    assert draws.count(10) / len(draws) > 0.95
