"""A frame lost in flight is recovered by a replay, not waited out.

Stage 1 sits behind a relay: a real MQTT client that carries every message
between the plant's topics and the topics stage 1 is configured with (a
topic root of its own), as a flaky link or a broker bridge would, and loses
exactly one frame. Everything else is the production code over a real
Mosquitto. The requests' step timeout is far longer than the test waits, so
an answer without error can only come from a replay, and the events say
which mechanism started it: stage 1 reporting the gap, or the coordinator
finding the step overdue. The model is the tiny random Llama, whose greedy
tokens depend on their whole history, so a replay that kept a wrong or
missing position would not answer token-exact.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiomqtt
import pytest
from brokers import MosquittoBroker
from pipeline import reference_tokens, stage_model, tokenizer
from plant_gateway import Gateway, gateway, send

from edgebus.core import frames
from edgebus.core.client import NODELAY
from edgebus.core.frames import Peek
from edgebus.core.messages import GenerateRequest
from node_agent.cancel import cancel_all
from node_agent.coordinator import token_loop
from node_agent.coordinator.agent import Coordinator
from node_agent.stage import StageAgent
from plant_config import BrokerSettings, CoordinatorSpec, Liveness, Plant, StageSpec

# Far longer than the test waits for an answer: only a replay can answer in time.
STEP_TIMEOUT_S = 900.0
WAIT_S = 300.0
# Small chunks, so a prompt travels as several prefill frames.
CHUNK = 8
RELAYED = "relayed"
# The decode step whose frame is lost: a few steps in, so the coordinator has paced decode.
LOST_STEP = 6
# What the coordinator says of a step it found overdue (node_agent/coordinator/token_loop.py).
OVERDUE = "taken as lost in transit"
# The least time after which the coordinator takes a step for lost, in place of its 3 s
# (token_loop.STALL_MIN_S): a tiny model's decode step takes milliseconds, so the floor
# alone decides when the lost one is found, and the test waited it out. A step a loaded
# box holds up longer is replayed too, which assert_replayed_once_for allows.
STALL_MIN_S = 0.5

Drop = Callable[[Peek], bool]


def plant_for(model: Path, broker: MosquittoBroker) -> Plant:
    return Plant(
        plant_id="lost", topic_root=f"edgebus-test/{secrets.token_hex(4)}",
        broker=BrokerSettings(url=broker.url, protocol="5"), model=model,
        stages=[StageSpec(node="stage-0", layers=(0, 3)),
                StageSpec(node="stage-1", layers=(3, 6))],
        coordinator=CoordinatorSpec(request_timeout_s=STEP_TIMEOUT_S, prefill_chunk=CHUNK),
        liveness=Liveness(heartbeat_s=0.5, timeout_s=3.0, stage_wait_s=30.0))


class Relay:
    """Carries stage 1's traffic between the plant's topics and its own, losing what
    `drop` picks: each message is split into its frames and sent on without those."""

    def __init__(self, plant: Plant, broker: MosquittoBroker, drop: Drop) -> None:
        self.root = plant.topic_root
        self.broker = broker
        self.drop = drop
        self.dropped: list[Peek] = []

    async def run(self, ready: asyncio.Event) -> None:
        inbound, relayed = f"{self.root}/act/stage-1", f"{self.root}/{RELAYED}/act/stage-1"
        # TCP_NODELAY, as the agents' own clients have it: without, Nagle and the broker's
        # delayed ACK held each message the relay passes on for ~45 ms (~0.1 s a step).
        async with aiomqtt.Client(self.broker.host, self.broker.port,
                                  socket_options=[NODELAY]) as client:
            await client.subscribe(inbound, qos=1)
            await client.subscribe(f"{self.root}/{RELAYED}/#", qos=1)
            ready.set()
            async for message in client.messages:
                assert isinstance(message.payload, bytes)
                topic = message.topic.value
                if topic == inbound:
                    payload = self._lose(message.payload)
                    if payload:
                        await client.publish(relayed, payload, qos=1)
                # Stage 1's output, status and events, back into the plant; not what this
                # relay sent stage 1, which would come back to stage 1 again and again.
                elif topic != relayed:
                    await client.publish(self.root + topic.removeprefix(
                        f"{self.root}/{RELAYED}"), message.payload, qos=1,
                                         retain=bool(message.retain))

    def _lose(self, payload: bytes) -> bytes:
        kept = []
        for peek in frames.scan(payload, frames.FrameLimits(2**24, 64)):
            if not self.dropped and self.drop(peek):
                self.dropped.append(peek)
            else:
                kept.append(payload[peek.offset:peek.end])
        return b"".join(kept)


@asynccontextmanager
async def relayed_plant(model: Path, broker: MosquittoBroker,
                        drop: Drop) -> AsyncIterator[tuple[Plant, Relay]]:
    """Stage 0 and the coordinator on the plant's topics, stage 1 behind a relay."""
    plant = plant_for(model, broker)
    behind = plant.model_copy(update={"topic_root": f"{plant.topic_root}/{RELAYED}"})
    relay = Relay(plant, broker, drop)
    ready = asyncio.Event()
    relaying = asyncio.create_task(relay.run(ready))
    await asyncio.wait_for(ready.wait(), 30)
    stop = asyncio.Event()
    agents: list[StageAgent | Coordinator] = [
        StageAgent(plant, "stage-0", model=stage_model(model, 0, 3)),
        StageAgent(behind, "stage-1", model=stage_model(model, 3, 6)),
        Coordinator(plant, tokenizer=tokenizer(model))]
    tasks = [asyncio.create_task(agent.serve(stop)) for agent in agents]
    try:
        yield plant, relay
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        # Not a plain cancel: the relay is often mid-publish of stage 1's "offline" status
        # now, and Python 3.11's wait_for (in aiomqtt's publish) loses a cancel that lands
        # as the PUBACK does; the relay then waits for messages that never come (a run
        # once hung here for 9 minutes). cancel_all cancels again until it ends.
        await cancel_all([relaying])


async def answer(plant: Plant, request: GenerateRequest) -> Gateway:
    async with gateway(plant) as (gw, bus):
        await gw.until_online(["stage-0", "stage-1", plant.coordinator.id], timeout=WAIT_S)
        sent = time.monotonic()
        await send(bus, plant, [request])
        await gw.until(lambda: request.id in gw.responses, WAIT_S)
        print(f"{request.id}: answered {gw.received[request.id] - sent:.1f} s after it was "
              f"sent; {gw.messages('replaying')}")
        return gw


async def test_a_lost_prefill_frame_is_reported_by_the_next_stage_and_replayed(
        tiny_llama: Path, mosquitto_broker: MosquittoBroker) -> None:
    request = GenerateRequest(id="gap", prompt="The hydraulic press on line 3 reports a "
                              "pressure drop. Likely causes are", max_tokens=12, ignore_eos=True)
    # The prompt's second chunk into stage 1 goes missing: its third shows the gap.
    async with relayed_plant(tiny_llama, mosquitto_broker,
                             lambda p: p.prefill and p.start == CHUNK // 2) as (plant, relay):
        gw = await answer(plant, request)
    assert [p.start for p in relay.dropped] == [CHUNK // 2]
    response = gw.responses[request.id]
    assert response.error is None, response.error
    assert response.tokens == reference_tokens(tiny_llama, request)
    assert_replayed_once_for(gw, "a frame before it was lost")


async def test_a_lost_decode_frame_is_found_overdue_and_replayed(
        tiny_llama: Path, mosquitto_broker: MosquittoBroker,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(token_loop, "STALL_MIN_S", STALL_MIN_S)
    request = GenerateRequest(id="overdue", prompt="Summarise the lockout-tagout procedure "
                              "for a conveyor motor:", max_tokens=16, ignore_eos=True)
    # A decode step from the sixth on goes missing: nothing follows it for a stage to
    # notice. (From the sixth, not the sixth: a replay renumbers what follows it.)
    async with relayed_plant(tiny_llama, mosquitto_broker,
                             lambda p: not p.prefill and p.step >= LOST_STEP) as (plant, relay):
        gw = await answer(plant, request)
    [lost] = relay.dropped
    response = gw.responses[request.id]
    assert response.error is None, response.error
    assert response.tokens == reference_tokens(tiny_llama, request)
    assert_replayed_once_for(gw, f"no result for step {lost.step} within")


def assert_replayed_once_for(gw: Gateway, cause: str) -> None:
    """One replay says `cause`. Any other is one the coordinator took for a step overdue
    (STALL_MIN_S and more) that a loaded box held up, which a quiet one never does: not one
    for the lost frame, which would be named, nor for any other cause."""
    replays = gw.messages("replaying")
    assert [cause in m for m in replays].count(True) == 1, replays
    assert all(cause in m or OVERDUE in m for m in replays), replays
