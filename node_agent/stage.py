"""The stage agent: one box, one contiguous range of layers.

    {root}/act/{node} --message of frames--> [inbox] --> scheduler --> next stage's topic
                                                                   \\-> coordinator (last stage)

Continuous batching: the decode frames of one message, from whatever requests
at whatever positions (a group, formed by the coordinator), run as one batched
forward pass (`StageEngine.step`), and all their outputs leave as one
message. Prompt chunks run one per turn between those batches, so a long
prompt never holds up other requests' tokens for more than one chunk.

A message's frame headers are read and checked in the event loop against
the plant's frame limits (cheap, nothing allocated); checksums and LZ4 of big
messages run on a decoder thread, prompt chunks' forward passes on a worker
thread, so the loop keeps receiving and publishing while the CPU computes
them. On an engine of one thread, a batch of decode rows runs in the loop
itself: a step of a few milliseconds, which a hand-off to the worker and back
lengthened by a third of a millisecond or more per hop (see `_run`). An engine
of several threads computes on the worker alone, so that OpenMP keeps one
thread team (see `__init__`). Frames waiting (in the inbox, or as prompt
chunks) take at most `waiting_limit` bytes (node_agent/stage_inbox.py), what
the node's KV budget can ever hold of prompts; a message past it is refused,
not queued.

A frame that cannot be used, for a request this node cannot go on with as
sent, is reported to the coordinator at once with an ERROR frame marked for
replay: one lost on the way (a gap in positions, or no prefill at all), one
that is bad, or one refused at the bound. Only frames that may belong to a
request in flight are reported: a prompt chunk, or a frame of a request this
node holds or evicted lately. A decode step for a request it never saw can
belong to none (its prefill would have come first), so garbage aimed at a
stage costs the coordinator nothing. The coordinator replays the request
as it does after a dead node. An event on `{root}/events` says what happened
(rate-limited, node_agent/reporter.py). Nothing takes the agent or another
request's state down with it, and nothing is dropped without a word.

Failover: every frame names its route (which replica runs each stage) and
route epoch. A replayed request arrives as a prefill with a newer epoch and
replaces the old cache; frames of an older epoch, and QoS 1 duplicates, are
dropped quietly, because after a failover they are expected. Each node holds
at most `kv_budget_mb` of caches; caches idle past the coordinator's step
timeout belong to abandoned requests and are evicted, and so, when a prefill
needs room, are caches idle longer than a node takes to be declared dead
(a restarted coordinator leaves its predecessor's caches behind): were one of
them still wanted, its next frame would find no cache, and the coordinator
would replay it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import aiomqtt
import numpy as np

from edgebus.core import frames
from edgebus.core.client import BusClient
from edgebus.core.errors import FrameError, FrameVersionError
from edgebus.core.frames import Frame, Header, Kind, Peek
from node_agent.engines import StageEngine, context_shape, load_engine
from node_agent.engines.base import Cache, CacheFull
from node_agent.fit import check_fit
from node_agent.memory import return_freed_memory
from node_agent.reporter import Reporter
from node_agent.runtime import presence, run_agent, serve_until, sparkplug_node
from node_agent.stage_inbox import InboxMessage, waiting_bytes, waiting_limit
from node_agent.stage_io import WIRE_DTYPES, check_input, encode_output
from plant_config import Plant

log = logging.getLogger(__name__)

# Most decode rows batched into one forward pass. Past ~32 a CPU stage stops
# gaining (the step turns compute-bound) while each row waits longer.
MAX_BATCH = frames.MAX_BATCH_ROWS
# How often the worker looks for abandoned caches: cheap, and an abandoned
# cache costs memory, not correctness, so once in a while is enough.
SWEEP_INTERVAL_S = 5.0
# Messages this big, or holding LZ4, are checked and decompressed on the
# decoder thread: a decode step's frame (a few KB) is checked faster in the
# loop than a thread hop takes, a prefill chunk's (hundreds of KB) is not.
DECODE_INLINE_BYTES = 64 * 1024
# Ids of caches evicted lately, whose next frame the coordinator must hear of
# (its request is replayed): far more than a sweep evicts at once.
EVICTED_MEMORY = 1024


class _Skip(FrameError):
    """A frame that is expected to be dropped: a QoS 1 duplicate, or one from an old route."""


class _Refused(FrameError):
    """A request this node gives up on; the coordinator is told, so it fails fast."""


class _Lost(FrameError):
    """A frame before this one never arrived: the coordinator must replay the request."""


class StageAgent:
    """Runs one stage of the plant's pipeline, as one of its replica nodes."""

    def __init__(self, plant: Plant, node_id: str, model: StageEngine | None = None) -> None:
        self.plant = plant
        self.node_id = node_id
        self.pipeline = plant.pipeline
        self.index = plant.stage_index(node_id)
        stage = self.pipeline[self.index]
        self.replica = stage.node_ids.index(node_id)
        self.replica_counts = [len(s.nodes) for s in self.pipeline]  # what a valid route fits
        spec = plant.node(node_id)
        topics = plant.topics
        self.topics = topics
        self.model = model if model is not None else load_engine(
            plant.model, *spec.layers, engine=spec.engine, weights=spec.weights,
            device=spec.device, shape=context_shape(plant, node_id))
        self.coordinator_topic = topics.activations(plant.coordinator.id)
        # The topics of the next stage's nodes, by replica: a frame's route picks one for
        # every frame this node sends on, so they are built (and checked) once.
        following = self.pipeline[self.index + 1:self.index + 2]
        self._next_topics = [topics.activations(n.node) for s in following for n in s.nodes]
        self.wire_dtype = WIRE_DTYPES[plant.wire_dtype]
        self.kv_budget = spec.kv_budget_mb * 2**20
        self.kv_per_token = self.model.kv_bytes_per_token()
        # The coordinator gives up on a step after this long: a cache idle for
        # longer belongs to a request nobody will finish or release.
        self.abandon_after_s = plant.coordinator.request_timeout_s
        # A cache idle this long when room is needed belongs to a request that is not
        # moving: its route lost a node, or its coordinator died (see the docstring).
        self.idle_evict_s = plant.liveness.timeout_s
        # Changed only by a step of `_work` (on the loop, or the worker thread while the loop
        # awaits it): one at a time.
        self.caches: dict[int, Cache] = {}
        # Requests whose caches were evicted lately (EVICTED_MEMORY), by `_work`'s steps.
        self._evicted: collections.OrderedDict[int, None] = collections.OrderedDict()
        # Requests released lately (EVICTED_MEMORY): drafts of theirs may still be on
        # their way from the stage before, and are dropped without a word.
        self._released: collections.OrderedDict[int, None] = collections.OrderedDict()
        # The last step computed for each request held: a decode frame of a step not past
        # it is a duplicate, or a draft a rollback replaced (node_agent/speculation.py).
        self._steps: dict[int, int] = {}
        # The latest rollback frame received for each request held, (epoch, step, start),
        # set as it arrives: drafts queued before it that it replaces are never computed.
        self._rollbacks: dict[int, tuple[int, int, int]] = {}
        config = self.model.config
        self.limits = frames.stage_limits(
            prefill_chunk=plant.coordinator.prefill_chunk, hidden=config.hidden_size,
            max_in_flight=plant.coordinator.max_in_flight, stages=len(self.pipeline))
        self.waiting_limit = waiting_limit(plant, node_id, config.hidden_size, self.kv_per_token,
                                           self.model.slice.has_embedding)
        self.waiting = 0  # bytes of the frames in the inbox and in _prompts (see waiting_bytes)
        # Messages in arrival order; bounded by `waiting_limit` (see _on_message).
        self.inbox: asyncio.Queue[InboxMessage] = asyncio.Queue()
        # Prompt chunks waiting for a pass; bounded by `waiting_limit` with the inbox.
        self._prompts: collections.deque[Frame] = collections.deque()
        self._swept = time.monotonic()
        # Counters; the event loop and the worker thread each have keys of their own.
        # decode_*: passes of decode rows only, whose time the planner's decode step predicts.
        # compute_cpu_s: the CPU time of the thread that calls the engine while it computes;
        # below compute_s when others share the box's cores, and with it what a step costs
        # beside the layers (frame handling) can be told from the stage's CPU time.
        self.metrics = {"compute_s": 0.0, "compute_cpu_s": 0.0, "steps": 0.0, "rows": 0.0,
                        "mixed_steps": 0.0, "decode_s": 0.0, "decode_steps": 0.0,
                        "skipped_frames": 0.0, "evicted": 0.0, "lost_frames": 0.0,
                        "bad_frames": 0.0, "refused_frames": 0.0, "unreadable_frames": 0.0,
                        # frames of another frame version: a box of another edgebus release
                        "foreign_frames": 0.0,
                        "rollbacks": 0.0, "cancelled_frames": 0.0,
                        # decode frames of several positions, and those run a call a position
                        "verify_frames": 0.0, "verify_positions": 0.0, "verify_split": 0.0}
        self.bus = BusClient(
            plant.endpoint_for(node_id), f"{plant.plant_id}.{node_id}",
            subscriptions=[(topics.activations(node_id), 1)],
            presence=presence(topics, node_id, "stage", stage=self.index, layers=spec.layers,
                              metrics=self._metrics, engine=self.model.describe()))
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"stage-{node_id}")
        # An engine that computes on several threads (OpenMP, in llama.cpp and torch) keeps a
        # thread team for each thread that calls it, and with two teams libgomp stops
        # spinning at its barriers and sleeps at every one: on the 1.3B shape at 2 threads a
        # decode step took 49-62 ms instead of 35 (25,000 context switches a run, AMD EPYC).
        # So such an engine computes on the worker thread alone. One thread has no team:
        # its decode rows run on the loop (see _run).
        self._rows_on_loop = int(self.model.describe().get("threads", 1)) <= 1
        # Checksums and LZ4 of big messages, in arrival order, beside the forward pass.
        self._decoder = ThreadPoolExecutor(1, thread_name_prefix=f"decode-{node_id}")
        self.reporter = Reporter(self.bus, topics, node_id)

    def _metrics(self) -> dict[str, float]:
        caches = list(self.caches.values())  # a snapshot: the worker thread may change the dict
        return {**self.metrics, "queue": float(self.inbox.qsize() + len(self._prompts)),
                "waiting_bytes": float(self.waiting), **self.bus.metrics(),
                "requests": float(len(caches)), "kv_bytes": float(sum(c.nbytes for c in caches))}

    async def serve(self, stop: asyncio.Event) -> None:
        try:
            await serve_until(stop, self.bus, self._on_message, self._work(),
                              *sparkplug_node(self.plant, self.node_id, self.bus),
                              heartbeat_s=self.plant.liveness.heartbeat_s)
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._decoder.shutdown(wait=False, cancel_futures=True)

    # -- receiving (event loop) ------------------------------------------------

    def _on_message(self, message: aiomqtt.Message) -> None:
        """Check a message's headers, then queue it, or refuse it whole at the bound."""
        payload = message.payload if isinstance(message.payload, bytes) else b""
        topic = message.topic.value
        try:
            peeks = frames.scan(payload, self.limits)
        except frames.BadTail as exc:  # frames before the bad one may still be good
            self._tell_coordinator(exc.suspects, f"a frame was unreadable: {exc}")
            if isinstance(exc.cause, FrameVersionError):
                # Its header past the version cannot be read: there is no telling whose
                # request it is. The coordinator routes around nodes that speak another
                # version (its routing); this counts what came anyway, for `edgebus status`.
                self.metrics["foreign_frames"] += 1
            self._dropped(f"dropped an unreadable frame on {topic}: {exc}", len(exc.suspects))
            peeks = exc.peeks
        except frames.BatchError as exc:  # past a limit: none of it is taken
            self._tell_coordinator(exc.suspects, f"a message was refused: {exc}")
            self._dropped(f"refused a message on {topic}: {exc}", max(1, len(exc.suspects)))
            return
        if not peeks:
            return
        need = sum(waiting_bytes(p) for p in peeks)
        if self.waiting + need > self.waiting_limit:
            self.metrics["refused_frames"] += len(peeks)
            reason = (f"node {self.node_id} has {self.waiting} bytes of frames waiting, "
                      f"{need} more would pass its bound of {self.waiting_limit}")
            self._tell_coordinator(peeks, f"refused: {reason}", busy=True)
            self.reporter.report("warning", f"refused {len(peeks)} frame(s) on {topic}: "
                                 f"{reason}; the coordinator replays their requests")
            return
        self.waiting += need
        for peek in peeks:
            if peek.rollback and peek.request in self.caches:
                self._rollbacks[peek.request] = (peek.epoch, peek.step, peek.start)
        if len(payload) < DECODE_INLINE_BYTES and not any(p.compressed for p in peeks):
            try:
                decoded: list[Frame] | asyncio.Future[list[Frame]] = frames.decode_scanned(
                    payload, peeks)
            except frames.BatchError as exc:
                decoded = self._bad(exc, peeks, topic)
        else:
            decoded = asyncio.get_running_loop().run_in_executor(
                self._decoder, frames.decode_scanned, payload, peeks)
        self.inbox.put_nowait(InboxMessage(peeks, decoded, topic))

    async def _open(self, message: InboxMessage) -> list[Frame]:
        """A message's frames, once decoded; the bad ones reported and let go."""
        if isinstance(message.frames, list):
            return message.frames
        try:
            return await message.frames
        except frames.BatchError as exc:
            return self._bad(exc, message.peeks, message.topic)

    def _bad(self, exc: frames.BatchError, peeks: list[Peek], topic: str) -> list[Frame]:
        """The frames of a message before its bad one; the rest reported and released."""
        self.waiting -= sum(waiting_bytes(p) for p in peeks[len(exc.good):])
        self._tell_coordinator(exc.suspects, f"a frame was bad: {exc}")
        self._dropped(f"dropped a frame on {topic}: {exc}", len(peeks) - len(exc.good))
        return exc.good

    def _done(self, batch: list[Frame]) -> None:
        """These frames no longer wait: give their bytes back to the bound."""
        self.waiting -= sum(waiting_bytes(f) for f in batch)

    def _tell_coordinator(self, peeks: list[Peek], reason: str, *, busy: bool = False) -> None:
        """ERROR frames marked for replay: the requests cannot go on as sent (`busy`: not
        until this node has room again). Only for frames that may be a live request's."""
        told = [p.header() for p in peeks[:self.limits.max_frames]
                if self._in_flight(p.request, p.prefill)]
        if told:
            self.bus.send(self.coordinator_topic, b"".join(
                frames.encode_error(h, f"stage node {self.node_id}: {reason}", retry=True,
                                    busy=busy) for h in told))

    def _in_flight(self, request: int, prefill: bool) -> bool:
        """Whether a frame may belong to a request in flight: a prompt chunk (the first of a
        request, or one after a lost one), or a frame of a request held or evicted here."""
        return prefill or request in self.caches or request in self._evicted

    def _dropped(self, message: str, count: int) -> None:
        self.metrics["unreadable_frames"] += count
        self.reporter.report("error", message)

    # -- scheduling (event loop) -----------------------------------------------

    async def _work(self) -> None:
        """Run each message's decode rows as one batch, a waiting prompt chunk in it.

        The chunk shares the batch's forward pass (StageEngine.step): the
        weights are read once for both, and other requests' decode steps wait
        for at most one chunk's compute.

        A message's decode rows are a group the coordinator formed
        (node_agent/groups.py); merging queued groups here would fuse them
        into one batch moving in lockstep and leave the other stages idle,
        and splitting one would only add steps.
        """
        loop = asyncio.get_running_loop()
        while True:
            # With prompt chunks pending there is work now; else sleep until a message comes.
            if not self._prompts:
                message = await self._open(await self.inbox.get())
            else:
                message = [] if self.inbox.empty() else await self._open(self.inbox.get_nowait())
            decodes = self._sort(message)
            # A message of prompt chunks only (a new request): the next group's rows, if
            # already here, share their pass.
            while not decodes and self._prompts and not self.inbox.empty():
                decodes = self._sort(await self._open(self.inbox.get_nowait()))
            batches = [decodes[first:first + MAX_BATCH]
                       for first in range(0, len(decodes), MAX_BATCH)] or [[]]
            if self._prompts:  # one prompt chunk rides along: the weights are read once for both
                batches[-1].insert(0, self._prompts.popleft())
            for batch in batches:
                if batch:
                    await self._run(loop, batch)

    def _sort(self, message: list[Frame]) -> list[Frame]:
        """Carry out a message's releases, queue its prompt chunks; return its decode rows."""
        decodes: list[Frame] = []
        for frame in message:
            if frame.kind == Kind.RELEASE:
                self._release(frame)
                self._done([frame])
            elif frame.prefill:
                self._prompts.append(frame)
            else:
                decodes.append(frame)
        return decodes

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[Frame]) -> None:
        try:
            if self._rows_on_loop and not any(frame.prefill for frame in batch):
                # Decode rows, a step of a few ms: run here. Handing it to the worker and
                # back took 0.3-0.4 ms each way on a loaded 2-core box (a thread wake-up,
                # then the loop's own), per hop; meanwhile arriving messages wait in the
                # socket, and the next step could not start before this one ends anyway.
                out, errors = self._forward(batch)
            else:
                # A prompt chunk (tens of ms or more), or any step of an engine of several
                # threads: on the worker thread, while the loop goes on receiving and
                # checking frames.
                out, errors = await loop.run_in_executor(self._executor, self._forward, batch)
        finally:
            self._done(batch)
        for error in errors:
            self.reporter.report("error", error)
        # The next batch need not wait for this one's PUBACK (see BusClient.send).
        for topic, message in out.items():
            self.bus.send(topic, message)

    # -- compute (the loop, or the worker thread for prompt chunks) ---------------------

    def _forward(self, batch: list[Frame]) -> tuple[dict[str, bytes], list[str]]:
        """Run a prefill chunk or a batch of decode rows; return messages by topic, and errors."""
        self._sweep()
        errors: list[str] = []
        out: dict[str, list[bytes]] = collections.defaultdict(list)
        rows: list[tuple[Frame, np.ndarray, Cache, str]] = []
        for frame in batch:
            try:
                if any(frame.request == row[0].request for row in rows):
                    raise _Skip("second frame for this request in one batch: duplicate")
                if self._superseded(frame):
                    self.metrics["cancelled_frames"] += 1
                    continue
                # The route first: a frame that is not this node's must not make a cache.
                topic = self._next_topic(frame)
                x = check_input(frame, self.model, self.index, self.plant.coordinator.prefill_chunk)
                rows.append((frame, x, self._cache_for(frame), topic))
            except _Skip as exc:
                self.metrics["skipped_frames"] += 1
                log.debug("skipped frame of request %x: %s", frame.request, exc)
            except _Refused as exc:
                out[self.coordinator_topic].append(frames.encode_error(Header.of(frame), str(exc)))
                errors.append(f"refused request {frame.request:x}: {exc}")
            except FrameError as exc:
                # Lost on the way or bad: a replay of the request recovers either.
                self.metrics["lost_frames" if isinstance(exc, _Lost) else "bad_frames"] += 1
                if not self._in_flight(frame.request, frame.prefill):
                    errors.append(f"dropped frame of request {frame.request:x} step "
                                  f"{frame.step}: {exc}; no request in flight sends such a "
                                  "frame")
                    continue
                out[self.coordinator_topic].append(frames.encode_error(
                    Header.of(frame), f"stage node {self.node_id}: {exc}", retry=True))
                errors.append(f"dropped frame of request {frame.request:x} step {frame.step}: "
                              f"{exc}; the coordinator replays it")
        if rows:
            self._compute(rows, out, errors)
        return {topic: b"".join(parts) for topic, parts in out.items() if any(parts)}, errors

    def _compute(self, rows: list[tuple[Frame, np.ndarray, Cache, str]],
                 out: dict[str, list[bytes]], errors: list[str]) -> None:
        started, started_cpu = time.perf_counter(), time.thread_time()
        try:
            outputs = self._outputs(rows)
        except Exception as exc:
            # A half-updated cache would poison every later step of these requests.
            reason = f"forward failed ({type(exc).__name__}: {exc})"
            for frame, _, _, _ in rows:
                self._drop(frame.request)
                out[self.coordinator_topic].append(frames.encode_error(Header.of(frame), reason))
            errors.append(f"{reason}; dropped {len(rows)} request(s)")
            return
        now = time.monotonic()
        took = time.perf_counter() - started
        self.metrics["compute_s"] += took
        self.metrics["compute_cpu_s"] += time.thread_time() - started_cpu
        self.metrics["steps"] += 1
        self.metrics["rows"] += len(rows)
        if not any(row[0].prefill for row in rows):
            self.metrics["decode_s"] += took
            self.metrics["decode_steps"] += 1
        elif len(rows) > 1:
            self.metrics["mixed_steps"] += 1  # a prompt chunk shared a decode batch's pass
        for (frame, _, cache, topic), output in zip(rows, outputs, strict=True):
            cache.touched = now
            self._steps[frame.request] = frame.step
            out[topic].append(encode_output(frame, output, self.model, self.wire_dtype))

    def _outputs(self, rows: list[tuple[Frame, np.ndarray, Cache, str]]
                 ) -> list[np.ndarray | None]:
        """The engine's outputs for `rows`: decode rows and a prompt chunk as one pass, and
        each decode frame of several positions (a token and its drafts) verified on its own:
        one call where the engine's rows stay exact, else one call a position."""
        together = [i for i, row in enumerate(rows) if not row[0].verifies]
        outputs: list[np.ndarray | None] = [None] * len(rows)
        if together:
            # A prompt chunk before the last needs no logits: nothing is sampled from it.
            computed = self.model.run([rows[i][1] for i in together],
                                      [rows[i][2] for i in together],
                                      [rows[i][0].start for i in together],
                                      [rows[i][0].candidates > 0 for i in together])
            for i, output in zip(together, computed, strict=True):
                outputs[i] = output
        for i, (frame, x, cache, _) in enumerate(rows):
            if frame.verifies:
                outputs[i] = self.model.verify(x, cache, frame.start)
                self.metrics["verify_frames"] += 1
                self.metrics["verify_positions"] += frame.count
                self.metrics["verify_split"] += frame.count > self.model.exact_rows
        return outputs

    def _superseded(self, frame: Frame) -> bool:
        """Whether a rollback that has already arrived replaces this draft: early
        cancellation, so that a rejected draft costs no compute at this stage."""
        rollback = self._rollbacks.get(frame.request)
        return (rollback is not None and not frame.prefill and frame.epoch == rollback[0]
                and frame.step < rollback[1] and frame.start >= rollback[2])

    def _cache_for(self, frame: Frame) -> Cache:
        cache = self.caches.get(frame.request)
        if cache is not None and frame.epoch < cache.epoch:
            raise _Skip(f"epoch {frame.epoch} was replaced by a replay (epoch {cache.epoch})")
        if frame.start == 0:
            if not frame.prefill:
                raise FrameError("a decode step at position 0")
            if cache is not None and cache.epoch == frame.epoch:
                raise _Skip("prefill already received: duplicate")
            self._make_room(frame)
            if cache is not None:  # a replay replaces the older route's cache
                self._drop(frame.request)
            self._steps.pop(frame.request, None)
            try:
                cache = self.caches[frame.request] = self.model.new_cache(frame.epoch)
            except CacheFull as exc:
                raise _Refused(f"node {self.node_id}: {exc}: retry later, or raise "
                               "kv_budget_mb in the plant file") from exc
            return cache
        if cache is None and frame.request in self._released and not frame.prefill:
            raise _Skip("its request was released: a draft still on its way")
        if cache is None or cache.epoch != frame.epoch:
            raise _Lost("unknown request (its prefill never arrived here, or it was released "
                        "or evicted)")
        held = cache.get_seq_length()
        if not frame.prefill and frame.step <= self._steps.get(frame.request, -1):
            raise _Skip(f"step {frame.step} already passed: a duplicate, or a draft that a "
                        "rollback replaced")
        if frame.start < held and frame.rollback and not frame.prefill:
            self.model.truncate(cache, frame.start)
            self.metrics["rollbacks"] += 1
        elif frame.start < held:
            raise _Skip(f"position {frame.start} already computed: duplicate")
        if frame.start > held:
            raise _Lost(f"frame starts at position {frame.start} but the cache holds "
                        f"{held}: a frame before it was lost")
        if frame.prefill:
            self._make_room(frame)
        return cache

    def _make_room(self, frame: Frame) -> None:
        """Evict idle caches, or refuse a prefill chunk that would take the caches past this
        node's budget."""
        need = frame.count * self.kv_per_token
        held = sum(c.nbytes for c in self.caches.values())
        if held + need > self.kv_budget:
            now = time.monotonic()
            idle = sorted((c.touched, rid) for rid, c in self.caches.items()
                          if rid != frame.request and now - c.touched > self.idle_evict_s)
            for _, rid in idle:
                held -= self._evict(rid)
                if held + need <= self.kv_budget:
                    break
        if held + need > self.kv_budget:
            self._drop(frame.request)
            raise _Refused(f"KV budget of node {self.node_id} is full ({held / 2**20:.1f} of "
                           f"{self.kv_budget / 2**20:.0f} MiB held, {need / 2**20:.1f} MiB more "
                           "asked): retry later, or raise kv_budget_mb in the plant file")

    def _release(self, frame: Frame) -> None:
        cache = self.caches.get(frame.request)
        if cache is not None and cache.epoch <= frame.epoch:  # never a newer route's cache
            self._drop(frame.request)
            _remember(self._released, frame.request)

    def _sweep(self) -> None:
        """Evict caches of requests abandoned without a release (their coordinator died)."""
        now = time.monotonic()
        if now - self._swept < SWEEP_INTERVAL_S:
            return
        self._swept = now
        idle = [rid for rid, c in self.caches.items() if now - c.touched > self.abandon_after_s]
        for rid in idle:
            self._evict(rid)
        if idle:
            return_freed_memory()

    def _drop(self, request: int) -> int:
        """Let go of a request's cache, if held here; return the bytes freed."""
        self._steps.pop(request, None)
        self._rollbacks.pop(request, None)
        cache = self.caches.pop(request, None)
        if cache is None:
            return 0
        self.model.free_cache(cache)
        return cache.nbytes

    def _evict(self, request: int) -> int:
        """Drop a cache its request is not using; return the bytes freed."""
        freed = self._drop(request)
        self.metrics["evicted"] += 1
        _remember(self._evicted, request)
        return freed

    def _next_topic(self, frame: Frame) -> str:
        """Where this frame's output goes: the route's node of the next stage."""
        route, stages, counts = frame.route, self.pipeline, self.replica_counts
        if len(route) != len(counts) or any(r >= n for r, n in zip(route, counts, strict=True)):
            raise FrameError(f"route {list(route)} does not fit this plant's {counts} nodes per "
                             "stage: run the same plant file on every box")
        if route[self.index] != self.replica:
            raise FrameError(f"route {list(route)} does not pass through this node")
        if self.index == len(stages) - 1:
            return self.coordinator_topic
        return self._next_topics[route[self.index + 1]]


def _remember(memory: collections.OrderedDict[int, None], request: int) -> None:
    """Add `request` to a memory of recent requests of at most EVICTED_MEMORY."""
    memory[request] = None
    while len(memory) > EVICTED_MEMORY:
        memory.popitem(last=False)


def run_stage(plant: Plant, node_id: str, threads: int | None = None) -> None:
    """`edgebus node PLANT --id NODE`: load the layers, then serve until SIGTERM."""
    spec = plant.node(node_id)
    check_fit(plant, node_id)  # before anything loads: a box too small says so, not the kernel

    async def main(stop: asyncio.Event) -> None:
        # Kernel options are measured on this box at the first start (engines/tuning.py).
        model = load_engine(plant.model, *spec.layers, engine=spec.engine,
                            weights=spec.weights, device=spec.device,
                            threads=threads or spec.threads, tune=True,
                            shape=context_shape(plant, node_id))
        agent = StageAgent(plant, node_id, model=model)
        log.info("stage %s holds layers [%d, %d): %.1f MB of parameters, run by %s", node_id,
                 *spec.layers, agent.model.param_bytes / 1e6, agent.model.describe())
        await agent.serve(stop)

    run_agent(main)
