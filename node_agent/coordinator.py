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
the same as without the fault. Frames of the old epoch are ignored.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time
from dataclasses import dataclass, field

import aiomqtt
import numpy as np
import torch
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from edgebus import frames
from edgebus.client import BusClient
from edgebus.errors import RequestError
from edgebus.frames import Frame, Header, Kind
from edgebus.messages import (
    AgentStatus,
    ErrorInfo,
    Event,
    GenerateRequest,
    GenerateResponse,
    StreamDelta,
    Timings,
    Usage,
    parse_request,
    salvage_id,
)
from node_agent.groups import Outbox
from node_agent.kv_cache import kv_bytes_per_token
from node_agent.runtime import presence, publish_event, publish_plan, run_agent, serve_until
from node_agent.sampling import candidates_wanted, sample_token
from node_agent.text import TextStream, decode, prompt_ids
from plant_config import Plant

log = logging.getLogger(__name__)

# Requests remembered by (client, id), so a QoS 1 redelivery gets the first
# answer again instead of a second generation. A gateway redelivers within
# seconds; 4096 covers minutes of a busy plant at a few KB each.
DEDUP_WINDOW = 4096


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


@dataclass
class Generation:
    """One request in flight, and where its KV caches live."""

    request: GenerateRequest
    reply: ReplyRoute
    history: list[int]  # prompt ids, then every sampled token
    max_len: int  # positions it may reach: what its KV reservation is for
    seq: int = field(default_factory=lambda: secrets.randbits(63))
    step: int = 0
    epoch: int = 0
    route: tuple[int, ...] = ()  # replica index per stage; () before the first routing
    nodes: list[str] = field(default_factory=list)  # the route's node ids
    synced: int = 0  # positions of `history` the route's caches hold
    lost: str | None = None  # why the route must be replaced, once the current step ends
    result: asyncio.Future[Frame] | None = None

    def header(self) -> Header:
        return Header(self.seq, self.epoch, self.step, self.route)


@dataclass
class NodeHealth:
    """What the coordinator knows of one stage node, from its status messages."""

    alive: bool = False
    seen: float = 0.0  # time.monotonic() of its last sign of life
    session: tuple[str, int, int] | None = None  # (host, pid, bdseq) of its MQTT session
    held: int = 0  # KV bytes reserved by requests routed through it


class Coordinator:
    """Serves gateway requests through the plant's stages."""

    def __init__(self, plant: Plant, tokenizer: PreTrainedTokenizerBase | None = None, *,
                 batch_groups: int | None = None) -> None:
        self.plant = plant
        self.spec = plant.coordinator
        self.liveness = plant.liveness
        self.topics = plant.topics
        self.pipeline = plant.pipeline
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(plant.model)
        self.eos_ids = _eos_ids(plant, self.tokenizer)
        config = AutoConfig.from_pretrained(plant.model)
        self.kv_per_token = [kv_bytes_per_token(config, s.layers) for s in self.pipeline]
        self.budget = {spec.node: spec.kv_budget_mb * 2**20 for spec in plant.stages}
        self.health = {spec.node: NodeHealth() for spec in plant.stages}
        self._ready = asyncio.Event()  # every stage has a live node
        self._changed = asyncio.Event()  # replaced on every change of `health`
        self._active: dict[int, Generation] = {}
        self._answers: collections.OrderedDict[tuple[str, str], asyncio.Future[GenerateResponse]]
        self._answers = collections.OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self._outbox = Outbox(batch_groups or len(self.pipeline), self._publish_frames,
                              self._stepping)
        self.counters = {"tokens": 0.0, "requests_done": 0.0, "failovers": 0.0}
        self.bus = BusClient(
            plant.endpoint_for(self.spec.id), f"{plant.plant_id}.{self.spec.id}",
            subscriptions=[(self.topics.request_filter, 1), (self.topics.status_filter, 1),
                           (self.topics.activations(self.spec.id), 1)],
            presence=presence(self.topics, self.spec.id, "coordinator", metrics=lambda: {
                **self.counters, "in_flight": float(len(self._active))}),
            # Requests published while the coordinator is down wait in the broker.
            persistent=True, on_connect=[self._on_connect])

    async def serve(self, stop: asyncio.Event) -> None:
        try:
            await serve_until(stop, self.bus, self._on_message, self._watch_heartbeats(),
                              heartbeat_s=self.liveness.heartbeat_s)
        finally:
            for task in list(self._tasks):
                task.cancel()

    # -- dispatch (event loop, must not block) -----------------------------------

    def _on_message(self, message: aiomqtt.Message) -> None:
        topic = message.topic.value
        payload = message.payload if isinstance(message.payload, bytes) else b""
        if topic == self.topics.activations(self.spec.id):
            self._on_result(payload)
        elif (client := self.topics.client_of_request_topic(topic)) is not None:
            self._spawn(self._serve_request(client, payload, message.properties))
        elif topic.startswith(self.topics.status_filter[:-1]):
            self._on_status(payload, retained=bool(message.retain))

    def _on_result(self, payload: bytes) -> None:
        try:
            results = frames.decode_all(payload)
        except frames.BatchError as exc:
            results = exc.good
            self._spawn(self._event("error", f"dropped a result frame: {exc}"))
        for frame in results:
            gen = self._active.get(frame.request)
            # Unknown or stale results (a request that ended, an old route, a
            # duplicate) are dropped.
            if (gen is None or frame.epoch != gen.epoch or frame.step != gen.step
                    or gen.result is None or gen.result.done()):
                continue
            if frame.kind == Kind.CANDIDATES:
                gen.result.set_result(frame)
            elif frame.kind == Kind.ERROR:
                gen.result.set_exception(RequestError("stage_error", frame.text()))

    # -- liveness ------------------------------------------------------------------

    def _on_status(self, payload: bytes, *, retained: bool) -> None:
        try:
            status = AgentStatus.model_validate_json(payload)
        except ValueError:
            return
        node = self.health.get(status.agent_id)
        if node is None:
            return  # the coordinator itself, or an agent of another plant file
        now = time.monotonic()
        # A retained status may be old: it is as fresh as its timestamp says.
        age = max(0.0, time.time() - status.ts) if retained else 0.0
        session = (status.host, status.pid, status.bdseq)
        if status.state == "offline":
            # A Will delivered late, after the node's next birth, is about a
            # session already replaced: bdseq only grows (Sparkplug's bdSeq).
            if node.session is None or status.bdseq >= node.session[2]:
                self._set_alive(status.agent_id, False, "went offline")
            return
        if now - age > node.seen:
            node.seen = now - age
        if node.session is not None and session != node.session:
            # A new MQTT session: its subscription lapsed in between, so frames
            # sent to it meanwhile are gone; a new process has no caches at all.
            self._fail_over(status.agent_id, "reconnected")
        node.session = session
        self._set_alive(status.agent_id, now - node.seen < self.liveness.timeout_s, "is stale")

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
        self._spawn(self._event("join" if alive else "leave",
                                f"stage node {node_id} {'is online' if alive else why}"))
        if not alive:
            self._fail_over(node_id, why)
        if all(any(self.health[n].alive for n in stage.node_ids) for stage in self.pipeline):
            self._ready.set()
        else:
            self._ready.clear()
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _fail_over(self, node_id: str, why: str) -> None:
        """Replay every request whose route runs through `node_id`."""
        for gen in self._active.values():
            if node_id in gen.nodes:
                self._lose(gen, f"node {node_id} {why}")

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

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[call-overload]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- one request -----------------------------------------------------------

    async def _serve_request(self, client: str, payload: bytes,
                             properties: Properties | None) -> None:
        received = time.perf_counter()
        correlation = getattr(properties, "CorrelationData", None) if properties else None
        response_topic = getattr(properties, "ResponseTopic", None) if properties else None
        try:
            request = parse_request(payload)
        except RequestError as exc:
            rid = salvage_id(payload)
            await self._event("error", f"bad request from {client}: {exc.message}", rid)
            if rid is not None:
                reply, _ = self._reply_route(client, rid, response_topic, correlation)
                self._respond(reply, _error_response(rid, exc))
            return
        reply, refused = self._reply_route(client, request.id, request.reply_to or response_topic,
                                           correlation)
        if refused is not None:
            await self._event("error", f"request {request.id} from {client}: {refused.message}",
                              request.id)
            self._respond(reply, _error_response(request.id, refused))
            return
        key = (client, request.id)
        answer = self._answers.get(key)
        if answer is not None:  # a redelivery: answer again, do not generate again
            self._respond(reply, await asyncio.shield(answer))
            return
        answer = self._answers[key] = asyncio.get_running_loop().create_future()
        while len(self._answers) > DEDUP_WINDOW:
            self._answers.popitem(last=False)
        try:
            response = await self._generate(request, reply, received)
        except RequestError as exc:
            await self._event("error", f"request {request.id} from {client}: {exc.message}",
                              request.id)
            response = _error_response(request.id, exc)
        except Exception as exc:  # a bug must still answer the gateway, never leave it waiting
            log.exception("request %s from %s failed", request.id, client)
            response = _error_response(request.id, RequestError(
                "internal", f"the coordinator failed: {type(exc).__name__}: {exc}"))
        answer.set_result(response)
        self._respond(reply, response)

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

    async def _generate(self, request: GenerateRequest, reply: ReplyRoute,
                        received: float) -> GenerateResponse:
        spec = self.spec
        if request.max_tokens > spec.max_tokens_limit:
            raise RequestError("max_tokens", f"max_tokens {request.max_tokens} exceeds this "
                               f"plant's limit of {spec.max_tokens_limit}")
        if len(self._active) >= spec.max_in_flight:
            raise RequestError("busy", f"{len(self._active)} requests in flight, the limit is "
                               f"{spec.max_in_flight}: retry later")
        ids = prompt_ids(self.tokenizer, request)
        if not ids or len(ids) > spec.max_prompt_tokens:
            raise RequestError("prompt_length", f"prompt is {len(ids)} tokens; it must be "
                               f"1..{spec.max_prompt_tokens}")
        gen = Generation(request, reply, history=list(ids), max_len=len(ids) + request.max_tokens)
        self._check_fits(gen)
        self._active[gen.seq] = gen
        rng = np.random.default_rng(request.seed if request.seed is not None
                                    else secrets.randbits(63))
        k = candidates_wanted(request.temperature, request.top_k, spec.candidates)
        text = TextStream(self.tokenizer, request.stop) if request.stream or request.stop else None
        tokens: list[int] = []
        ttft: float | None = None
        finish: str = "length"
        try:
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
                gen.step += 1
        finally:
            del self._active[gen.seq]
            self._unroute(gen)
            self.counters["tokens"] += len(tokens)
            self.counters["requests_done"] += 1
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
            timings=Timings(ttft_ms=None if ttft is None else ttft * 1e3, total_ms=total * 1e3))

    async def _step(self, gen: Generation, *, candidates: int) -> Frame:
        """Bring the route's caches up to `gen.history` and wait for the next candidates.

        Normally that is one decode frame with the last token. After a
        (re)routing it is a prefill of everything from position `gen.synced`,
        in chunks of `prefill_chunk`: only the last chunk asks for candidates,
        and all leave at once so the stages work on them back to back.
        """
        while True:
            if gen.lost is not None or not gen.route:
                await self._route(gen)
            gen.result = asyncio.get_running_loop().create_future()
            self._feed(gen, candidates)
            try:
                frame = await asyncio.wait_for(gen.result, self.spec.request_timeout_s)
            except _Lost:
                continue  # gen.lost is set: route again, replay
            except TimeoutError:
                raise RequestError("timeout", f"step {gen.step} got no result within "
                                   f"{self.spec.request_timeout_s:.0f} s from nodes "
                                   f"{', '.join(gen.nodes)}") from None
            gen.synced = len(gen.history)
            return frame

    def _feed(self, gen: Generation, candidates: int) -> None:
        header, first = gen.header(), self.pipeline[0].nodes[gen.route[0]].node
        todo, start = gen.history[gen.synced:], gen.synced
        if gen.synced and len(todo) == 1:  # a decode step
            self._outbox.step(gen.seq, first, frames.encode(
                Kind.TOKENS, torch.tensor([todo]), header, start=start, candidates=candidates))
            return
        offset = 0
        for size in prefill_chunks(len(todo), self.spec.prefill_chunk):
            last = offset + size == len(todo)
            ids = torch.tensor([todo[offset:offset + size]])
            self._outbox.send(first, frames.encode(Kind.TOKENS, ids, header, start=start + offset,
                                                   candidates=candidates if last else 0,
                                                   prefill=True))
            offset += size

    # -- routes --------------------------------------------------------------------

    def _check_fits(self, gen: Generation) -> None:
        """Refuse a request no route has KV room for: too long for any node, or busy."""
        for stage, per_token in zip(self.pipeline, self.kv_per_token, strict=True):
            need = per_token * gen.max_len
            budgets = [self.budget[n] for n in stage.node_ids]
            if need > max(budgets):
                raise RequestError("too_long", f"{gen.max_len} positions need {need / 2**20:.1f} "
                                   f"MiB of KV cache on stage {stage.index}, more than its "
                                   f"nodes' kv_budget_mb: lower max_tokens or the prompt")
            if all(self.health[n].held + need > self.budget[n] for n in stage.node_ids):
                raise RequestError("busy", f"the KV budget of every node of stage "
                                   f"{stage.index} is taken by requests in flight: retry later")

    def _pick(self, gen: Generation) -> tuple[int, ...] | str:
        """The least loaded live route with KV room for `gen`, or why there is none."""
        route: list[int] = []
        for stage, per_token in zip(self.pipeline, self.kv_per_token, strict=True):
            need = per_token * gen.max_len
            live = [r for r, n in enumerate(stage.node_ids) if self.health[n].alive]
            if not live:
                return (f"stage {stage.index} (layers {list(stage.layers)}) has no live node: "
                        f"{', '.join(stage.node_ids)} offline")
            room = [r for r in live if self.health[stage.node_ids[r]].held + need
                    <= self.budget[stage.node_ids[r]]]
            if not room:
                return f"the live nodes of stage {stage.index} have no KV budget left"
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
                await asyncio.wait_for(changed.wait(), deadline - time.monotonic())
            except TimeoutError:
                raise RequestError("unavailable", f"{route} for "
                                   f"{self.liveness.stage_wait_s:.0f} s. Start a node of it "
                                   "(`edgebus node PLANT --id NODE`) or check its box") from None
        gen.route, gen.epoch, gen.synced, gen.lost = route, gen.epoch + 1, 0, None
        gen.nodes = [stage.nodes[r].node for stage, r in zip(self.pipeline, route, strict=True)]
        for node_id, per_token in zip(gen.nodes, self.kv_per_token, strict=True):
            self.health[node_id].held += per_token * gen.max_len
        if replay is not None:
            self.counters["failovers"] += 1
            self._spawn(self._event("warning", f"replaying {len(gen.history)} positions of "
                                    f"request {gen.request.id} on {', '.join(gen.nodes)} "
                                    f"({replay})", gen.request.id))

    def _unroute(self, gen: Generation) -> None:
        """Give back `gen`'s KV reservations and let its route's nodes free the caches."""
        self._outbox.leave(gen.seq)
        if not gen.route:
            return
        release = frames.encode_release(gen.header())
        for node_id, per_token in zip(gen.nodes, self.kv_per_token, strict=True):
            self.health[node_id].held -= per_token * gen.max_len
            self._outbox.send(node_id, release)
        gen.route, gen.nodes = (), []

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

    async def _event(self, kind: str, message: str, request_id: str | None = None) -> None:
        await publish_event(self.bus, self.topics, Event(
            kind=kind, agent_id=self.spec.id, message=message, request_id=request_id))  # type: ignore[arg-type]


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


def _error_response(request_id: str, exc: RequestError) -> GenerateResponse:
    return GenerateResponse(id=request_id, finish_reason="error",
                            error=ErrorInfo(code=exc.code, message=exc.message))


def _correlation(route: ReplyRoute) -> Properties | None:
    if route.correlation is None:
        return None
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.CorrelationData = route.correlation
    return props


def _eos_ids(plant: Plant, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """The ids `generate` stops on: generation_config's eos, else the tokenizer's."""
    try:
        eos = GenerationConfig.from_pretrained(plant.model).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())


def run_coordinator(plant: Plant, batch_groups: int | None = None) -> None:
    """`edgebus coordinator PLANT`: serve requests until SIGTERM."""

    async def main(stop: asyncio.Event) -> None:
        await Coordinator(plant, batch_groups=batch_groups).serve(stop)

    run_agent(main)
