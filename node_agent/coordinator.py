"""The coordinator agent: requests in, token loop through the stages, responses out.

    gateway --request--> coordinator --TOKENS--> stage 0 --HIDDEN--> ... --> stage N-1
                              ^                                                  |
                              +------------------CANDIDATES----------------------+
                         sample, stream delta, stop?  --response--> gateway

Every request is its own asyncio task awaiting its own futures, so many are in
flight at once and nothing serialises them. Their decode steps travel in
groups, one message per group, each a batch at every stage
(node_agent/groups.py). The coordinator holds the tokenizer and no weights.

Failover. A stage may have several replica nodes; each request runs down one
route (one node per stage) and stays there, because its KV caches live on
those nodes. When a node of its route dies (its Will, a clean offline, or no
heartbeat for liveness.timeout_s) or starts a new MQTT session (frames sent
to it may be lost), the request is replayed: the tokens so far, prompt plus
generated, go as a prefill down a healthy route under a new route epoch, and
generation goes on from there. Sampling state lives here, so the output is
the same as without the fault. Frames of the old epoch are ignored. A request
is replayed the same way when a stage reports that it cannot go on with it as
sent (an ERROR frame marked for replay: a frame lost, bad, or refused at the
stage's bound), or when a step's result is much later than any step's of late
(STALL_FACTOR): a decode step's frame that is lost leaves nothing behind it
for a stage to notice.

Restarts. A request is journaled on disk (node_agent/journal.py) before it is
acknowledged to the broker and forgotten once its answer has been; a
coordinator that starts answers what its journal holds, and the broker
delivers again what was never acknowledged. A plant may run several
coordinators at once (`coordinator.instances`, MQTT 5): they share the
request subscription (`$share/...`), and when one goes offline another
serves the requests the broker keeps in the dead one's session until it is
back. docs/failover.md has
the whole story, and the faults each part answers.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import aiomqtt
import numpy as np
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edgebus.core import frames
from edgebus.core.client import BusClient
from edgebus.core.errors import BusError, EdgebusError, RequestError
from edgebus.core.frames import Frame, Header, Kind
from edgebus.core.messages import (
    AgentStatus,
    CancelRequest,
    ErrorInfo,
    GenerateRequest,
    GenerateResponse,
    SpeculationUsage,
    StreamDelta,
    Timings,
    Usage,
    parse_request,
    salvage_id,
)
from edgebus.core.statuses import Role, StatusReader
from edgebus.core.topics import check_level
from node_agent.engines import kv_reservation
from node_agent.groups import Outbox
from node_agent.journal import Entry, Journal, JournalLock, default_directory
from node_agent.model_config import generation_eos, load_config
from node_agent.reporter import Reporter
from node_agent.runtime import presence, publish_plan, run_agent, serve_until, sparkplug_node
from node_agent.sampling import candidates_wanted, sample_token
from node_agent.speculation import Draft, Drafts
from node_agent.text import TextStream, decode, load_tokenizer, prompt_ids
from plant_config import Plant
from plant_config.schema import resolve_engine
from plant_config.tasks import apply_task

if TYPE_CHECKING:
    from node_agent.text import Tokenizer

log = logging.getLogger(__name__)

# Answers remembered by (client, id), so a QoS 1 redelivery or a gateway's retry
# gets the first answer again instead of a second generation, in bytes of the
# answers (_held_bytes): counted in answers, 4096 answers of 1024 tokens held
# ~200 MB (48.6 KB each, measured with tracemalloc). A gateway sends again within
# seconds, or once the coordinator is back from a restart; 32 MiB hold the last
# ~550 answers of 1024 tokens or ~11000 short ones. Past it the oldest answered
# ids are forgotten first: sent again, such an id is generated again. Ids still
# in flight are never forgotten.
DEDUP_BYTES = 32 * 2**20
# What one remembered answer costs beyond its text and tokens: the key, the
# future and the response's pydantic objects (a short error answer measured
# 2.5 KB in all with tracemalloc, CPython 3.11).
DEDUP_ENTRY_BYTES = 2560
# A token id in a Python list: the pointer and the int object (ids past 256 are
# not shared).
DEDUP_TOKEN_BYTES = 8 + 28
# Errors that ask the gateway to send the request again later: their answers
# are not remembered, so the retry (same id) is served, not answered from memory.
RETRY_LATER = frozenset({"busy", "unavailable", "timeout"})
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
# Environment variable naming this coordinator's instance when several run at once.
INSTANCE_ENV = "EDGEBUS_INSTANCE"


@dataclass
class ReplyRoute:
    """Where a request's response goes, and what MQTT 5 correlation data to echo."""

    topic: str
    correlation: bytes | None = None

    @property
    def stream_topic(self) -> str:
        return f"{self.topic}/stream"


class _Lost(Exception):
    """The request's route lost a node: replay it down another."""


class _Recover(Exception):
    """A stage cannot go on with the request as sent (a frame lost, bad or refused): replay."""

    def __init__(self, reason: str, *, busy: bool = False) -> None:
        super().__init__(reason)
        self.busy = busy  # refused for lack of room: replay once the stage has had time


@dataclass
class Generation:
    """One request in flight, and where its KV caches live."""

    request: GenerateRequest
    reply: ReplyRoute
    history: list[int]  # prompt ids, then every sampled token
    max_len: int  # positions it may reach: what its KV reservation is for
    prompt_len: int  # positions of `history` that are the prompt
    seq: int = field(default_factory=lambda: secrets.randbits(63))
    step: int = 0  # of the frame whose result is awaited
    steps: int = 0  # steps taken: every frame sent gets a new one (see frames.py)
    epoch: int = 0
    route: tuple[int, ...] = ()  # replica index per stage; () before the first routing
    nodes: list[str] = field(default_factory=list)  # the route's node ids
    synced: int = 0  # positions of `history` the route's caches hold
    lost: str | None = None  # why the route must be replaced, once the current step ends
    result: asyncio.Future[Frame] | None = None
    recoveries: int = 0  # replays for frames lost or bad (MAX_RECOVERIES)
    refusals: int = 0  # replays for frames refused by a full stage, since the last step
    refused_since: float | None = None  # time.monotonic() of the first of those
    # By the gateway: ends before the next step. Not mid-step: frames of the step
    # would still be on their way to stages that have already freed the request.
    cancelled: bool = False
    drafts: Drafts | None = None  # where the plant drafts (node_agent/speculation.py)

    def header(self, step: int | None = None) -> Header:
        return Header(self.seq, self.epoch, self.step if step is None else step, self.route)

    def new_step(self) -> int:
        self.steps += 1
        return self.steps - 1

    @property
    def generated(self) -> int:
        return len(self.history) - self.prompt_len


@dataclass
class NodeHealth:
    """What the coordinator knows of one stage node, from its status messages."""

    alive: bool = False
    seen: float = 0.0  # time.monotonic() of its last sign of life
    session: tuple[str, int, int] | None = None  # (host, pid, bdseq) of its MQTT session
    held: int = 0  # KV bytes reserved by requests routed through it


class Pace:
    """How long steps take here, so a lost step can be told from a slow one."""

    def __init__(self) -> None:
        self.decode_s: float | None = None  # slowest one-position step of late
        self.position_s: float | None = None  # slowest per-position time of a prefill of late

    def record(self, positions: int, elapsed: float) -> None:
        if positions == 1:
            self.decode_s = max(elapsed, (self.decode_s or 0.0) * PACE_DECAY)
        else:
            self.position_s = max(elapsed / positions, (self.position_s or 0.0) * PACE_DECAY)

    def stall_after(self, positions: int) -> float | None:
        """Seconds after which a step of `positions` counts as lost; None: no steps seen yet
        to judge by (the request's timeout applies alone)."""
        if positions == 1:
            expected = self.decode_s
        elif self.position_s is None:
            return None
        else:
            expected = (self.decode_s or 0.0) + positions * self.position_s
        return None if expected is None else max(STALL_MIN_S, STALL_FACTOR * expected)


@dataclass
class Peer:
    """Another coordinator of this plant (MQTT 5 shared subscription), from its status."""

    online: bool
    bdseq: int
    drain: asyncio.Task[None] | None = None  # serving its session while it is offline


class Coordinator:
    """Serves gateway requests through the plant's stages."""

    def __init__(self, plant: Plant, tokenizer: Tokenizer | None = None, *,
                 batch_groups: int | None = None, instance: str | None = None,
                 journal_dir: Path | None = None) -> None:
        self.plant = plant
        self.spec = plant.coordinator
        self.liveness = plant.liveness
        self.topics = plant.topics
        self.pipeline = plant.pipeline
        self.agent_id = self.spec.id if not instance else check_level(
            f"{self.spec.id}.{instance}", "coordinator instance")
        self.mqtt5 = plant.endpoint_for(self.spec.id).protocol == "5"
        # Several coordinators (coordinator.instances) take requests from one
        # MQTT 5 shared subscription: the broker hands each request to one of them.
        self.shared = bool(self.spec.instances)
        if instance and instance not in self.spec.instances:
            raise EdgebusError(
                f"coordinator instance {instance!r} is not in the plant file's "
                f"coordinator.instances {self.spec.instances}: add it there, on every box")
        if self.shared and not self.mqtt5:
            raise EdgebusError(
                f"coordinator.instances {self.spec.instances}: several coordinators share the "
                "requests through an MQTT 5 shared subscription, and this plant's broker speaks "
                "MQTT 3.1.1 (the embedded amqtt broker does). Run one coordinator, or use "
                'Mosquitto with broker.protocol: "5"')
        # A lone coordinator keeps a plain subscription: Mosquitto 2.0 restores it
        # from its database after a restart, a shared one it does not (measured).
        self.request_filter = (f"$share/{plant.plant_id}-{self.spec.id}/"
                               f"{self.topics.request_filter}" if self.shared
                               else self.topics.request_filter)
        # A plant all on llama.cpp may run on boxes without transformers (docs/deploy.md).
        llamacpp_only = all(resolve_engine(spec.engine, spec.weights) == "llamacpp"
                            for spec in plant.stages)
        self.tokenizer = tokenizer or load_tokenizer(plant.model, transformers=not llamacpp_only)
        self.eos_ids = _eos_ids(plant, self.tokenizer)
        config = load_config(plant.model)
        self.vocab_size: int = config.vocab_size
        self.limits = frames.coordinator_limits(vocab=config.vocab_size,
                                                max_in_flight=self.spec.max_in_flight,
                                                stages=len(self.pipeline))
        self.kv = {spec.node: kv_reservation(plant, spec.node, config) for spec in plant.stages}
        # See _feed_sizes: replays on llama.cpp must group positions as they were first fed.
        self.replay_as_fed = any(resolve_engine(spec.engine, spec.weights) == "llamacpp"
                                 for spec in plant.stages)
        self.health = {spec.node: NodeHealth() for spec in plant.stages}
        self._ready = asyncio.Event()  # every stage has a live node
        self._changed = asyncio.Event()  # replaced on every change of `health`
        self._active: dict[int, Generation] = {}
        self._by_key: dict[tuple[str, str], Generation] = {}  # (client, id): for cancels
        self._answers: collections.OrderedDict[tuple[str, str], asyncio.Future[GenerateResponse]]
        self._answers = collections.OrderedDict()
        self._answer_bytes: dict[tuple[str, str], int] = {}  # of answered ones (DEDUP_BYTES)
        self._held = 0  # their sum
        self._per_client: collections.Counter[str] = collections.Counter()  # requests in flight
        # Tokenizing a 256 KiB prompt takes a good fraction of a second: on the event
        # loop it would hold up every other request's step. One thread: requests being
        # admitted are few (the broker's in-flight window) and wait their turn. The
        # loop decodes with the same tokenizer meanwhile: a fast tokenizer without
        # truncation or padding set is only read by both (8 s of both at once with
        # SmolLM2's: no error). A first encode clears what a tokenizer file sets of
        # them, a write, so it happens here, before any thread shares the tokenizer.
        self.tokenizer("")
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="coordinator-tokenize")
        # Every task this agent starts: at most max_in_flight requests being served,
        # the broker's in-flight window of requests being admitted (they are
        # acknowledged only once journaled or answered), and a few of its own.
        self._tasks: set[asyncio.Task[None]] = set()
        self._outbox = Outbox(batch_groups or len(self.pipeline), self._publish_frames,
                              self._stepping, max_frames=self.limits.max_frames)
        self._pace = Pace()
        self._decoder = ThreadPoolExecutor(1, thread_name_prefix="coordinator-decode")
        self.journal = Journal(journal_dir or default_directory(
            plant.plant_id, plant.topic_root, self.agent_id))
        self._journal_lock = JournalLock(self.journal.directory)
        self._journal_lock.acquire()  # released when serve() ends
        self._resume = self.journal.open()  # what a previous run left unanswered
        self._peers: dict[str, Peer] = {}
        self.counters = {"tokens": 0.0, "requests_done": 0.0, "failovers": 0.0,
                         "recoveries": 0.0, "resumed": 0.0, "drained": 0.0, "cancelled": 0.0,
                         "drafts_proposed": 0.0, "drafts_accepted": 0.0,
                         "drafts_rejected": 0.0, "draft_runs": 0.0}
        self.bus = BusClient(
            plant.endpoint_for(self.spec.id), f"{plant.plant_id}.{self.agent_id}",
            # Cancels are not shared: every coordinator hears them, the one serving acts.
            subscriptions=[(self.request_filter, 1), (self.topics.status_filter, 1),
                           (self.topics.activations(self.spec.id), 1),
                           (self.topics.cancel_filter, 1)],
            presence=presence(self.topics, self.agent_id, "coordinator", metrics=lambda: {
                **self.counters, "in_flight": float(len(self._active)),
                "statuses_dropped": float(self._statuses.dropped),
                **self.bus.metrics()}),
            # Requests published while the coordinator is down wait in the broker,
            # and one is acknowledged only once it is journaled (or answered).
            persistent=True, manual_ack=True, on_connect=[self._on_connect])
        self.reporter = Reporter(self.bus, self.topics, self.agent_id)
        self._statuses = StatusReader(functools.partial(self.reporter.report, "warning"))

    async def serve(self, stop: asyncio.Event) -> None:
        for entry in self._resume:  # first, so redeliveries of these find them in flight
            self.counters["resumed"] += 1
            self._spawn(self._serve_request(entry.client, entry.payload, entry.response_topic,
                                            entry.correlation, ack=_nothing, resumed=entry))
        self._resume = []
        try:
            await serve_until(stop, self.bus, self._on_message, self._watch_heartbeats(),
                              *sparkplug_node(self.plant, self.agent_id, self.bus,
                                              identity=self.spec.id, health=self.health),
                              heartbeat_s=self.liveness.heartbeat_s)
        finally:
            for task in list(self._tasks):
                task.cancel()
            for peer in self._peers.values():
                if peer.drain is not None:
                    peer.drain.cancel()
            self._decoder.shutdown(wait=False, cancel_futures=True)
            self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
            self._journal_lock.release()

    # -- dispatch (event loop, must not block) -----------------------------------

    def _on_message(self, message: aiomqtt.Message) -> None:
        topic = message.topic.value
        payload = message.payload if isinstance(message.payload, bytes) else b""
        if topic == self.topics.activations(self.spec.id):
            self._on_result(payload)
        elif self.topics.client_of_request_topic(topic) is not None:
            self._on_request(message, self.bus)
        elif (client := self.topics.client_of_cancel_topic(topic)) is not None:
            self._on_cancel(client, payload)
        elif (agent := self.topics.agent_of_status_topic(topic)) is not None:
            self._on_status(agent, payload, retained=bool(message.retain))

    def _on_request(self, message: aiomqtt.Message, bus: BusClient) -> None:
        """Serve a request that came in on `bus` (ours, or a dead peer's session we drain)."""
        client = self.topics.client_of_request_topic(message.topic.value)
        if client is None:
            return
        payload = message.payload if isinstance(message.payload, bytes) else b""
        properties = message.properties
        # Acknowledged once journaled, else when its task ends, whatever its fate.
        self._track(bus.take(message, lambda ack: self._serve_request(
            client, payload, getattr(properties, "ResponseTopic", None) if properties else None,
            getattr(properties, "CorrelationData", None) if properties else None, ack=ack,
            retained=bool(message.retain))))

    def _on_cancel(self, client: str, payload: bytes) -> None:
        """End `client`'s request before its next step; its answer says `cancelled`.
        A cancel for a request not in flight (answered, or never seen) has nothing to do."""
        try:
            rid = CancelRequest.model_validate_json(payload).id
        except ValueError as exc:
            self.reporter.report("error", f"bad cancel from {client}: {exc}")
            return
        gen = self._by_key.get((client, rid))
        if gen is not None:
            gen.cancelled = True

    def _on_result(self, payload: bytes) -> None:
        try:
            peeks = frames.scan(payload, self.limits)
        except frames.BadTail as exc:
            self.reporter.report("error", f"dropped a result frame: {exc}")
            peeks = exc.peeks
        except frames.BatchError as exc:
            self.reporter.report("error", f"refused a result message: {exc}")
            return
        if not peeks:
            return
        if len(payload) < DECODE_INLINE_BYTES and not any(p.compressed for p in peeks):
            try:
                self._dispatch(frames.decode_scanned(payload, peeks))
            except frames.BatchError as exc:
                self.reporter.report("error", f"dropped a result frame: {exc}")
                self._dispatch(exc.good)
            return
        decoding = asyncio.get_running_loop().run_in_executor(
            self._decoder, frames.decode_scanned, payload, peeks)
        decoding.add_done_callback(self._decoded)

    def _decoded(self, decoding: asyncio.Future[list[Frame]]) -> None:
        if decoding.cancelled():
            return
        error = decoding.exception()
        if isinstance(error, frames.BatchError):
            self.reporter.report("error", f"dropped a result frame: {error}")
            self._dispatch(error.good)
        elif error is None:
            self._dispatch(decoding.result())

    def _dispatch(self, results: list[Frame]) -> None:
        for frame in results:
            gen = self._active.get(frame.request)
            if gen is None or frame.epoch != gen.epoch:
                continue  # a request that ended, or an old route
            drafts = gen.drafts
            if (drafts is not None and frame.step != gen.step
                    and any(d.step == frame.step for d in drafts.ahead)):
                # A draft's result, back before its token was sampled: kept for then.
                drafts.arrived[frame.step] = frame
                continue
            # Stale results (a rejected draft, a duplicate) are dropped.
            if frame.step != gen.step or gen.result is None or gen.result.done():
                continue
            self._resolve(gen, gen.result, frame)

    def _resolve(self, gen: Generation, result: asyncio.Future[Frame], frame: Frame) -> None:
        """Hand the result `frame` of `gen`'s awaited step to its task."""
        if frame.kind == Kind.CANDIDATES:
            if len(frame.shape) != 2 or frame.shape[0] != 1 or frame.shape[1] < 1:
                self.reporter.report("error", f"dropped a result of shape {frame.shape} "
                                     f"for request {gen.request.id}: not [1, k]")
                return
            result.set_result(frame)
        elif frame.kind == Kind.ERROR and frame.retry:
            result.set_exception(_Recover(frame.text(), busy=frame.busy))
        elif frame.kind == Kind.ERROR:
            result.set_exception(RequestError("stage_error", frame.text()))

    # -- liveness ------------------------------------------------------------------

    def _is_coordinator(self, agent: str) -> bool:
        """Whether `agent` is this plant's coordinator or one of its declared instances."""
        instance = agent.removeprefix(f"{self.spec.id}.")
        return agent == self.spec.id or (instance != agent and instance in self.spec.instances)

    def _on_status(self, agent: str, payload: bytes, *, retained: bool) -> None:
        """The status of `agent`, the agent its topic names: one whose payload names another
        agent or role is dropped (edgebus/core/statuses.py), so an identity speaks only for
        itself."""
        role: Role
        if self._is_coordinator(agent):
            role = "coordinator"
        elif agent in self.health:
            role = "stage"
        else:
            return  # an agent of another plant file
        status = self._statuses.read(agent, payload, role)
        if status is None:
            return
        if role == "coordinator":
            self._on_peer_status(agent, status)
            return
        node = self.health[agent]
        now = time.monotonic()
        # A retained status may be old: it is as fresh as its timestamp says.
        age = max(0.0, time.time() - status.ts) if retained else 0.0
        session = (status.host, status.pid, status.bdseq)
        if status.state == "offline":
            # A Will delivered late, after the node's next birth, is about a
            # session already replaced: bdseq only grows (Sparkplug's bdSeq).
            if node.session is None or status.bdseq >= node.session[2]:
                self._set_alive(agent, False, "went offline")
            return
        if now - age > node.seen:
            node.seen = now - age
        if node.session is not None and session != node.session:
            # A new MQTT session: its subscription lapsed in between, so frames
            # sent to it meanwhile are gone; a new process has no caches at all.
            self._fail_over(agent, "reconnected")
        node.session = session
        self._set_alive(agent, now - node.seen < self.liveness.timeout_s, "is stale")

    async def _watch_heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.liveness.heartbeat_s / 2)
            now = time.monotonic()
            for node_id, node in self.health.items():
                if node.alive and now - node.seen > self.liveness.timeout_s:
                    self._set_alive(node_id, False, f"sent no heartbeat for "
                                                    f"{now - node.seen:.1f} s")

    def _set_alive(self, node_id: str, alive: bool, why: str) -> None:
        node = self.health[node_id]
        if node.alive == alive:
            return
        node.alive = alive
        self.reporter.report("join" if alive else "leave",
                             f"stage node {node_id} {'is online' if alive else why}")
        if not alive:
            self._fail_over(node_id, why)
        if all(any(self.health[n].alive for n in stage.node_ids) for stage in self.pipeline):
            self._ready.set()
        else:
            self._ready.clear()
        self._wake_routes()

    def _wake_routes(self) -> None:
        """Requests waiting for a route look again: a node came or went, or KV room freed."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _fail_over(self, node_id: str, why: str) -> None:
        """Replay every request whose route runs through `node_id`."""
        for gen in self._active.values():
            if node_id in gen.nodes:
                self._lose(gen, f"node {node_id} {why}")

    # -- other coordinators (MQTT 5) ---------------------------------------------------

    def _on_peer_status(self, peer_id: str, status: AgentStatus) -> None:
        """Track the plant's other coordinators; serve a dead one's session until it is back.

        With a shared subscription the broker hands requests to every member's
        session, a dead member's too (Mosquitto 2.0 does: measured), and there
        they would wait for its restart. So when one goes offline (its Will, or
        its clean exit) another takes its session over: it connects with that
        coordinator's client id and serves what the broker holds there. The
        coordinator coming back takes its session back (the broker ends ours).
        """
        if not self.shared or peer_id == self.agent_id:
            return
        peer = self._peers.setdefault(peer_id, Peer(online=False, bdseq=0))
        if status.bdseq < peer.bdseq:
            return  # the late Will of a session already replaced
        peer.bdseq = status.bdseq
        peer.online = status.state == "online"
        if peer.online and peer.drain is not None:
            peer.drain.cancel()
            peer.drain = None
        elif not peer.online and peer.drain is None:
            peer.drain = asyncio.ensure_future(self._drain(peer_id, peer))

    async def _drain(self, peer_id: str, peer: Peer) -> None:
        """Serve the requests the broker holds in `peer_id`'s session while it is offline."""
        while not peer.online:
            self.reporter.report("warning", f"coordinator {peer_id} is offline: "
                                 f"{self.agent_id} serves the requests the broker holds for it")
            drain = BusClient(self.plant.endpoint_for(self.spec.id),
                              f"{self.plant.plant_id}.{peer_id}",
                              subscriptions=[(self.request_filter, 1)], persistent=True,
                              manual_ack=True, reconnect=False)
            await drain.run(functools.partial(self._on_drained, drain=drain))
            # The connection ended: the peer took its session back (its status
            # follows at once), or the broker went away. Look again after a while.
            await asyncio.sleep(self.liveness.timeout_s)
        peer.drain = None

    def _on_drained(self, message: aiomqtt.Message, *, drain: BusClient) -> None:
        if self.topics.client_of_request_topic(message.topic.value) is not None:
            self.counters["drained"] += 1
            self._on_request(message, drain)

    def _on_connect(self) -> None:
        # Every connect, not only the first: a restarted broker may have lost
        # the retained plan.
        self._spawn(publish_plan(self.bus, self.plant))
        # Frames in flight when the connection dropped may be gone (a broker
        # restart loses them): replay every request.
        for gen in self._active.values():
            if gen.route:
                self._lose(gen, "the coordinator reconnected to the broker")

    def _lose(self, gen: Generation, why: str) -> None:
        gen.lost = why
        if gen.result is not None and not gen.result.done():
            gen.result.set_exception(_Lost(why))

    def _spawn(self, coro: object) -> asyncio.Task[None]:
        return self._track(asyncio.ensure_future(coro))  # type: ignore[call-overload]

    def _track(self, task: asyncio.Task[None]) -> asyncio.Task[None]:
        """Keep `task` among this agent's, cancelled when it stops."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- one request -----------------------------------------------------------

    async def _serve_request(self, client: str, payload: bytes, response_topic: str | None,
                             correlation: bytes | None, *, ack: Callable[[], None],
                             resumed: Entry | None = None, retained: bool = False) -> None:
        """Answer one request message. `ack` acknowledges it to the broker once it is
        journaled (BusClient.take acknowledges it when this ends, if not before);
        `resumed`: its entry, if it comes from the journal; `retained`: the broker
        delivered it as a retained message."""
        received = time.perf_counter()
        try:
            request = apply_task(parse_request(payload), self.plant.tasks)
            if retained:
                # The broker hands a retained message to every new subscription: served,
                # it would be generated again after every restart of the coordinator.
                raise RequestError("retained", f"request {request.id} was published retained, "
                                   "so the broker delivers it again on every subscription: "
                                   "publish requests with retain false, and clear this one "
                                   "with an empty retained message to "
                                   f"{self.topics.request(client)}")
        except RequestError as exc:
            rid = salvage_id(payload)
            self.reporter.report("error", f"bad request from {client}: {exc.message}", rid)
            if rid is not None:
                reply, _ = self._reply_route(client, rid, response_topic, correlation)
                await self._refuse(reply, _error_response(rid, exc), resumed)
            elif resumed is not None:  # no id to answer: still, never again
                await asyncio.to_thread(self.journal.remove, resumed.client, resumed.request_id)
            return
        reply, refused = self._reply_route(client, request.id, request.reply_to or response_topic,
                                           correlation)
        if refused is not None:
            self.reporter.report("error", f"request {request.id} from {client}: "
                                 f"{refused.message}", request.id)
            await self._refuse(reply, _error_response(request.id, refused), resumed)
            return
        key = (client, request.id)
        answer = self._answers.get(key)
        if answer is not None:
            # Sent again (QoS 1, a gateway's retry, or the broker's copy of a
            # journaled request): one generation, one answer. Once answered,
            # the same answer again, for a gateway that may have missed it.
            if answer.done():
                self._respond(reply, answer.result())
            return
        answer = self._answers[key] = asyncio.get_running_loop().create_future()
        # The seed is journaled with the request: a resumed request that samples
        # draws the same tokens again, so the deltas a gateway has already
        # streamed stay a prefix of its answer (docs/failover.md).
        seed = (request.seed if request.seed is not None
                else resumed.seed if resumed is not None and resumed.seed is not None
                else secrets.randbits(63))
        entry = Entry(client, request.id, payload, response_topic, correlation, seed)
        journaled = False

        async def admitted() -> None:
            nonlocal journaled
            journaled = await self._journal(request, entry, ack, resumed=resumed is not None)

        if resumed:  # requests came in while the broker is still out of reach
            await self.bus.wait_connected()
        try:
            response = await self._generate(request, reply, received, admitted, key, seed,
                                            resumed=resumed is not None)
        except RequestError as exc:
            if exc.code == "cancelled":  # the gateway's wish, not a fault
                self.counters["cancelled"] += 1
            else:
                self.reporter.report("error", f"request {request.id} from {client}: "
                                     f"{exc.message}", request.id)
            response = _error_response(request.id, exc)
        except Exception as exc:  # a bug must still answer the gateway, never leave it waiting
            log.exception("request %s from %s failed", request.id, client)
            response = _error_response(request.id, RequestError(
                "internal", f"the coordinator failed: {type(exc).__name__}: {exc}"))
        answer.set_result(response)
        if self._answers.get(key) is answer:
            if response.error is not None and response.error.code in RETRY_LATER:
                del self._answers[key]
            else:
                self._remember(key, response)
        await self._deliver(reply, response)
        if journaled or resumed:
            # Only now: killed before the answer was out, the next run answers it.
            await asyncio.to_thread(self.journal.remove, client, request.id)

    async def _refuse(self, reply: ReplyRoute, response: GenerateResponse,
                      resumed: Entry | None) -> None:
        """Answer a request refused before it was admitted.

        A resumed one (its task renamed, or security turned on, since it was
        journaled) would be refused again at every start: it is answered once,
        delivered, then removed from the journal.
        """
        if resumed is None:
            self._respond(reply, response)
            return
        await self.bus.wait_connected()
        await self._deliver(reply, response)
        await asyncio.to_thread(self.journal.remove, resumed.client, resumed.request_id)

    def _remember(self, key: tuple[str, str], response: GenerateResponse) -> None:
        """Count `key`'s answer against DEDUP_BYTES; forget the oldest answers past it."""
        self._answer_bytes[key] = _held_bytes(response)
        self._held += self._answer_bytes[key]
        if self._held <= DEDUP_BYTES:
            return
        for old in list(self._answers):
            if self._held <= DEDUP_BYTES:
                break
            if (size := self._answer_bytes.pop(old, None)) is not None:  # in flight: kept
                del self._answers[old]
                self._held -= size

    async def _journal(self, request: GenerateRequest, entry: Entry, ack: Callable[[], None], *,
                       resumed: bool) -> bool:
        """Journal an admitted request, then acknowledge it; return whether it was journaled.

        A journal that cannot be written (a full or read-only disk) does not
        stop the request: it is served, and an error says it would not survive
        a restart.
        """
        if resumed:
            return False
        try:
            await asyncio.to_thread(self.journal.add, entry)
        except OSError as exc:
            self.reporter.report("error", f"request {request.id} is served but not journaled "
                                 f"({exc}): it would be lost if the coordinator died. Make "
                                 f"{self.journal.directory} writable (EDGEBUS_HOME)", request.id)
            return False
        finally:
            ack()
        return True

    def _reply_route(self, client: str, request_id: str, asked: str | None,
                     correlation: bytes | None) -> tuple[ReplyRoute, RequestError | None]:
        """Where to answer: the topic the request asked for, else the client's own.

        With `security:` on, the broker lets the coordinator publish answers only
        under the client's response topics; an answer sent elsewhere would be
        dropped by the broker without a word, so such a request is refused instead.
        """
        own = self.topics.response(client, request_id)
        mine = self.topics.response_filter(client).removesuffix("#")
        if asked is not None and self.plant.security is not None and not asked.startswith(mine):
            return ReplyRoute(own, correlation), RequestError(
                "reply_to", f"with broker security on, answers can only go to topics under "
                f"{mine}: leave reply_to and the MQTT 5 response topic unset")
        return ReplyRoute(asked or own, correlation), None

    async def _generate(self, request: GenerateRequest, reply: ReplyRoute, received: float,
                        admitted: Callable[[], Awaitable[None]], key: tuple[str, str],
                        seed: int, *, resumed: bool = False) -> GenerateResponse:
        """Check the request against the plant's limits, `await admitted()`, then generate.

        A resumed request (from the journal) was admitted before the restart:
        the admission limit does not apply to it again.
        """
        spec = self.spec
        if request.max_tokens > spec.max_tokens_limit:
            raise RequestError("max_tokens", f"max_tokens {request.max_tokens} exceeds this "
                               f"plant's limit of {spec.max_tokens_limit}")
        if request.top_k > self.vocab_size:
            raise RequestError("top_k", f"top_k {request.top_k} exceeds the model's vocabulary "
                               f"of {self.vocab_size} tokens: use at most {self.vocab_size}, "
                               "or 0 for no top-k cut")
        if not resumed:  # before tokenizing too: a refused prompt costs nothing
            self._check_admission(key[0])
        ids = await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_thread, prompt_ids, self.tokenizer, request)
        if not resumed:
            self._check_admission(key[0])
        if not ids or len(ids) > spec.max_prompt_tokens:
            raise RequestError("prompt_length", f"prompt is {len(ids)} tokens; it must be "
                               f"1..{spec.max_prompt_tokens}")
        gen = Generation(request, reply, history=list(ids), max_len=len(ids) + request.max_tokens,
                         prompt_len=len(ids))
        if spec.speculation.drafts:
            gen.drafts = Drafts(spec.speculation)
        self._check_fits(gen)
        self._active[gen.seq] = gen  # no await since the checks: the admission count holds
        self._by_key[key] = gen
        self._per_client[key[0]] += 1
        rng = np.random.default_rng(seed)
        k = candidates_wanted(request.temperature, request.top_k, spec.candidates)
        text = TextStream(self.tokenizer, request.stop) if request.stream or request.stop else None
        tokens: list[int] = []
        ttft: float | None = None
        finish: str = "length"
        try:
            await admitted()
            while True:
                result = await self._step(gen, candidates=k)
                cand_ids, cand_logits = result.candidates_arrays()
                token = sample_token(cand_ids[0], cand_logits[0], temperature=request.temperature,
                                     top_k=request.top_k, top_p=request.top_p, rng=rng)
                ttft = ttft if ttft is not None else time.perf_counter() - received
                tokens.append(token)
                if text is not None:
                    delta = text.add(token)
                    if delta and request.stream:
                        self._stream(gen, len(tokens) - 1, delta)
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
            del self._active[gen.seq]
            self._by_key.pop(key, None)
            self._per_client[key[0]] -= 1
            if not self._per_client[key[0]]:
                del self._per_client[key[0]]
            self._unroute(gen)
            self.counters["tokens"] += len(tokens)
            self.counters["requests_done"] += 1
            usage = self._drafting_done(gen)
        if text is not None:
            rest = text.flush()
            if rest and request.stream:
                self._stream(gen, len(tokens), rest)
            out_text = text.text
        else:
            out_text = decode(self.tokenizer, tokens)
        total = time.perf_counter() - received
        return GenerateResponse(
            id=request.id, text=out_text, tokens=tokens, finish_reason=finish,  # type: ignore[arg-type]
            usage=Usage(prompt_tokens=len(ids), completion_tokens=len(tokens)),
            timings=Timings(ttft_ms=None if ttft is None else ttft * 1e3, total_ms=total * 1e3),
            speculation=usage)

    def _drafting_done(self, gen: Generation) -> SpeculationUsage | None:
        """Count what drafting did for a request that ended; drafts still in flight were
        never reached, and count as rejected."""
        drafts = gen.drafts
        if drafts is None:
            return None
        drafts.forget()
        usage = SpeculationUsage(proposed=drafts.proposed, accepted=drafts.accepted,
                                 rejected=drafts.rejected, runs=drafts.runs)
        for name in ("proposed", "accepted", "rejected"):
            self.counters[f"drafts_{name}"] += getattr(usage, name)
        self.counters["draft_runs"] += usage.runs
        return usage

    def _check_admission(self, client: str) -> None:
        """Refuse a request past max_in_flight, or past its gateway's share of it."""
        spec = self.spec
        if len(self._active) >= spec.max_in_flight:
            raise RequestError("busy", f"{len(self._active)} requests in flight, the limit is "
                               f"{spec.max_in_flight}: retry later")
        if self._per_client[client] >= spec.client_limit:
            raise RequestError("busy", f"gateway {client} has {self._per_client[client]} "
                               "requests in flight, its share of the plant's max_in_flight "
                               f"{spec.max_in_flight} is {spec.client_limit} "
                               "(coordinator.max_in_flight_per_client): retry later")

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
                await self._route(gen)
            gen.result = result = asyncio.get_running_loop().create_future()
            positions = len(gen.history) - gen.synced
            self._feed(gen, candidates)
            if gen.drafts is not None and (early := gen.drafts.arrived.pop(gen.step, None)):
                self._resolve(gen, result, early)
            sent = time.monotonic()
            stall = self._pace.stall_after(positions) or timeout * COLD_STALL_SHARE
            # Each replay for a stall doubles the next wait: a pipeline that is
            # merely slow, not losing frames, is soon waited for long enough.
            wait = min(timeout, stall * 2 ** gen.recoveries)
            try:
                async with asyncio.timeout(wait):
                    frame = await gen.result
            except _Lost:
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
            self._pace.record(positions, time.monotonic() - sent)
            gen.synced = len(gen.history)
            gen.refusals, gen.refused_since = 0, None
            return frame

    async def _recover(self, gen: Generation, why: str, *, busy: bool = False) -> None:
        """Replay `gen` after a backoff: MAX_RECOVERIES times at most for frames lost or bad,
        and for frames a full stage refused until request_timeout_s has passed."""
        self.counters["recoveries"] += 1
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
        first = self.pipeline[0].nodes[gen.route[0]].node
        todo, start = gen.history[gen.synced:], gen.synced
        if gen.synced and len(todo) == 1:  # a decode step
            if gen.drafts is not None and (gen.drafts.ahead or self._may_draft()):
                self._feed_drafting(gen, gen.drafts, first, candidates)
                return
            gen.step = gen.new_step()
            self._outbox.step(gen.seq, first, frames.encode(
                Kind.TOKENS, np.array([todo]), gen.header(), start=start,
                candidates=candidates))
            return
        gen.step = gen.new_step()
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

    def _may_draft(self) -> bool:
        """Whether drafts would fill idle stages: few enough requests are in flight."""
        return len(self._active) <= self.spec.speculation.max_in_flight

    def _feed_drafting(self, gen: Generation, drafts: Drafts, first: str,
                       candidates: int) -> None:
        """The decode step of a request that drafts: its token, unless a draft already
        carries it, then new drafts to keep `drafts.window` in flight.

        Each frame leaves as a message of its own, at once, outside the groups: a stage
        computes a message's rows as one batch, and the drafts must follow their
        token one position at a time, in order (node_agent/speculation.py).
        """
        token, position = gen.history[-1], len(gen.history) - 1
        rolling_back = drafts.rolling_back
        carried = drafts.settle(token)
        if carried is not None:
            gen.step = carried
        else:
            self._outbox.leave(gen.seq)  # its frames now leave in order, outside a group
            gen.step = gen.new_step()
            drafts.runs += 1
            self._publish_frames(first, frames.encode(
                Kind.TOKENS, np.array([[token]]), gen.header(), start=position,
                candidates=candidates, rollback=rolling_back))
        if not self._may_draft():
            return
        text = [*gen.history, *(d.token for d in drafts.ahead)]
        # The last position a frame of this request may need: its KV reservation's end.
        room = gen.max_len - 1 - len(text)
        for token in drafts.propose(text, room):
            step = gen.new_step()
            drafts.ahead.append(Draft(step, token))
            self._publish_frames(first, frames.encode(
                Kind.TOKENS, np.array([[token]]), gen.header(step), start=len(text),
                candidates=candidates))
            text.append(token)

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

    # -- routes --------------------------------------------------------------------

    def _check_fits(self, gen: Generation) -> None:
        """Refuse a request no route has KV room for: too long for any node, or busy."""
        for stage in self.pipeline:
            needs = [self.kv[n].need(gen.max_len) for n in stage.node_ids]
            if all(need > self.kv[n].budget for n, need in zip(stage.node_ids, needs,
                                                                strict=True)):
                raise RequestError("too_long", f"{gen.max_len} positions need "
                                   f"{min(needs) / 2**20:.1f} MiB of KV cache on stage "
                                   f"{stage.index}, more than its nodes' kv_budget_mb: lower "
                                   "max_tokens or the prompt")
            if all(self.health[n].held + need > self.kv[n].budget
                   for n, need in zip(stage.node_ids, needs, strict=True)):
                raise RequestError("busy", f"the KV budget of every node of stage "
                                   f"{stage.index} is taken by requests in flight: retry later")

    def _pick(self, gen: Generation) -> tuple[int, ...] | str:
        """The least loaded live route with KV room for `gen`, or why there is none."""
        route: list[int] = []
        for stage in self.pipeline:
            live = [r for r, n in enumerate(stage.node_ids) if self.health[n].alive]
            if not live:
                return (f"stage {stage.index} (layers {list(stage.layers)}) has no live node: "
                        f"{', '.join(stage.node_ids)} offline. Start a node of it (`edgebus "
                        "node PLANT --id NODE`) or check its box")
            room = [r for r in live if self.health[node := stage.node_ids[r]].held
                    + self.kv[node].need(gen.max_len) <= self.kv[node].budget]
            if not room:
                return (f"the live nodes of stage {stage.index} have no KV budget left: "
                        "retry later, or raise their kv_budget_mb")
            route.append(min(room, key=lambda r: self.health[stage.node_ids[r]].held))
        return tuple(route)

    async def _route(self, gen: Generation) -> None:
        """Put `gen` on a live route under a new epoch, waiting a bounded time for one."""
        replay = gen.lost
        self._unroute(gen)
        deadline = time.monotonic() + self.liveness.stage_wait_s
        while isinstance(route := self._pick(gen), str):
            changed = self._changed
            try:
                async with asyncio.timeout(deadline - time.monotonic()):
                    await changed.wait()
            except TimeoutError:
                raise RequestError("unavailable", f"waited {self.liveness.stage_wait_s:.0f} s: "
                                   f"{route}") from None
        gen.route, gen.epoch, gen.synced, gen.lost = route, gen.epoch + 1, 0, None
        gen.nodes = [stage.nodes[r].node for stage, r in zip(self.pipeline, route, strict=True)]
        for node_id in gen.nodes:
            self.health[node_id].held += self.kv[node_id].need(gen.max_len)
        if replay is not None:
            self.counters["failovers"] += 1
            self.reporter.report("warning", f"replaying {len(gen.history)} positions of "
                                 f"request {gen.request.id} on {', '.join(gen.nodes)} "
                                 f"({replay})", gen.request.id)

    def _unroute(self, gen: Generation) -> None:
        """Give back `gen`'s KV reservations and let its route's nodes free the caches."""
        self._outbox.leave(gen.seq)
        if not gen.route:
            return
        release = frames.encode_release(gen.header())
        for node_id in gen.nodes:
            self.health[node_id].held -= self.kv[node_id].need(gen.max_len)
            self._outbox.send(node_id, release)
        gen.route, gen.nodes = (), []
        self._wake_routes()

    def _publish_frames(self, node_id: str, message: bytes) -> None:
        self.bus.send(self.topics.activations(node_id), message)

    def _stepping(self, seq: int) -> bool:
        gen = self._active.get(seq)
        return gen is not None and gen.result is not None and not gen.result.done()

    # -- output ------------------------------------------------------------------

    # Sent without waiting for PUBACKs: a request's deltas and response leave
    # in order, and the token loop goes on at once (the next token of every
    # request in a batch leaves in one message, see node_agent/groups.py).

    def _stream(self, gen: Generation, index: int, delta: str) -> None:
        msg = StreamDelta(id=gen.request.id, index=index, delta=delta)
        self.bus.send(gen.reply.stream_topic, msg.model_dump_json(),
                      properties=_correlation(gen.reply))

    def _respond(self, reply: ReplyRoute, response: GenerateResponse) -> None:
        self.bus.send(reply.topic, response.model_dump_json(), properties=_correlation(reply))

    async def _deliver(self, reply: ReplyRoute, response: GenerateResponse) -> None:
        """Publish a final answer and wait for the broker's acknowledgement, across outages:
        the request leaves the journal only after this."""
        while True:
            try:
                await self.bus.publish(reply.topic, response.model_dump_json(),
                                       properties=_correlation(reply))
                return
            except BusError as exc:
                log.warning("answer to %s not delivered yet (%s); waiting for the broker",
                            reply.topic, exc)
                await self.bus.wait_connected()


def _nothing() -> None:
    """The acknowledgement of a request that needs none (resumed from the journal)."""


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


def _held_bytes(response: GenerateResponse) -> int:
    """About what remembering `response` costs in memory (DEDUP_BYTES): a character
    takes up to 4 bytes in a Python str."""
    text = len(response.text) + (len(response.error.message) if response.error else 0)
    return DEDUP_ENTRY_BYTES + 4 * text + DEDUP_TOKEN_BYTES * len(response.tokens)


def _error_response(request_id: str, exc: RequestError) -> GenerateResponse:
    return GenerateResponse(id=request_id, finish_reason="error",
                            error=ErrorInfo(code=exc.code, message=exc.message))


def _correlation(route: ReplyRoute) -> Properties | None:
    if route.correlation is None:
        return None
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.CorrelationData = route.correlation
    return props


def _eos_ids(plant: Plant, tokenizer: Tokenizer) -> set[int]:
    """The ids `generate` stops on: generation_config's eos, else the tokenizer's."""
    eos = generation_eos(plant.model)
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())


def run_coordinator(plant: Plant, batch_groups: int | None = None,
                    instance: str | None = None) -> None:
    """`edgebus coordinator PLANT`: serve requests until SIGTERM.

    `instance` (default: $EDGEBUS_INSTANCE) names this coordinator when several
    serve one plant at once: one of the plant file's coordinator.instances. The
    coordinator without one is the plant's first.
    """
    instance = instance or os.environ.get(INSTANCE_ENV) or None

    async def main(stop: asyncio.Event) -> None:
        await Coordinator(plant, batch_groups=batch_groups, instance=instance).serve(stop)

    run_agent(main)
