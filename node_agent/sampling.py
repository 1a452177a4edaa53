"""Choosing the next token: what the last stage sends back, and how the coordinator picks.

Pure functions, no state: the same inputs and the same RNG give the same token,
which is what makes a seeded request reproducible (and replayable after a
failover).

The last stage sends only the top-k (id, logit) pairs, not V logits: 49152
fp32 logits are 192 KiB per token, 64 candidates are 512 bytes. Sampling with
top_k = 0 therefore draws from the `candidates` most likely tokens (plant
setting, default 64); the probability mass beyond them is negligible for a
trained model and excluding it is what top-k sampling does anyway.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


def top_candidates(logits: npt.NDArray[np.float32], k: int
                   ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float32]]:
    """[1, V] logits -> ([1, k] ids, [1, k] logits), most likely first, in numpy (a
    llama.cpp box has no torch).

    k = 1 uses argmax, so greedy ties resolve to the lowest id exactly as
    `generate(do_sample=False)` does. For k > 1, equal logits are ordered by id,
    lowest first (torch.topk, used before, left their order unspecified).
    """
    if k == 1:
        ids = logits.argmax(axis=-1, keepdims=True)
        return ids, np.take_along_axis(logits, ids, -1)
    k = min(k, logits.shape[-1])
    # The k largest in any order, then sorted by (-logit, id): O(V + k log k), not V log V.
    ids = np.argpartition(-logits, k - 1, axis=-1)[..., :k]
    values = np.take_along_axis(logits, ids, -1)
    order = np.stack([np.lexsort((row_ids, -row_values))
                      for row_ids, row_values in zip(ids, values, strict=True)])
    return np.take_along_axis(ids, order, -1), np.take_along_axis(values, order, -1)


def candidates_wanted(temperature: float, top_k: int, plant_candidates: int) -> int:
    """How many candidates the coordinator asks the last stage for."""
    if temperature == 0.0:
        return 1
    return top_k if top_k > 0 else plant_candidates


def sample_token(ids: np.ndarray, logits: np.ndarray, *, temperature: float, top_k: int,
                 top_p: float, rng: np.random.Generator) -> int:
    """Pick one id from candidates sorted by descending logit ([k] each)."""
    if temperature == 0.0:
        return int(ids[0])
    n = len(ids) if top_k <= 0 else min(top_k, len(ids))
    scaled = logits[:n].astype(np.float64) / temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    cumulative = np.cumsum(probs)
    if top_p < 1.0:
        # Smallest prefix whose mass reaches top_p (always at least one token).
        keep = int(np.searchsorted(cumulative, top_p)) + 1
        cumulative = np.cumsum(probs[:keep]) / cumulative[min(keep, n) - 1]
    choice = int(np.searchsorted(cumulative, rng.random(), side="right"))
    return int(ids[min(choice, len(cumulative) - 1)])
