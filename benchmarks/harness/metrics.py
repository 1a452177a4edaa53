"""The bench's arithmetic: pure functions of timestamps and counters, so tests can check it.

Times are `time.perf_counter()` seconds taken where the client sees them: a
request's send, each piece of streamed output, the final response.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

# The percentiles every latency is reported at: the typical case and the tail.
P50 = 50.0
P99 = 99.0

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
EMBEDDING = "model.embed_tokens.weight"
FINAL_NORM_PREFIX = "model.norm."
LM_HEAD = "lm_head.weight"


@dataclass(frozen=True)
class Trace:
    """Client-side timestamps of one generation.

    `arrivals` are (index of the first token it carries, time) of each piece of
    streamed output; a piece may carry several tokens (a multi-byte character
    is held back until complete), hence the index.
    """

    sent: float
    arrivals: list[tuple[int, float]]
    done: float
    tokens: int


@dataclass(frozen=True)
class StreamStats:
    """One request at a time."""

    tok_s: float      # generated tokens / seconds from send to response, summed over requests
    ttft_s: float     # median time to first token
    itl_p50_s: float  # inter-token latency, pooled over the requests
    itl_p99_s: float


@dataclass(frozen=True)
class LoadStats:
    """Many requests in flight: throughput over the whole phase, latency per request."""

    concurrency: int
    requests: int
    tokens: int
    wall_s: float     # first send to last response
    ttft_p50_s: float
    itl_p50_s: float
    itl_p99_s: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


@dataclass(frozen=True)
class HopLatency:
    """One-way latency of a frame through the broker: half a round trip."""

    p50_s: float
    p99_s: float


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating between the closest ranks as numpy does."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile {q} is outside 0..100")
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def time_to_first_token(trace: Trace) -> float:
    """Send to the first output seen (the response itself if nothing was streamed)."""
    first = min((t for _, t in trace.arrivals), default=trace.done)
    return min(first, trace.done) - trace.sent


def inter_token_latencies(trace: Trace) -> list[float]:
    """One latency per token after the first.

    A piece carrying k tokens counts k times, each 1/k of the gap before it.
    Pieces past the last token (a final flush of held-back text) are ignored.
    """
    points = sorted((index, t) for index, t in trace.arrivals if index < trace.tokens)
    latencies: list[float] = []
    for (i0, t0), (i1, t1) in pairwise(points):
        if i1 > i0:
            latencies += [(t1 - t0) / (i1 - i0)] * (i1 - i0)
    return latencies


def stream_stats(traces: Sequence[Trace]) -> StreamStats:
    """Stats of requests sent one after another."""
    itls = [x for trace in traces for x in inter_token_latencies(trace)]
    seconds = sum(trace.done - trace.sent for trace in traces)
    return StreamStats(tok_s=sum(trace.tokens for trace in traces) / seconds,
                       ttft_s=statistics.median(time_to_first_token(t) for t in traces),
                       itl_p50_s=percentile(itls, P50), itl_p99_s=percentile(itls, P99))


def load_stats(concurrency: int, traces: Sequence[Trace]) -> LoadStats:
    """Stats of requests that overlapped: aggregate rate over the wall time they spanned."""
    itls = [x for trace in traces for x in inter_token_latencies(trace)]
    wall = max(trace.done for trace in traces) - min(trace.sent for trace in traces)
    return LoadStats(concurrency=concurrency, requests=len(traces),
                     tokens=sum(trace.tokens for trace in traces), wall_s=wall,
                     ttft_p50_s=percentile((time_to_first_token(t) for t in traces), P50),
                     itl_p50_s=percentile(itls, P50), itl_p99_s=percentile(itls, P99))


def marginal_rate(short: tuple[float, float], long: tuple[float, float]) -> float:
    """What one more unit costs: (quantity, count) of a short and a long run of one request.

    Both runs share the prompt's prefill and the release at the end, so the
    difference leaves decode steps only: bytes per decode token from (bytes,
    tokens), compute seconds per decode step from (compute_s, steps).
    """
    (q_short, n_short), (q_long, n_long) = short, long
    if n_long == n_short:
        raise ValueError("the long and the short run have the same count")
    return (q_long - q_short) / (n_long - n_short)


def hop_overhead(step_s: float, compute_per_step_s: Iterable[float], hops: int) -> float:
    """Time per hop a decode step spends outside the stages' forward passes."""
    return (step_s - sum(compute_per_step_s)) / hops


def counter_delta(before: Mapping[str, float], after: Mapping[str, float], key: str) -> float:
    """How much a cumulative counter of an agent's status metrics grew."""
    return after[key] - before[key]


def param_bytes_by_stage(tensor_bytes: Mapping[str, int],
                         layers: Sequence[tuple[int, int]]) -> list[int]:
    """Bytes of the checkpoint tensors each stage holds: its layers, the embedding on the
    first, the final norm and the LM head on the last (the embedding again if the head is tied,
    counted once when one stage holds both)."""
    owned: list[set[str]] = [set() for _ in layers]
    last = len(layers) - 1
    for name in tensor_bytes:
        if (found := _LAYER.match(name)) is not None:
            layer = int(found.group(1))
            owned[next(i for i, (a, b) in enumerate(layers) if a <= layer < b)].add(name)
        elif name == EMBEDDING:
            owned[0].add(name)
        elif name.startswith(FINAL_NORM_PREFIX) or name == LM_HEAD:
            owned[last].add(name)
    if LM_HEAD not in tensor_bytes:
        owned[last].add(EMBEDDING)  # tied: the head is the embedding matrix
    return [sum(tensor_bytes[name] for name in names) for names in owned]
