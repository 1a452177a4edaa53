"""One forward pass over several requests' new positions, each with its own history.

Continuous batching runs the work waiting at a stage as one forward pass:
decode steps of requests at different positions, and a prompt chunk beside
them. The new positions are packed along one sequence axis, [1, T1+T2+..., H],
so the linear layers (where the weights are read, and a step on a CPU is bound
by reading weights) read each weight once for all of them, while attention
stays per request: request i's T_i queries over its own cached keys and values.
No padding, no copying KV histories into a padded block, and each request's
attention is the very kernel call an unbatched step makes.

HF attention modules call `cache.update(...)` and then the configured
attention function with the layer's kwargs; `BatchKV` stands in for the cache
and `ragged_attention` (registered as ATTENTION_NAME) finds each request's
segment, keys and values through the `batch_kv` kwarg the stage passes to its
layers.

Multi-head latent attention (DeepSeek-V2/V3) caches something else: the
compressed latent [b, 1, t, kv_lora_rank] and the shared rotary key
[b, 1, t, qk_rope_head_dim], which the module expands (`expand_kv`, through
`kv_b_proj`) into keys [b, heads, t, qk_head_dim] and values
[b, heads, t, v_head_dim] *after* `cache.update`. A request's history here is
therefore what was cached, and is expanded per request the same way, over all
of that request's positions, as an unbatched step does.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from node_agent.kv_cache import KVCache

ATTENTION_NAME = "edgebus_ragged"


@dataclass(frozen=True)
class Segment:
    """One request's new positions [start, start + length) in a packed batch."""

    cache: KVCache
    start: int
    length: int


class BatchKV:
    """The KV caches of a packed batch's requests, seen by the attention modules as one cache."""

    def __init__(self, segments: list[Segment]) -> None:
        self.segments = segments
        # Where each segment's positions sit on the packed axis.
        self.offsets = [0, *itertools.accumulate(s.length for s in segments[:-1])]
        self._current: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Append each segment's part of [1, h, sum(T), d] to its request's cache.

        Returns this step's states only: MLA modules expand them before attention,
        which then ignores them for the per-request histories.
        """
        self._current[layer_idx] = [
            seg.cache.update(key_states[:, :, o:o + seg.length],
                             value_states[:, :, o:o + seg.length], layer_idx)
            for seg, o in zip(self.segments, self.offsets, strict=True)]
        return key_states, value_states

    def history(self, layer_idx: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per request: all keys and values of `layer_idx`, this step's included."""
        return self._current[layer_idx]


def causal_mask(start: int, t: int, window: int | None = None) -> torch.Tensor | None:
    """What T queries at positions [start, start+T) may see of their keys.

    Without a window the keys are 0..start+T-1, and query i sees keys
    0..start+i. None where SDPA needs no mask: one query sees every key, and
    with nothing cached its is_causal triangle (aligned top-left) is right.
    Else [1, 1, T, start+T] bool.

    With a sliding window W (Mistral, Qwen2's sliding layers) a query at
    position p sees only keys (p - W, p], as transformers' sliding-window mask
    has it; the keys are then those from `first_key(start, window)` on, the
    older ones having left every query's window, and the mask is over them.
    """
    first = first_key(start, window)
    keys = torch.arange(first, start + t)
    queries = torch.arange(start, start + t).unsqueeze(1)
    seen = keys <= queries
    if window is not None:
        seen &= keys > queries - window
    if t == 1 and bool(seen.all()):
        return None
    if first == 0 and start == 0 and (window is None or t <= window):
        return None  # plain causal from position 0: SDPA's is_causal
    return seen[None, None]


def first_key(start: int, window: int | None) -> int:
    """The oldest key a query at `start` or later can see: 0 without a sliding window."""
    return 0 if window is None else max(0, start - window + 1)


def sliding_window(module: nn.Module, kwargs: dict[str, Any]) -> int | None:
    """The attention layer's sliding window, None for full attention.

    transformers' attention modules pass it as `sliding_window` (None on
    full-attention layers); a caller that runs the layer's pieces itself (the
    onnxruntime engine) passes no kwarg, so it is read where the module's
    own forward reads it: the module (Qwen2: per layer), else its config (Mistral).
    """
    if "sliding_window" in kwargs:
        window = kwargs["sliding_window"]
    elif hasattr(module, "sliding_window"):
        window = module.sliding_window
    else:
        window = getattr(getattr(module, "config", None), "sliding_window", None)
    return window if isinstance(window, int) and window > 0 else None


def _attend(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            start: int, window: int | None, mask: torch.Tensor | None,
            expand: Any, kwargs: dict[str, Any]) -> torch.Tensor:
    """One request's T queries over its keys and values [.., start + T, ..] -> [1, T, h, d_v].

    `mask` is the caller's, used where no window cuts the history.
    """
    t = query.shape[2]
    if window is not None and start + t > window:
        first = first_key(start, window)
        key, value = key[:, :, first:], value[:, :, first:]
        mask = causal_mask(start, t, window)
    if expand is not None:  # MLA: the cache holds latents
        key, value = expand(key, value)
    out: torch.Tensor = sdpa_attention_forward(module, query, key, value, mask, **kwargs)[0]
    return out


def ragged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None, *,
                     batch_kv: BatchKV | None = None, **kwargs: Any
                     ) -> tuple[torch.Tensor, None]:
    """SDPA, run per request when the layer is given a BatchKV.

    query: [1, heads, sum(T), d]. Returns [1, sum(T), heads, d_v] like
    sdpa_attention_forward (d_v = the value head size, which MLA makes smaller than d).
    A sliding window (see `causal_mask`) limits every query to its last keys.
    """
    window = sliding_window(module, kwargs)
    if batch_kv is None:
        # One request: key holds its whole history, this call's T positions last.
        start = key.shape[2] - query.shape[2]
        return _attend(module, query, key, value, start, window, attention_mask, None,
                       kwargs), None
    history = batch_kv.history(module.layer_idx)  # type: ignore[arg-type]
    expand = getattr(module, "expand_kv", None)
    parts = [_attend(module, query[:, :, o:o + seg.length], k, v, seg.start, window,
                     causal_mask(seg.start, seg.length), expand, kwargs)
             for seg, o, (k, v) in zip(batch_kv.segments, batch_kv.offsets, history, strict=True)]
    return torch.cat(parts, dim=1), None


AttentionInterface.register(ATTENTION_NAME, ragged_attention)
