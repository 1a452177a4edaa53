"""Every QoS 1 message an agent receives is acknowledged, whatever becomes of it.

A broker sends a client only so many QoS 1 messages it has not acknowledged
(Mosquitto: max_inflight_messages, 20); one delivery an agent never acks
narrows that window for good, and a full window leaves the agent deaf. So a
plant started as an operator starts it (`edgebus up`, agents as OS
processes) is sent a burst of hostile messages (garbage, truncated and
bit-flipped frames, bad and huge JSON) on every activation topic and two
gateways' request topics, then the broker itself is asked what its agents
left unacknowledged: Mosquitto through its packet log (`log_type all`),
the embedded amqtt broker through a plugin that sees each packet
(tests/brokers.py's PubackLedger). After the burst the count must come back
to 0 for every agent, and a gateway never seen before must get its answer,
token-exact against llama.cpp running the GGUF whole. On Mosquitto a
PUBACK for no message waiting (a message acknowledged twice) counts as a
fault too.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
from collections.abc import Callable
from pathlib import Path

import aiomqtt
import pytest
from brokers import AmqttBroker, BrokerHandle, MosquittoBroker, PubackLedger
from pipeline import plant_reference
from test_hostile_input import fuzz_frame, fuzz_request
from test_launcher import (
    READY_S,
    Gateway,
    agent_ids,
    all_are,
    edgebus_up,
    plant_file,
    watch_statuses,
)

from edgebus.core.client import UNACKED_WARN_AT, Ack, BusClient
from edgebus.core.endpoint import BrokerEndpoint
from edgebus.core.messages import MAX_REQUEST_BYTES, AgentStatus, GenerateRequest
from edgebus.core.topics import Topics
from edgebus.status_view import table
from node_agent.cancel import cancel_all
from node_agent.runtime import presence
from plant_config import Plant, write_plant

# About what the attacker sent in a second; far more than the window of 20.
BURST = 2400
# Every this many request messages of the burst is one past the size limit.
HUGE_EVERY = 200
# Gateways whose request topics get the burst (the warm-up's among them).
FUZZED_GATEWAYS = ("plc-a", "plc-b")
# A bound on failing, not a wait: the check goes on as soon as every count is 0.
SETTLE_S = 120.0
ANSWER_S = 120.0
POLL_S = 0.2

# Mosquitto 2.0's packet log (`log_type all`).
_SENT = re.compile(r"Sending PUBLISH to (\S+) \(d\d, q1, r\d, m(\d+),")
_ACKED = re.compile(r"Received PUBACK from (\S+) \(Mid: ?(\d+)")
_CLEAN_CONNECT = re.compile(r"New client connected from \S+ as (\S+) \(p\d+, c1,")


def mosquitto_ack_faults(log: str) -> dict[str, int]:
    """From Mosquitto's log, per client id: the QoS 1 PUBLISHes sent it has not PUBACKed
    yet, plus the PUBACKs it sent for none (a message acknowledged twice)."""
    waiting: dict[str, set[int]] = {}
    surplus: dict[str, int] = {}
    for line in log.splitlines():
        if sent := _SENT.search(line):
            waiting.setdefault(sent[1], set()).add(int(sent[2]))
        elif acked := _ACKED.search(line):
            mids = waiting.setdefault(acked[1], set())
            if int(acked[2]) in mids:
                mids.discard(int(acked[2]))
            else:
                surplus[acked[1]] = surplus.get(acked[1], 0) + 1
        elif connected := _CLEAN_CONNECT.search(line):  # a clean session starts empty
            waiting.pop(connected[1], None)
    return {client: len(waiting.get(client, ())) + surplus.get(client, 0)
            for client in waiting.keys() | surplus.keys()}


def burst(plant: Plant, rng: random.Random) -> list[tuple[str, bytes]]:
    """BURST hostile messages, spread over every `act/` topic and FUZZED_GATEWAYS' requests."""
    topics = plant.topics
    targets = [topics.activations(a) for a in agent_ids(plant)]
    targets += [topics.request(g) for g in FUZZED_GATEWAYS]
    messages = []
    for i in range(BURST):
        topic = targets[i % len(targets)]
        if "/act/" not in topic and i % HUGE_EVERY == len(targets) - 1:
            payload = b'{"id": "huge", "prompt": "' + b"a" * MAX_REQUEST_BYTES + b'"}'
        else:
            payload = fuzz_frame(rng) if "/act/" in topic else fuzz_request(rng)
        messages.append((topic, payload))
    return messages


async def settled(unacknowledged: Callable[[], dict[str, int]]) -> dict[str, int]:
    """Poll until no agent holds a delivery unacknowledged; what they hold at the deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_S
    while any((held := unacknowledged()).values()) and loop.time() < deadline:
        await asyncio.sleep(POLL_S)
    return {agent: count for agent, count in held.items() if count}


async def check_plant_stays_answering(plant: Plant, plant_path: Path, workdir: Path,
                                      unacknowledged: Callable[[str], int]) -> None:
    """Warm up, burst, then: a new gateway answered, every agent's deliveries acknowledged."""
    agents = agent_ids(plant)

    def held() -> dict[str, int]:
        return {agent: unacknowledged(f"{plant.plant_id}.{agent}") for agent in agents}

    warm_up = GenerateRequest(id="warm", prompt="Valve 3 reports a pressure drop",
                              max_tokens=6, ignore_eos=True)
    # Enough steps that a leak of a few acks in the unfixed code shows (its window is 20).
    fresh = GenerateRequest(id="after", prompt="Press 7 stopped with alarm E42",
                            max_tokens=24, ignore_eos=True)
    endpoint = plant.broker.endpoint()
    with edgebus_up(plant_path, workdir):
        async with watch_statuses(plant) as watch:
            await watch.wait(all_are(agents, "online"), READY_S)
        async with Gateway(plant, FUZZED_GATEWAYS[0]) as gateway:
            await gateway.send(warm_up)
            await gateway.until(lambda: warm_up.id in gateway.responses, ANSWER_S)
        async with aiomqtt.Client(endpoint.host, endpoint.port,
                                  identifier=f"{plant.plant_id}.attacker") as attacker:
            for topic, payload in burst(plant, random.Random(30)):
                await attacker.publish(topic, payload, qos=0)
        async with Gateway(plant, "plc-new") as newcomer:
            await newcomer.send(fresh)
            try:
                await newcomer.until(lambda: fresh.id in newcomer.responses, ANSWER_S)
            except TimeoutError:
                raise AssertionError(f"no answer within {ANSWER_S:.0f} s; deliveries held "
                                     f"unacknowledged, by agent: {held()}") from None
        unacked = await settled(held)
        assert not unacked, f"QoS 1 deliveries not acknowledged once, by agent: {unacked}"
    for request, response in ((warm_up, gateway.responses[warm_up.id]),
                              (fresh, newcomer.responses[fresh.id])):
        assert response.error is None, response.error
        assert response.tokens == plant_reference(plant, request), request.id


async def test_after_a_hostile_burst_mosquitto_holds_nothing_unacknowledged(
        tiny_llama_gguf: Path, tmp_path: Path) -> None:
    with MosquittoBroker(tmp_path / "mosquitto", log_all=True) as mosquitto:
        plant_path, plant = plant_file(tiny_llama_gguf, tmp_path, broker=mosquitto.url)

        def unacknowledged(client: str) -> int:
            return mosquitto_ack_faults(
                mosquitto.log_path.read_text(errors="replace")).get(client, 0)

        await check_plant_stays_answering(plant, plant_path, tmp_path, unacknowledged)


async def test_after_a_hostile_burst_the_embedded_broker_holds_nothing_unacknowledged(
        tiny_llama_gguf: Path, tmp_path: Path, ledgered_amqtt: AmqttBroker) -> None:
    """amqtt delivers at the subscription's QoS: here the burst itself arrives at QoS 1."""
    plant_path, plant = plant_file(tiny_llama_gguf, tmp_path,
                                   broker=f"mqtt://{ledgered_amqtt.host}:{ledgered_amqtt.port}")
    plant = plant.model_copy(update={"broker": plant.broker.model_copy(
        update={"protocol": "3.1.1"})})
    write_plant(plant, plant_path)
    ledger = ledgered_amqtt.plugin(PubackLedger.__name__)
    assert ledger is not None
    await check_plant_stays_answering(plant, plant_path, tmp_path, ledger.unacknowledged)


async def test_deliveries_held_near_the_window_are_reported_then_acknowledged(
        broker: BrokerHandle, caplog: pytest.LogCaptureFixture) -> None:
    """An agent holding UNACKED_WARN_AT deliveries in tasks says so in its log and in its
    status (and `edgebus status` flags it); each is acknowledged once its task ends."""
    endpoint = BrokerEndpoint(host=broker.host, port=broker.port, tls=False, username=None,
                              password=None, protocol="3.1.1", ca_file=None, keepalive_s=60)
    topics = Topics(f"edgebus-test/{os.getpid()}")
    topic = f"{topics.root}/held"
    release = asyncio.Event()

    async def hold(ack: Ack) -> None:
        await release.wait()

    bus = BusClient(endpoint, "holder", subscriptions=[(topic, 1)], manual_ack=True,
                    presence=presence(topics, "holder", "coordinator",
                                      metrics=lambda: bus.metrics()))

    def take(message: aiomqtt.Message) -> None:
        bus.take(message, hold)

    running = asyncio.ensure_future(bus.run(take))
    try:
        await bus.wait_connected(ANSWER_S)
        async with aiomqtt.Client(broker.host, broker.port) as sender:
            await sender.subscribe(topics.status("holder"), qos=1)
            for i in range(UNACKED_WARN_AT):
                await sender.publish(topic, str(i), qos=1)
            async with asyncio.timeout(ANSWER_S):
                while bus.unacked < UNACKED_WARN_AT:
                    await asyncio.sleep(POLL_S)
                await bus.refresh_presence()
                async for message in sender.messages:
                    assert isinstance(message.payload, bytes)
                    status = AgentStatus.model_validate_json(message.payload)
                    if status.metrics.get("unacked") == UNACKED_WARN_AT:
                        break
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(f"holds {UNACKED_WARN_AT} QoS 1 messages unacknowledged" in w
                   for w in warned), warned
        row = table({"plant_id": "p", "topic_root": topics.root, "plan": None, "agents": [
            {"agent_id": "holder", "state": "online", "age_s": 0.0,
             "status": status.model_dump()}]})
        assert f"online, {UNACKED_WARN_AT}/20 unacked" in row, row
        release.set()
        async with asyncio.timeout(ANSWER_S):
            while bus.unacked:
                await asyncio.sleep(POLL_S)
    finally:
        await cancel_all([running])
