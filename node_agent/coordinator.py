"""The coordinator agent: requests in, token loop through the stages, responses out.

    gateway --request--> coordinator --TOKENS--> stage 0 --HIDDEN--> ... --> stage N-1
                              ^                                                  |
                              +------------------CANDIDATES----------------------+
                         sample, stream delta, stop?  --response--> gateway

Every request is its own asyncio task awaiting its own futures, so many are in
flight at once and nothing serialises them. The coordinator holds the tokenizer
and no weights.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import dataclass, field

import aiomqtt
import numpy as np
import torch
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from transformers import AutoTokenizer, GenerationConfig, PreTrainedTokenizerBase

from edgebus import frames
from edgebus.client import BusClient
from edgebus.errors import RequestError
from edgebus.frames import Frame, Kind
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
from node_agent.runtime import presence, publish_event, run_agent, serve_until
from node_agent.sampling import candidates_wanted, sample_token
from node_agent.text import TextStream, decode, prompt_ids
from plant_config import Plant

log = logging.getLogger(__name__)


@dataclass
class ReplyRoute:
    """Where a request's response goes, and what MQTT 5 correlation data to echo."""

    topic: str
    correlation: bytes | None = None

    @property
    def stream_topic(self) -> str:
        return f"{self.topic}/stream"


@dataclass
class Generation:
    """One request in flight."""

    request: GenerateRequest
    route: ReplyRoute
    seq: int = field(default_factory=lambda: secrets.randbits(63))
    step: int = 0
    result: asyncio.Future[Frame] | None = None


class Coordinator:
    """Serves gateway requests through the plant's stages."""

    def __init__(self, plant: Plant, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        self.plant = plant
        self.spec = plant.coordinator
        self.topics = plant.topics
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(plant.model)
        self.eos_ids = _eos_ids(plant, self.tokenizer)
        self.first_topic = self.topics.activations(plant.stages[0].node)
        self.stage_nodes = [s.node for s in plant.stages]
        self.online: set[str] = set()
        self._ready = asyncio.Event()
        self._active: dict[int, Generation] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._outbox: list[bytes] = []  # frames for stage 0, sent together per loop turn
        self.counters = {"tokens": 0.0, "requests_done": 0.0}
        self.bus = BusClient(
            plant.broker.endpoint(), f"{plant.plant_id}.{self.spec.id}",
            subscriptions=[(self.topics.request_filter, 1), (self.topics.status_filter, 1),
                           (self.topics.activations(self.spec.id), 1)],
            presence=presence(self.topics, self.spec.id, "coordinator", metrics=lambda: {
                **self.counters, "in_flight": float(len(self._active))}))

    async def serve(self, stop: asyncio.Event) -> None:
        try:
            await serve_until(stop, self.bus, self._on_message)
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
            self._on_status(payload)

    def _on_result(self, payload: bytes) -> None:
        try:
            results = frames.decode_all(payload)
        except frames.BatchError as exc:
            results = exc.good
            self._spawn(self._event("error", f"dropped a result frame: {exc}"))
        for frame in results:
            gen = self._active.get(frame.request)
            # Unknown or stale results (a request that timed out, a duplicate) are dropped.
            if (gen is None or frame.kind != Kind.CANDIDATES or frame.step != gen.step
                    or gen.result is None or gen.result.done()):
                continue
            gen.result.set_result(frame)

    def _on_status(self, payload: bytes) -> None:
        try:
            status = AgentStatus.model_validate_json(payload)
        except ValueError:
            return
        if status.state == "online":
            self.online.add(status.agent_id)
        else:
            self.online.discard(status.agent_id)
        if all(node in self.online for node in self.stage_nodes):
            self._ready.set()
        else:
            self._ready.clear()

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
                route = ReplyRoute(response_topic or self.topics.response(client, rid),
                                   correlation)
                await self._respond(route, _error_response(rid, exc))
            return
        route = ReplyRoute(request.reply_to or response_topic
                           or self.topics.response(client, request.id), correlation)
        try:
            response = await self._generate(request, route, received)
        except RequestError as exc:
            await self._event("error", f"request {request.id} from {client}: {exc.message}",
                              request.id)
            response = _error_response(request.id, exc)
        await self._respond(route, response)

    async def _generate(self, request: GenerateRequest, route: ReplyRoute,
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
        await self._wait_ready()

        gen = Generation(request, route)
        self._active[gen.seq] = gen
        rng = np.random.default_rng(request.seed if request.seed is not None
                                    else secrets.randbits(63))
        k = candidates_wanted(request.temperature, request.top_k, spec.candidates)
        text = TextStream(self.tokenizer, request.stop) if request.stream or request.stop else None
        tokens: list[int] = []
        ttft: float | None = None
        finish: str = "length"
        try:
            feed, start = ids, 0  # prefill: the whole prompt, from position 0
            while True:
                result = await self._step(gen, feed, start=start, candidates=k)
                cand_ids, cand_logits = result.candidates_arrays()
                token = sample_token(cand_ids[0], cand_logits[0], temperature=request.temperature,
                                     top_k=request.top_k, top_p=request.top_p, rng=rng)
                ttft = ttft if ttft is not None else time.perf_counter() - received
                tokens.append(token)
                if text is not None:
                    delta = text.add(token)
                    if delta and request.stream:
                        await self._stream(gen, len(tokens) - 1, delta)
                    if text.stopped:
                        finish = "stop"
                        break
                if token in self.eos_ids and not request.ignore_eos:
                    finish = "stop"
                    break
                if len(tokens) >= request.max_tokens:
                    break
                feed, start = [token], len(ids) + len(tokens) - 1
                gen.step += 1
        finally:
            del self._active[gen.seq]
            self.counters["tokens"] += len(tokens)
            self.counters["requests_done"] += 1
            self._spawn(self._release(gen))
        if text is not None:
            rest = text.flush()
            if rest and request.stream:
                await self._stream(gen, len(tokens), rest)
            out_text = text.text
        else:
            out_text = decode(self.tokenizer, tokens)
        total = time.perf_counter() - received
        return GenerateResponse(
            id=request.id, text=out_text, tokens=tokens, finish_reason=finish,  # type: ignore[arg-type]
            usage=Usage(prompt_tokens=len(ids), completion_tokens=len(tokens)),
            timings=Timings(ttft_ms=None if ttft is None else ttft * 1e3, total_ms=total * 1e3))

    async def _step(self, gen: Generation, feed: list[int], *, start: int,
                    candidates: int) -> Frame:
        """Feed ids at positions start.. into the pipeline and wait for the next candidates.

        A prompt goes in chunks of `prefill_chunk`; only the last asks for
        candidates, and all leave at once so the stages work on them back to back.
        """
        gen.result = asyncio.get_running_loop().create_future()
        chunk = self.spec.prefill_chunk
        for offset in range(0, len(feed), chunk):
            last = offset + chunk >= len(feed)
            self._send(frames.encode(Kind.TOKENS, torch.tensor([feed[offset:offset + chunk]]),
                                     request=gen.seq, epoch=0, step=gen.step,
                                     start=start + offset, candidates=candidates if last else 0))
        try:
            return await asyncio.wait_for(gen.result, self.spec.request_timeout_s)
        except TimeoutError:
            missing = [n for n in self.stage_nodes if n not in self.online]
            why = f"stages offline: {', '.join(missing)}" if missing else "no stage answered"
            raise RequestError("timeout", f"step {gen.step} got no result within "
                               f"{self.spec.request_timeout_s:.0f} s ({why})") from None

    def _send(self, frame: bytes) -> None:
        """Queue a frame for stage 0. Frames queued in one event-loop turn leave as one
        message: when a batch of results arrives, every request's next token does."""
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(frame)

    def _flush(self) -> None:
        message = b"".join(self._outbox)
        self._outbox.clear()
        self._spawn(self.bus.publish(self.first_topic, message, qos=1))

    async def _wait_ready(self) -> None:
        try:
            await asyncio.wait_for(self._ready.wait(), self.spec.request_timeout_s)
        except TimeoutError:
            missing = [n for n in self.stage_nodes if n not in self.online]
            raise RequestError("unavailable", f"pipeline not ready: stage node(s) "
                               f"{', '.join(missing)} offline. Start them with "
                               "`edgebus node PLANT --id NODE` or `edgebus up PLANT`") from None

    async def _release(self, gen: Generation) -> None:
        data = frames.encode_release(request=gen.seq, epoch=0)
        await asyncio.gather(*(self.bus.publish(self.topics.activations(node), data, qos=1)
                               for node in self.stage_nodes), return_exceptions=True)

    # -- output ------------------------------------------------------------------

    async def _stream(self, gen: Generation, index: int, delta: str) -> None:
        msg = StreamDelta(id=gen.request.id, index=index, delta=delta)
        await self.bus.publish(gen.route.stream_topic, msg.model_dump_json(), qos=1,
                               properties=_correlation(gen.route))

    async def _respond(self, route: ReplyRoute, response: GenerateResponse) -> None:
        await self.bus.publish(route.topic, response.model_dump_json(), qos=1,
                               properties=_correlation(route))

    async def _event(self, kind: str, message: str, request_id: str | None = None) -> None:
        await publish_event(self.bus, self.topics, Event(
            kind=kind, agent_id=self.spec.id, message=message, request_id=request_id))  # type: ignore[arg-type]


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


def run_coordinator(plant: Plant) -> None:
    """`edgebus coordinator PLANT`: serve requests until SIGTERM."""

    async def main(stop: asyncio.Event) -> None:
        await Coordinator(plant).serve(stop)

    run_agent(main)
