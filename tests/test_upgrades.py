"""Boxes of two edgebus releases in one plant: what each says, and what the newer refuses.

A plant upgraded box by box runs two releases for a while (docs/upgrades.md).
tools/upgrade_check.py does it for real, in minutes: a wheel of an earlier main
and one of this checkout, a running plant upgraded one agent at a time while
gateways ask. Here, in seconds, the same rules over a real broker, the agents
under test real: an older or newer peer is stood in for only by what it puts on
the bus. That is a real frame of another format version: one of edgebus 0.1.0
before 2026-11-30 (version 1, packed as commit 904c80b's frames.py packed it),
and one of a release after this one (version 3: only its magic and version
byte are known, which is all a receiver reads of it). Or it is the retained
status such a release publishes.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import subprocess
import sys
import zlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import aiomqtt
import numpy as np
import pytest
from brokers import AmqttBroker, BrokerHandle, PubackLedger
from pipeline import ask_all, plant_for, plant_reference, tokenizer

from edgebus.ask import ask
from edgebus.core import frames, versions
from edgebus.core.client import BusClient
from edgebus.core.frames import Header, Kind
from edgebus.core.messages import AgentStatus, Event, GenerateRequest
from edgebus.core.paths import GGUF_FILE
from edgebus.core.statuses import StatusReader
from edgebus.status_view import ClusterView, report, table, upgrade_order
from node_agent.coordinator.agent import Coordinator
from node_agent.coordinator.delivery import ReplyRoute
from node_agent.coordinator.generation import Generation
from node_agent.coordinator.routing import Routes
from node_agent.engines import KvReservation, context_shape, load_engine
from node_agent.engines.llamacpp import stage_gguf
from node_agent.groups import Outbox
from node_agent.model_config import is_gguf
from node_agent.reporter import Reporter
from node_agent.stage import StageAgent
from plant_config import Liveness, Plant, StageSpec

# Statuses often enough that a refusal shows in one within a second.
HEARTBEAT_S = 0.3
# Far above HEARTBEAT_S: a loaded box that delays heartbeats must not fail a node here.
TIMEOUT_S = 30.0
# How long a request waits for a route before `unavailable`: short, the test waits on it.
STAGE_WAIT_S = 1.0
# A bound on failing, never a wait: every loop below ends as soon as its condition holds.
SETTLE_S = 60.0
# Tokens of each answer: enough to run decode steps through the route.
TOKENS = 6
# A release after this one, and the frame version it speaks.
NEWER, NEWER_FRAMES = "9.0.0", frames.VERSION + 1
# Commit 904c80b's header: this one's fields, with byte 35 reserved instead of the route's
# length, and no route; its CRC covers bytes 0..51 and the payload.
V1_HEADER = struct.Struct("<4sBBBBQIIIIHBB3III")
V1_TOKENS, V1_INT32 = 1, 4


def v1_frame(tokens: list[int]) -> bytes:
    """A TOKENS frame as edgebus 0.1.0 of before 2026-11-30 sent it to a first stage."""
    payload = np.array([tokens], dtype="<i4").tobytes()
    header = V1_HEADER.pack(frames.MAGIC, 1, V1_TOKENS, V1_INT32, 0, 7, 0, 0, 0, len(tokens),
                            1, 2, 0, 1, len(tokens), 0, len(payload), 0)
    crc = zlib.crc32(payload, zlib.crc32(header[:52]))
    return header[:52] + crc.to_bytes(4, "little") + payload


def newer_frame(width: int) -> bytes:
    """A HIDDEN frame as a release speaking frame version NEWER_FRAMES would start one: this
    release's layout under the newer version byte (what follows it is that version's)."""
    frame = bytearray(frames.encode(Kind.HIDDEN, np.zeros((1, 1, width), np.float32),
                                    Header(7, 0, 0, (0, 0)), start=0))
    frame[4] = NEWER_FRAMES
    return bytes(frame)


def with_liveness(plant: Plant) -> Plant:
    return plant.model_copy(update={"liveness": Liveness(
        heartbeat_s=HEARTBEAT_S, timeout_s=TIMEOUT_S, stage_wait_s=STAGE_WAIT_S)})


@asynccontextmanager
async def agents(plant: Plant, nodes: list[str]) -> AsyncIterator[dict[str, asyncio.Event]]:
    """The stage nodes `nodes` of `plant` and its coordinator, each a task with a stop event
    of its own (set one to stop that agent as `systemctl stop` would); yields the events
    once the coordinator has a live node at every stage."""
    specs = [plant.node(node) for node in nodes]
    engines = {s.node: load_engine(plant.model, *s.layers, engine=s.engine, weights=s.weights,
                                   threads=s.threads, shape=context_shape(plant, s.node))
               for s in specs}
    coordinator = Coordinator(plant, tokenizer=None if is_gguf(plant.model)
                              else tokenizer(plant.model))
    served: list[StageAgent | Coordinator] = [
        *(StageAgent(plant, node, model=engine) for node, engine in engines.items()),
        coordinator]
    stops = {agent.node_id if isinstance(agent, StageAgent) else plant.coordinator.id:
             asyncio.Event() for agent in served}
    tasks = [asyncio.create_task(agent.serve(stop))
             for agent, stop in zip(served, stops.values(), strict=True)]
    try:
        await asyncio.wait_for(coordinator._ready.wait(), SETTLE_S)
        yield stops
    finally:
        for stop in stops.values():
            stop.set()
        await asyncio.gather(*tasks)
        for engine in engines.values():
            engine.close()


@asynccontextmanager
async def watching(plant: Plant) -> AsyncIterator[tuple[dict[str, AgentStatus], list[Event]]]:
    """Every agent's newest status and every event, as an operator's MQTT client gets them."""
    statuses: dict[str, AgentStatus] = {}
    events: list[Event] = []
    reader = StatusReader(lambda _: None)

    def on_message(message: aiomqtt.Message) -> None:
        payload = message.payload if isinstance(message.payload, bytes) else b""
        if message.topic.value == plant.topics.events:
            events.append(Event.model_validate_json(payload))
        elif ((agent := plant.topics.agent_of_status_topic(message.topic.value)) is not None
              and (status := reader.read(agent, payload)) is not None):
            statuses[agent] = status

    bus = BusClient(plant.ops_endpoint(), f"{plant.plant_id}.watch-{os.getpid()}",
                    subscriptions=[(plant.topics.status_filter, 1), (plant.topics.events, 1)])
    runner = asyncio.create_task(bus.run(on_message))
    await bus.wait_connected()
    try:
        yield statuses, events
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


async def until(condition: Callable[[], bool], what: str) -> None:
    """Poll `condition()` until it holds; fail after SETTLE_S saying `what` never came."""
    deadline = asyncio.get_running_loop().time() + SETTLE_S
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"{what} within {SETTLE_S:.0f} s")
        await asyncio.sleep(0.05)


async def test_a_frame_of_another_version_is_refused_naming_both_releases(
        tiny_llama_gguf: Path, ledgered_amqtt: AmqttBroker) -> None:
    """A v1 frame (an 0.1.0 coordinator) at a first stage and a newer one at a second stage:
    each is acknowledged, refused with both releases and both frame versions in an error
    event and the stage's status, counted as foreign, and the plant goes on answering."""
    plant = with_liveness(plant_for(tiny_llama_gguf, ledgered_amqtt, [(0, 3), (3, 6)],
                                    weights="gguf", threads=1))
    ledger = ledgered_amqtt.plugin(PubackLedger.__name__)
    assert ledger is not None
    older = (f"frame version 1 (sent by edgebus 0.1.0 of before 2026-11-30); this agent runs "
             f"edgebus {versions.EDGEBUS} and speaks frame version {frames.VERSION}: upgrade "
             "the sender's box (docs/upgrades.md says in what order)")
    newer = (f"frame version {NEWER_FRAMES} (sent by an edgebus newer than "
             f"{versions.EDGEBUS}); this agent runs edgebus {versions.EDGEBUS} and speaks "
             f"frame version {frames.VERSION}: upgrade this box")
    async with (agents(plant, ["stage-0", "stage-1"]), watching(plant) as (statuses, events),
                aiomqtt.Client(ledgered_amqtt.host, ledgered_amqtt.port) as peer):
        await peer.publish(plant.topics.activations("stage-0"), v1_frame([1, 2, 3]), qos=1)
        await peer.publish(plant.topics.activations("stage-1"), newer_frame(64), qos=1)

        def refused(node: str, text: str) -> bool:
            status = statuses.get(node)
            return (status is not None and status.metrics.get("foreign_frames") == 1
                    and text in (status.last_error or ""))

        await until(lambda: refused("stage-0", older) and refused("stage-1", newer),
                    "both stages' statuses never showed their refusal")
        said = {e.agent_id: e.message for e in events if e.kind == "error"}
        assert older in said["stage-0"] and newer in said["stage-1"]
        clients = {f"{plant.plant_id}.{node}" for node in ("stage-0", "stage-1")}
        await until(lambda: not any(ledger.unacknowledged(c) for c in clients),
                    "a refused frame was never acknowledged")

        request = GenerateRequest(id="after", prompt="The press stopped", max_tokens=TOKENS,
                                  ignore_eos=True)
        answer = await ask(plant, request)
        assert answer.error is None and answer.tokens == plant_reference(plant, request)


async def newer_peer(plant: Plant, broker: BrokerHandle, node: str,
                     received: list[bytes]) -> None:
    """Stage node `node` as a release speaking NEWER_FRAMES shows itself: a retained online
    status saying so, and its activation topic, whose messages it keeps in `received`."""
    spec = plant.node(node)
    status = AgentStatus(state="online", role="stage", agent_id=node,
                         stage=plant.stage_index(node), layers=list(spec.layers),
                         pid=os.getpid(), host=socket.gethostname(), version=NEWER,
                         frame_version=NEWER_FRAMES)
    async with aiomqtt.Client(broker.host, broker.port,
                              identifier=f"{plant.plant_id}.{node}") as client:
        await client.subscribe(plant.topics.activations(node), qos=1)
        await client.publish(plant.topics.status(node), status.model_dump_json(), qos=1,
                             retain=True)
        async for message in client.messages:
            received.append(bytes(message.payload))  # type: ignore[arg-type]


async def test_the_coordinator_routes_around_a_node_of_another_frame_version(
        tiny_llama_gguf: Path, amqtt_broker: AmqttBroker) -> None:
    """Stage 0 has two nodes, one of a newer release that speaks other frames: every request
    runs through the other, token-exact, and none reaches it. With the other stopped, a
    request is answered `unavailable`, naming both releases and frame versions."""
    plant = plant_for(tiny_llama_gguf, amqtt_broker, [(0, 3), (3, 6)], weights="gguf",
                      threads=1)
    first, second = plant.stages
    plant = with_liveness(plant.model_copy(update={"stages": [
        first, StageSpec(**{**first.model_dump(), "node": "stage-0-b"}), second]}))
    received: list[bytes] = []
    peer = asyncio.create_task(newer_peer(plant, amqtt_broker, "stage-0-b", received))
    try:
        async with (agents(plant, ["stage-0", "stage-1"]) as stops,
                    watching(plant) as (statuses, _)):
            requests = [GenerateRequest(id=f"r{i}", prompt=f"Valve {i} is stuck",
                                        max_tokens=TOKENS, ignore_eos=True) for i in range(4)]
            answers = await ask_all(plant, requests)
            assert [a.tokens for a in answers] == [plant_reference(plant, r) for r in requests]
            assert received == []

            stops["stage-0"].set()
            await until(lambda: statuses["stage-0"].state == "offline",
                        "stage-0 never said it went offline")
            answer = await ask(plant, GenerateRequest(id="alone", prompt="Valve 9",
                                                      max_tokens=TOKENS))
            assert answer.error is not None and answer.error.code == "unavailable"
            assert (f"stage-0-b runs edgebus {NEWER}, frame version {NEWER_FRAMES}; the "
                    f"coordinator runs edgebus {versions.EDGEBUS}, frame version "
                    f"{frames.VERSION}") in answer.error.message
            assert received == []
    finally:
        peer.cancel()
        await asyncio.gather(peer, return_exceptions=True)


def status_of(agent: str, role: str, release: str, frame_version: int | None) -> AgentStatus:
    return AgentStatus(state="online", role=role, agent_id=agent,  # type: ignore[arg-type]
                       pid=1, host="box", version=release, frame_version=frame_version)


def plant_of_replicas(tiny_llama_gguf: Path, broker: BrokerHandle) -> Plant:
    """Two stages of two nodes each: stage-0-a, stage-0-b, stage-1-a, stage-1-b."""
    plant = plant_for(tiny_llama_gguf, broker, [(0, 3), (3, 6)], weights="gguf", threads=1)
    return with_liveness(plant.model_copy(update={"stages": [
        StageSpec(**{**spec.model_dump(), "node": f"{spec.node}-{replica}"})
        for spec in plant.stages for replica in "ab"]}))


def test_status_shows_each_release_and_which_boxes_to_upgrade_in_order(
        tiny_llama_gguf: Path, amqtt_broker: AmqttBroker) -> None:
    """Halfway through an upgrade from 0.1.0 (whose statuses say no frame version): the
    VERSION column, and a warning naming the boxes still to upgrade, the coordinator first
    since 0.1.0's mixes releases on a route."""
    plant = plant_of_replicas(tiny_llama_gguf, amqtt_broker)
    view = ClusterView()
    for agent, release in [("stage-0-a", "0.1.0"), ("stage-0-b", versions.EDGEBUS),
                           ("stage-1-a", "0.1.0"), ("stage-1-b", "0.1.0"),
                           ("coordinator", "0.1.0")]:
        new = release == versions.EDGEBUS
        view.take(status_of(agent, "coordinator" if agent == "coordinator" else "stage",
                            release, frames.VERSION if new else None))
    data = report(plant, view)
    assert data["versions"] == [
        f"the plant runs mixed edgebus releases (0.1.0 on coordinator, stage-0-a, stage-1-a, "
        f"stage-1-b; {versions.EDGEBUS} on stage-0-b): upgrade coordinator, stage-1-b, "
        f"stage-0-a, stage-1-a to {versions.EDGEBUS}, in that order (docs/upgrades.md)"]
    text = table(data)
    assert f"warning: {data['versions'][0]}" in text
    rows = {line.split()[0]: line for line in text.splitlines()[3:8]}
    assert f" {versions.EDGEBUS} f{frames.VERSION} " in rows["stage-0-b"]
    assert " 0.1.0 " in rows["stage-1-a"]
    # From this release on, the standbys go first.
    assert upgrade_order(plant) == ["stage-0-b", "stage-1-b", "coordinator", "stage-0-a",
                                    "stage-1-a"]


async def test_a_route_runs_on_one_release_where_one_has_room_at_every_stage(
        tiny_llama_gguf: Path, amqtt_broker: AmqttBroker) -> None:
    """Releases may compute differently (0.2.0's llama.cpp stages use flash attention), so
    the coordinator keeps a route on one release: a replay's first, then its own, then the
    newest; a replay that must move to another release starts again from its prompt; it
    mixes releases only where no release has a node at every stage."""
    plant = plant_of_replicas(tiny_llama_gguf, amqtt_broker)
    bus = BusClient(plant.broker.endpoint(), f"{plant.plant_id}.routes")
    runner = asyncio.create_task(bus.run(lambda _: None))
    await bus.wait_connected()
    counters = {"failovers": 0.0, "mixed_routes": 0.0, "restarts": 0.0}
    nodes = [spec.node for spec in plant.stages]
    routes = Routes(plant.pipeline, {n: KvReservation(0, 1, 8) for n in nodes}, plant.liveness,
                    active={}, outbox=Outbox(1, lambda *_: None, lambda _: False, max_frames=1),
                    ready=asyncio.Event(), reporter=Reporter(bus, plant.topics, "coordinator"),
                    counters=counters)

    def running(releases: dict[str, str]) -> None:
        for node, release in releases.items():
            routes.on_status(node, status_of(node, "stage", release, frames.VERSION),
                             retained=False)

    async def routed(release: str | None = None, *, stream: bool = False) -> Generation:
        """A request that generated two tokens on `release` (None: a new one), routed."""
        gen = Generation(GenerateRequest(id="r", prompt="x", stream=stream), ReplyRoute("t"),
                         [1, 5, 6], 4, 1, release=release)
        await routes.route(gen)
        nodes = gen.nodes
        routes.unroute(gen)  # its KV booking back: each route is picked from the same load
        gen.nodes = nodes
        return gen

    try:
        old = "0.1.0"
        running({"stage-0-a": old, "stage-0-b": versions.EDGEBUS, "stage-1-a": old,
                 "stage-1-b": old})
        only_old = await routed()
        assert only_old.nodes == ["stage-0-a", "stage-1-a"]  # only 0.1.0 spans both stages
        assert only_old.history == [1, 5, 6] and only_old.restarts == 0
        running({"stage-1-b": versions.EDGEBUS})
        assert (await routed()).nodes == ["stage-0-b", "stage-1-b"]  # the coordinator's own
        assert (await routed(old)).nodes == ["stage-0-a", "stage-1-a"]  # a replay stays
        assert counters["mixed_routes"] == 0

        # The old release's last node of stage 0 goes: a replay moves to the new release,
        # and starts again from its prompt; one that streamed goes on from where it was.
        running({"stage-0-a": versions.EDGEBUS})
        moved = await routed(old)
        assert moved.nodes == ["stage-0-a", "stage-1-b"] and moved.release == versions.EDGEBUS
        assert moved.history == [1] and moved.restarts == 1
        streamed = await routed(old, stream=True)
        assert streamed.history == [1, 5, 6] and streamed.restarts == 0

        running({"stage-0-a": "0.3.0", "stage-1-b": "0.3.1"})
        assert len(set((await routed()).nodes)) == 2 and counters["mixed_routes"] == 1
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


def test_a_stage_file_of_another_cut_format_is_never_loaded_and_stays_for_a_rollback(
        tiny_llama_gguf: Path, tmp_path: Path) -> None:
    """Stage files are each box's own, cut from the model's GGUF at first start and named by
    the cut format (and llama-cpp-python's version) that made them: a release of another cut
    format beside them in the cache cuts its own and leaves theirs for a rollback."""
    version = "0.3.36"
    name = stage_gguf.stage_file(tiny_llama_gguf / GGUF_FILE, 0, 3, library_version=version,
                                 cache=tmp_path / "probe").name
    assert name.endswith(f".llama-cpp-{version}.v{stage_gguf.CUT_FORMAT}.gguf")
    cache = tmp_path / "stages"
    cache.mkdir()
    others = {cache / name.replace(f".v{stage_gguf.CUT_FORMAT}.", f".v{cut}."): f"cut {cut}"
              for cut in (stage_gguf.CUT_FORMAT - 1, stage_gguf.CUT_FORMAT + 1)}
    for path, text in others.items():
        path.write_text(text)
    cut = stage_gguf.stage_file(tiny_llama_gguf / GGUF_FILE, 0, 3, library_version=version,
                                cache=cache)
    assert cut.name == name and cut.read_bytes()[:4] == b"GGUF"
    assert {path: path.read_text() for path in others} == others


def test_edgebus_version_says_the_release_and_the_frame_version() -> None:
    """What a box runs, asked before and after its upgrade."""
    said = subprocess.run([sys.executable, "-m", "edgebus", "--version"], capture_output=True,
                          text=True, check=True).stdout
    assert said == f"edgebus {versions.EDGEBUS}, frame version {frames.VERSION}\n"
