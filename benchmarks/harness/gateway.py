"""The bench's MQTT side: a timestamping gateway, an activation sniffer, a broker ping-pong.

Every client here sets TCP_NODELAY, as the agents do: without it each small
QoS 1 message waits 40+ ms for a delayed ACK and the numbers would measure Nagle.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
import statistics
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Self

import aiomqtt

from edgebus.core.client import NODELAY
from edgebus.core.endpoint import BrokerEndpoint
from edgebus.core.errors import EdgebusError
from edgebus.core.messages import AgentStatus, GenerateRequest, GenerateResponse, StreamDelta
from edgebus.core.statuses import StatusReader
from harness.metrics import P99, HopLatency, Trace, percentile
from plant_config import Plant

log = logging.getLogger(__name__)

# The gateway's client id in request and response topics.
CLIENT_ID = "bench"
# Independent arrivals: each closed-loop client starts somewhere in this window.
ARRIVAL_SPREAD_S = 0.25
# A decode-step HIDDEN frame of SmolLM2: 56-byte header + 576 fp16 values.
PING_BYTES = 56 + 576 * 2
PING_ROUNDS = 200
# Round trips before the measured ones: connection and allocator warm-up.
PING_WARMUP = 20
# Far beyond a loopback round trip: only a broken broker hits it.
PING_TIMEOUT_S = 5.0
# How often a wait for fresh agent statuses looks again.
_STATUS_POLL_S = 0.05


def mqtt_client(endpoint: BrokerEndpoint, identifier: str) -> aiomqtt.Client:
    """A plain aiomqtt client for `endpoint` (loopback: no TLS) with TCP_NODELAY."""
    protocol = (aiomqtt.ProtocolVersion.V5 if endpoint.protocol == "5"
                else aiomqtt.ProtocolVersion.V311)
    return aiomqtt.Client(endpoint.host, endpoint.port, username=endpoint.username,
                          password=endpoint.password, identifier=identifier, protocol=protocol,
                          socket_options=[NODELAY])


def _client_id(plant: Plant, role: str) -> str:
    return f"{plant.plant_id}.bench-{role}-{secrets.token_hex(3)}"


class _Listener(ABC):
    """An MQTT client whose reader task hands every message, timestamped, to `_on_message`."""

    def __init__(self, plant: Plant, role: str, filters: list[str]) -> None:
        self.plant = plant
        self._client = mqtt_client(plant.broker.endpoint(), _client_id(plant, role))
        self._filters = filters
        self._reader: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        await self._client.__aenter__()
        for topic_filter in self._filters:
            await self._client.subscribe(topic_filter, qos=1)
        self._reader = asyncio.create_task(self._read())
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._reader is not None:
            self._reader.cancel()
        # Disconnecting ends the reader for sure: a cancel() of a task waiting
        # in aiomqtt's message iterator was seen to get lost.
        await self._client.__aexit__(exc_type, exc, tb)
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    async def _read(self) -> None:
        async for message in self._client.messages:
            # Taken first, so handling one message does not delay its timestamp.
            now = time.perf_counter()
            payload = message.payload if isinstance(message.payload, bytes) else b""
            self._on_message(message.topic.value, payload, now)

    @abstractmethod
    def _on_message(self, topic: str, payload: bytes, now: float) -> None:
        """Handle one message in the event loop: record, never wait."""


@dataclass
class _Pending:
    arrivals: list[tuple[int, float]]
    done: asyncio.Future[tuple[float, GenerateResponse]]


class Gateway(_Listener):
    """One MQTT client that sends requests as gateway CLIENT_ID and timestamps the answers.

    It also keeps every agent's latest retained status, whose `metrics` the
    bench reads before and after a phase.
    """

    def __init__(self, plant: Plant) -> None:
        topics = plant.topics
        self._response_prefix = f"{topics.root}/llm/response/{CLIENT_ID}/"
        self._topics = topics
        self._status_reader = StatusReader(log.warning)
        super().__init__(plant, "gateway", [f"{self._response_prefix}#", topics.status_filter])
        self._request_topic = topics.request(CLIENT_ID)
        self._pending: dict[str, _Pending] = {}
        self.statuses: dict[str, AgentStatus] = {}

    def _on_message(self, topic: str, payload: bytes, now: float) -> None:
        if topic.startswith(self._response_prefix):
            request_id, _, tail = topic.removeprefix(self._response_prefix).partition("/")
            pending = self._pending.get(request_id)
            if pending is None:
                return
            if tail == "stream":
                pending.arrivals.append((StreamDelta.model_validate_json(payload).index, now))
            elif not tail and not pending.done.done():
                pending.done.set_result((now, GenerateResponse.model_validate_json(payload)))
        # amqtt may hand over retained messages of other filters: the reader checks.
        elif ((agent := self._topics.agent_of_status_topic(topic)) is not None
              and (status := self._status_reader.read(agent, payload)) is not None):
            self.statuses[agent] = status

    async def generate(self, request: GenerateRequest, timeout: float) -> Trace:
        """Send `request`, wait for its response; raise EdgebusError unless it made max_tokens."""
        pending = _Pending([], asyncio.get_running_loop().create_future())
        self._pending[request.id] = pending
        try:
            sent = time.perf_counter()
            await self._client.publish(self._request_topic,
                                       request.model_dump_json(exclude_none=True), qos=1)
            async with asyncio.timeout(timeout):
                done, response = await pending.done
        except TimeoutError:
            raise EdgebusError(f"request {request.id}: no response within {timeout:.0f} s") \
                from None
        finally:
            del self._pending[request.id]
        if response.error is not None:
            raise EdgebusError(f"request {request.id} failed: {response.error.code}: "
                               f"{response.error.message}")
        made = response.usage.completion_tokens
        if made != request.max_tokens:
            raise EdgebusError(f"request {request.id} made {made} tokens, not "
                               f"{request.max_tokens} ({response.finish_reason})")
        return Trace(sent=sent, arrivals=pending.arrivals, done=done, tokens=made)

    async def fresh_metrics(self, agents: list[str], after: float,
                            timeout: float) -> dict[str, dict[str, float]] | None:
        """Each agent's status metrics as published after wall-clock time `after`.

        None if not every agent refreshes its status within `timeout`.
        """
        deadline = time.monotonic() + timeout
        while True:
            statuses = [self.statuses.get(agent) for agent in agents]
            if all(s is not None and s.ts > after for s in statuses):
                return {s.agent_id: s.metrics for s in statuses if s is not None}
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(_STATUS_POLL_S)


class Sniffer(_Listener):
    """Sums the payload bytes of every activation frame, per topic ({root}/act/<agent>)."""

    def __init__(self, plant: Plant) -> None:
        self._prefix = f"{plant.topics.root}/act/"
        super().__init__(plant, "sniffer", [f"{self._prefix}#"])
        self.bytes: Counter[str] = Counter()

    def _on_message(self, topic: str, payload: bytes, now: float) -> None:
        if topic.startswith(self._prefix):
            self.bytes[topic.removeprefix(self._prefix)] += len(payload)


async def broker_hop(plant: Plant) -> HopLatency:
    """Ping-pong a decode-frame-sized QoS 1 payload between two clients through the broker."""
    endpoint = plant.broker.endpoint()
    ping, pong = f"{plant.topics.root}/bench/ping", f"{plant.topics.root}/bench/pong"
    payload = bytes(PING_BYTES)
    echoer = mqtt_client(endpoint, _client_id(plant, "pong"))

    async def echo() -> None:
        async for message in echoer.messages:
            if message.topic.value == ping and isinstance(message.payload, bytes):
                await echoer.publish(pong, message.payload, qos=1)

    rtts: list[float] = []
    async with mqtt_client(endpoint, _client_id(plant, "ping")) as pinger:
        async with echoer:
            await echoer.subscribe(ping, qos=1)
            await pinger.subscribe(pong, qos=1)
            echoing = asyncio.create_task(echo())
            try:
                for _ in range(PING_WARMUP + PING_ROUNDS):
                    sent = time.perf_counter()
                    await pinger.publish(ping, payload, qos=1)
                    async with asyncio.timeout(PING_TIMEOUT_S):
                        async for message in pinger.messages:
                            if message.topic.value == pong:
                                break
                    rtts.append(time.perf_counter() - sent)
            finally:
                echoing.cancel()
        # Out of `async with echoer`: the disconnect has ended the echo (see _Listener).
        await asyncio.gather(echoing, return_exceptions=True)
    measured = rtts[PING_WARMUP:]
    return HopLatency(p50_s=statistics.median(measured) / 2, p99_s=percentile(measured, P99) / 2)


async def closed_loop(gateway: Gateway, make_request: Callable[[], GenerateRequest], *,
                      concurrency: int, requests_each: int, seed: int,
                      timeout: float) -> list[Trace]:
    """`concurrency` virtual clients, each sending its next request when the last one is answered.

    Their start times are spread over ARRIVAL_SPREAD_S by an RNG seeded with
    `seed`, so requests arrive independently (not as one batch), the same way every run.
    """
    rng = random.Random(seed)
    offsets = [rng.uniform(0.0, ARRIVAL_SPREAD_S) for _ in range(concurrency)]
    traces: list[Trace] = []

    async def client(offset: float) -> None:
        await asyncio.sleep(offset)
        for _ in range(requests_each):
            traces.append(await gateway.generate(make_request(), timeout))

    await asyncio.gather(*(client(offset) for offset in offsets))
    return traces
