"""The token loop: one admitted request's steps through the stages, and sampling.

    coordinator --TOKENS--> stage 0 --HIDDEN--> ... --> stage N-1
         ^                                                  |
         +------------------CANDIDATES----------------------+
    sample, stream delta, stop?

Every request is its own asyncio task awaiting its own futures, so many are in
flight at once and nothing serialises them. Their decode steps travel in
groups, one message per group, each a batch at every stage
(node_agent/groups.py).

A request is replayed (the tokens so far as a prefill down a route under a new
epoch, routing.py) when its route lost a node, when a stage reports that it
cannot go on with it as sent (an ERROR frame marked for replay: a frame lost,
bad, or refused at the stage's bound), or when a step's result is much later
than any step's of late (STALL_FACTOR): a decode step's frame that is lost
leaves nothing behind it for a stage to notice. Sampling state lives here, so
the output is the same as without the fault.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from edgebus.core import frames
from edgebus.core.errors import FrameVersionError, RequestError
from edgebus.core.frames import Frame, FrameLimits, Kind
from edgebus.core.messages import GenerateResponse, Timings, Usage
from node_agent.coordinator.delivery import Delivery
from node_agent.coordinator.drafting import Drafting
from node_agent.coordinator.generation import Generation, Lost
from node_agent.coordinator.routing import Routes
from node_agent.groups import Outbox
from node_agent.reporter import Reporter
from node_agent.sampling import candidates_wanted, sample_token
from node_agent.text import TextStream, decode
from plant_config import CoordinatorSpec

if TYPE_CHECKING:
    from node_agent.text import Tokenizer

# Replays one request may take because a frame of it was lost or bad. Each has
# a cause that a replay removes (a frame lost in transit); six in a row mean
# one that it does not (a stage that cannot take the request).
MAX_RECOVERIES = 6
# Wait before the second and later of those replays, doubling each time
# (0.5, 1, 2, 4, 8 s), and before every replay of a request a stage refused for
# lack of room, up to RECOVERY_BACKOFF_MAX_S: an overloaded stage gets time to
# drain. Refusals are retried until request_timeout_s has passed since the
# first of them; then the request fails as busy.
RECOVERY_BACKOFF_S = 0.5
RECOVERY_BACKOFF_MAX_S = 8.0
# A step whose result is this many times later than the slowest step of late
# counts as lost, and its request is replayed. Batching, a prompt chunk riding
# along and a busy broker make steps vary 2-3x; this leaves room for that.
STALL_FACTOR = 4.0
# ... but never before this: a loaded box or a broker hiccup holds a step up
# for a second or so, and a replay then only adds load.
STALL_MIN_S = 3.0
# How fast the memory of a slow step fades, per completed step (~half in 70).
PACE_DECAY = 0.99
# Before any step has been seen to judge by, a step counts as lost after this
# share of request_timeout_s (30 s of the default 120): a first result the
# broker dropped costs a quarter of the timeout, not all of it, and a prefill
# that is merely slow is waited for twice as long on its replay.
COLD_STALL_SHARE = 0.25
# Messages bigger than this, or holding LZ4, are decoded on a worker thread.
DECODE_INLINE_BYTES = 64 * 1024


class _Recover(Exception):
    """A stage cannot go on with the request as sent (a frame lost, bad or refused): replay."""

    def __init__(self, reason: str, *, busy: bool = False) -> None:
        super().__init__(reason)
        self.busy = busy  # refused for lack of room: replay once the stage has had time


class Pace:
    """How long steps take here, so a lost step can be told from a slow one.

    A step waits at every stage behind the positions sent before it that the
    stages have not finished: eight prompts sent together put seven prompts'
    passes ahead of the last one's, and ahead of the first decode step of the
    others. Counting only the step's own positions took such a step for lost:
    on Llama-3-8B at 0.3 of a core per box every one of 8 requests sent at once
    was replayed (each replay a whole prompt again, at every stage), and the
    8 answered at 1.5x a lone request's rate instead of the 2.5x the pipeline
    holds (docs/benchmarks.md, "Models bigger than any box").
    """

    def __init__(self) -> None:
        self.decode_s: float | None = None  # slowest one-position step of late
        self.position_s: float | None = None  # slowest per-position time of a prefill of late

    def record(self, positions: int, elapsed: float) -> None:
        if positions == 1:
            self.decode_s = max(elapsed, (self.decode_s or 0.0) * PACE_DECAY)
        else:
            self.position_s = max(elapsed / positions, (self.position_s or 0.0) * PACE_DECAY)

    def stall_after(self, positions: int, ahead: int = 0) -> float | None:
        """Seconds after which a step of `positions` counts as lost, sent while `ahead`
        positions of other steps were still on their way; None: no steps seen yet to judge
        by (the request's timeout applies alone)."""
        if positions == 1 and self.decode_s is not None:
            own = self.decode_s
        elif self.position_s is not None:
            own = (self.decode_s or 0.0) + positions * self.position_s
        else:
            return None
        # A position ahead costs what one of a prompt does; where no prompt of more than
        # one position has been timed yet, what a decode step does.
        per_position = self.position_s if self.position_s is not None else own
        return max(STALL_MIN_S, STALL_FACTOR * (own + ahead * per_position))


class TokenLoop:
    """Generates admitted requests: frames out to their routes, results back, tokens sampled."""

    def __init__(self, spec: CoordinatorSpec, tokenizer: Tokenizer, eos_ids: set[int],
                 limits: FrameLimits, *, replay_as_fed: bool, active: dict[int, Generation],
                 outbox: Outbox, routes: Routes, drafting: Drafting, delivery: Delivery,
                 reporter: Reporter, counters: dict[str, float]) -> None:
        """`limits`: what a result message may hold; `replay_as_fed`: see _feed_sizes;
        `active`: the requests in flight, by seq."""
        self.spec = spec
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.limits = limits
        self.replay_as_fed = replay_as_fed
        self._active = active
        self._outbox = outbox
        self._routes = routes
        self._drafting = drafting
        self._delivery = delivery
        self._reporter = reporter
        self._counters = counters
        self._pace = Pace()
        # Positions sent to the stages and not yet answered, all requests together (Pace).
        self._in_flight = 0
        self._decoder = ThreadPoolExecutor(1, thread_name_prefix="coordinator-decode")

    def close(self) -> None:
        self._decoder.shutdown(wait=False, cancel_futures=True)

    async def generate(self, gen: Generation, seed: int, received: float) -> GenerateResponse:
        """Generate `gen`'s answer, its route given back at the end.
        `received`: time.perf_counter() when its request came in."""
        request = gen.request
        rng = np.random.default_rng(seed)
        k = candidates_wanted(request.temperature, request.top_k, self.spec.candidates)
        text = TextStream(self.tokenizer, request.stop) if request.stream or request.stop else None
        tokens: list[int] = []
        ttft: float | None = None
        finish: str = "length"
        restarts = gen.restarts
        try:
            while True:
                result = await self._step(gen, candidates=k)
                if gen.restarts != restarts:  # replayed onto another release: from its prompt
                    restarts, tokens, rng = gen.restarts, [], np.random.default_rng(seed)
                    text = TextStream(self.tokenizer, request.stop) if request.stop else None
                    if gen.drafts is not None:
                        gen.drafts = self._drafting.start()
                cand_ids, cand_logits = result.candidates_arrays()
                token = sample_token(cand_ids[gen.row], cand_logits[gen.row],
                                     temperature=request.temperature,
                                     top_k=request.top_k, top_p=request.top_p, rng=rng)
                ttft = ttft if ttft is not None else time.perf_counter() - received
                tokens.append(token)
                if text is not None:
                    delta = text.add(token)
                    if delta and request.stream:
                        self._delivery.stream(gen.reply, request.id, len(tokens) - 1, delta)
                    if text.stopped:
                        finish = "stop"
                        break
                if token in self.eos_ids and not request.ignore_eos:
                    finish = "stop"
                    break
                if len(tokens) >= request.max_tokens:
                    break
                gen.history.append(token)
        finally:
            self._routes.unroute(gen)
            self._counters["tokens"] += len(tokens)
            self._counters["requests_done"] += 1
            usage = self._drafting.done(gen, tokens)
        if text is not None:
            rest = text.flush()
            if rest and request.stream:
                self._delivery.stream(gen.reply, request.id, len(tokens), rest)
            out_text = text.text
        else:
            out_text = decode(self.tokenizer, tokens)
        total = time.perf_counter() - received
        return GenerateResponse(
            id=request.id, text=out_text, tokens=tokens, finish_reason=finish,  # type: ignore[arg-type]
            usage=Usage(prompt_tokens=gen.prompt_len, completion_tokens=len(tokens)),
            timings=Timings(ttft_ms=None if ttft is None else ttft * 1e3, total_ms=total * 1e3),
            speculation=usage)

    async def _step(self, gen: Generation, *, candidates: int) -> Frame:
        """Bring the route's caches up to `gen.history` and wait for the next candidates.

        Normally that is one decode frame with the last token. After a
        (re)routing it is a prefill of everything from position `gen.synced`,
        in chunks of `prefill_chunk`: only the last chunk asks for candidates,
        and all leave at once so the stages work on them back to back.
        """
        timeout = self.spec.request_timeout_s
        while True:
            if gen.cancelled:
                raise RequestError("cancelled", f"cancelled by the gateway after "
                                   f"{gen.generated} tokens")
            if gen.lost is not None or not gen.route:
                await self._routes.route(gen)
            gen.result = result = asyncio.get_running_loop().create_future()
            positions = len(gen.history) - gen.synced
            self._feed(gen, candidates)
            if gen.drafts is not None and (early := gen.drafts.arrived.get(gen.step)):
                self._resolve(gen, result, early)
            sent = time.monotonic()
            # Drafts in flight are computed with the awaited position, in its frame or in
            # frames before it: positions ahead as much as other requests' are.
            drafting = len(gen.drafts.ahead) if gen.drafts is not None else 0
            stall = (self._pace.stall_after(positions, self._in_flight + drafting)
                     or timeout * COLD_STALL_SHARE)
            # Each replay for a stall doubles the next wait: a pipeline that is
            # merely slow, not losing frames, is soon waited for long enough.
            wait = min(timeout, stall * 2 ** gen.recoveries)
            self._in_flight += positions
            try:
                async with asyncio.timeout(wait):
                    frame = await gen.result
            except Lost:
                continue  # gen.lost is set: route again, replay
            except _Recover as exc:
                await self._recover(gen, str(exc), busy=exc.busy)
                continue
            except TimeoutError:
                if wait >= timeout:
                    raise RequestError("timeout", f"step {gen.step} got no result within "
                                       f"{timeout:.0f} s from nodes "
                                       f"{', '.join(gen.nodes)}") from None
                await self._recover(gen, f"no result for step {gen.step} within {wait:.1f} s, "
                                    "far longer than steps of late: taken as lost in transit")
                continue
            finally:
                self._in_flight -= positions
            self._pace.record(positions, time.monotonic() - sent)
            gen.synced = len(gen.history)
            gen.refusals, gen.refused_since = 0, None
            return frame

    async def _recover(self, gen: Generation, why: str, *, busy: bool = False) -> None:
        """Replay `gen` after a backoff: MAX_RECOVERIES times at most for frames lost or bad,
        and for frames a full stage refused until request_timeout_s has passed."""
        self._counters["recoveries"] += 1
        if busy:
            now = time.monotonic()
            gen.refused_since = gen.refused_since or now
            if now - gen.refused_since > self.spec.request_timeout_s:
                raise RequestError("busy", f"refused for {now - gen.refused_since:.0f} s: {why}. "
                                   "The plant is overloaded: retry later")
            gen.refusals += 1
            delay = RECOVERY_BACKOFF_S * 2 ** (gen.refusals - 1)
        else:
            gen.recoveries += 1
            if gen.recoveries > MAX_RECOVERIES:
                raise RequestError("stage_error", f"gave up after {MAX_RECOVERIES} replays; "
                                   f"the last because {why}")
            delay = 0.0 if gen.recoveries == 1 else RECOVERY_BACKOFF_S * 2 ** (gen.recoveries - 2)
        await asyncio.sleep(min(delay, RECOVERY_BACKOFF_MAX_S))
        gen.lost = why

    def _feed(self, gen: Generation, candidates: int) -> None:
        first = gen.nodes[0]  # the route's node of stage 0
        todo, start = gen.history[gen.synced:], gen.synced
        if gen.synced and len(todo) == 1:  # a decode step
            if gen.drafts is not None and (gen.drafts.ahead or self._drafting.may_draft()):
                self._drafting.feed(gen, gen.drafts, first, candidates,
                                    exact_rows=self._routes.exact_rows(gen))
                return
            gen.step, gen.row = gen.new_step(), 0
            self._outbox.step(gen.seq, first, frames.encode(
                Kind.TOKENS, np.array([todo]), gen.header(), start=start,
                candidates=candidates))
            return
        gen.step, gen.row = gen.new_step(), 0
        header = gen.header()
        if gen.drafts is not None:
            gen.drafts.forget()  # a replay: they went down the old route
        offset = 0
        for size in self._feed_sizes(gen, start, len(todo)):
            last = offset + size == len(todo)
            ids = np.array([todo[offset:offset + size]])
            self._outbox.send(first, frames.encode(Kind.TOKENS, ids, header, start=start + offset,
                                                   candidates=candidates if last else 0,
                                                   prefill=True))
            offset += size

    def _feed_sizes(self, gen: Generation, start: int, positions: int) -> list[int]:
        """Positions of each prefill frame for `positions` of `gen.history` from `start`.

        llama.cpp computes k positions of a sequence in one call not bitwise as k
        calls of one (docs/architecture.md#the-llamacpp-engine), so on a plant with
        llamacpp stages a replay feeds the history as it was first fed: the prompt in
        its chunks, then every generated token as a position of its own. Otherwise the
        whole history goes in chunks, which is fastest.
        """
        if not self.replay_as_fed:
            return prefill_chunks(positions, self.spec.prefill_chunk)
        prompt = max(0, min(positions, gen.prompt_len - start))
        return [*(prefill_chunks(prompt, self.spec.prefill_chunk) if prompt else []),
                *[1] * (positions - prompt)]

    # -- results (event loop, must not block) ----------------------------------------

    def on_result(self, payload: bytes) -> None:
        """A message of result frames from the last stages."""
        try:
            peeks = frames.scan(payload, self.limits)
        except frames.BadTail as exc:
            self._refused(exc, f"dropped a result frame: {exc}")
            peeks = exc.peeks
        except frames.BatchError as exc:
            self._refused(exc, f"refused a result message: {exc}")
            return
        if not peeks:
            return
        if len(payload) < DECODE_INLINE_BYTES and not any(p.compressed for p in peeks):
            try:
                self._dispatch(frames.decode_scanned(payload, peeks))
            except frames.BatchError as exc:
                self._reporter.report("error", f"dropped a result frame: {exc}")
                self._dispatch(exc.good)
            return
        decoding = asyncio.get_running_loop().run_in_executor(
            self._decoder, frames.decode_scanned, payload, peeks)
        decoding.add_done_callback(self._decoded)

    def _refused(self, exc: frames.BatchError, message: str) -> None:
        """Report frames refused from their headers; count those of another frame version
        (a box of another edgebus release), which `edgebus status` then shows."""
        if isinstance(exc.cause, FrameVersionError):
            self._counters["foreign_frames"] += 1
        self._reporter.report("error", message)

    def _decoded(self, decoding: asyncio.Future[list[Frame]]) -> None:
        if decoding.cancelled():
            return
        error = decoding.exception()
        if isinstance(error, frames.BatchError):
            self._reporter.report("error", f"dropped a result frame: {error}")
            self._dispatch(error.good)
        elif error is None:
            self._dispatch(decoding.result())

    def _dispatch(self, results: list[Frame]) -> None:
        for frame in results:
            gen = self._active.get(frame.request)
            if gen is None or frame.epoch != gen.epoch:
                continue  # a request that ended, or an old route
            drafts = gen.drafts
            if drafts is not None and any(d.step == frame.step for d in drafts.ahead):
                # Rows of drafts, back before their tokens are sampled: kept for then.
                drafts.arrived[frame.step] = frame
            # Stale results (a rejected draft, a duplicate) are dropped.
            if frame.step != gen.step or gen.result is None or gen.result.done():
                continue
            self._resolve(gen, gen.result, frame)

    def _resolve(self, gen: Generation, result: asyncio.Future[Frame], frame: Frame) -> None:
        """Hand the result `frame` of `gen`'s awaited step to its task."""
        if frame.kind == Kind.CANDIDATES:
            if len(frame.shape) != 2 or frame.shape[0] <= gen.row or frame.shape[1] < 1:
                self._reporter.report("error", f"dropped a result of shape {frame.shape} "
                                      f"for request {gen.request.id}: not [rows, k] with "
                                      f"a row {gen.row}")
                return
            result.set_result(frame)
        elif frame.kind == Kind.ERROR and frame.retry:
            result.set_exception(_Recover(frame.text(), busy=frame.busy))
        elif frame.kind == Kind.ERROR:
            result.set_exception(RequestError("stage_error", frame.text()))


def prefill_chunks(positions: int, chunk: int) -> list[int]:
    """Sizes of the prefill frames for `positions` prompt positions, each at most `chunk`.

    A prompt longer than a chunk starts with half a chunk: until it has left
    the first stage, the other stages have nothing to do, so a smaller one sets
    them to work sooner (a 512-token prompt goes as 64+128+128+128+64).
    """
    if positions <= chunk:
        return [positions]
    first = max(1, chunk // 2)
    rest = positions - first
    return [first, *[min(chunk, rest - offset) for offset in range(0, rest, chunk)]]
