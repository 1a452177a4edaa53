"""Sparkplug B: what a SCADA host application reads off the broker, decoded with pysparkplug.

A real Mosquitto, a stage agent as a real OS process (`edgebus node`, so that
`kill -9` leaves its Sparkplug connection to the broker's Will), and the
coordinator in this process; a bare MQTT client subscribed to `spBv1.0/{group}/#`
decodes every message as a host application would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiomqtt
import pytest
from brokers import BrokerHandle, MosquittoBroker
from gguf_models import PROCESS_KV_BUDGET_MB
from pipeline import plant_for, running, tokenizer

# Installed apart, with --no-deps (.ci/run, docs/sparkplug.md): it pins paho-mqtt<2.
pytest.importorskip("pysparkplug", reason="pip install --no-deps pysparkplug==0.6.1")
from pysparkplug import (
    DataType,
    DBirth,
    MessageType,
    Metric,
    NBirth,
    NCmd,
    NData,
    NDeath,
    Topic,
    get_current_timestamp,
)
from test_broker_bridge import bridged_plant
from test_broker_security import SECURED_KINDS, login, secured_plant, start_secured

from broker.mosquitto_config import write_mosquitto_config
from edgebus.ask import ask
from edgebus.core.errors import PlantConfigError
from edgebus.core.messages import GenerateRequest
from edgebus.core.processes import LOOPBACK, free_port
from node_agent.coordinator.agent import Coordinator
from node_agent.sparkplug import BD_SEQ, PLANT_DEVICE, REBIRTH
from plant_config import Liveness, Plant, load_plant, make_plant, write_plant
from plant_config.schema import Ops, Sparkplug

# Heartbeats (and so Sparkplug data) every quarter second: the waits below are for
# data a heartbeat carries, so each lasts up to one. A dead node counts as dead after 2 s.
LIVENESS = Liveness(heartbeat_s=0.25, timeout_s=2.0, stage_wait_s=20.0)
# A stage process loads its layers: seconds on 2 busy cores.
ONLINE_S = 60.0
# Everything after that takes a few heartbeats; the margin is for a loaded box.
WAIT_S = 15.0


@dataclass
class Received:
    topic: Topic
    payload: Any  # the pysparkplug payload class of topic.message_type

    def metrics(self) -> dict[str, Any]:
        return {m.name: m.value for m in self.payload.metrics}


class Host:
    """Every Sparkplug message of a group, decoded with pysparkplug, in arrival order."""

    def __init__(self, client: aiomqtt.Client) -> None:
        self.client = client
        self.received: list[Received] = []
        self._births: dict[tuple[str | None, str | None], NBirth | DBirth] = {}
        self._arrived = asyncio.Event()

    async def collect(self) -> None:
        async for message in self.client.messages:
            topic = Topic.from_str(message.topic.value)
            assert isinstance(message.payload, bytes)
            assert isinstance(topic.message_type, MessageType)
            # Data and commands may leave out datatypes; the birth of the node (or device)
            # has them, so a host application decodes with it, as here.
            node = (topic.edge_node_id, topic.device_id)
            payload = topic.message_type.payload.decode(  # type: ignore[attr-defined]
                message.payload, birth=self._births.get(node))
            if isinstance(payload, NBirth | DBirth):
                self._births[node] = payload
            self.received.append(Received(topic, payload))
            self._arrived.set()

    async def wait(self, done: Callable[[Received], bool], after: int = 0) -> Received:
        """The first message past the first `after` that `done` accepts."""
        async with asyncio.timeout(WAIT_S):
            while True:
                for seen in self.received[after:]:
                    if done(seen):
                        return seen
                self._arrived.clear()
                await self._arrived.wait()


def of(kind: MessageType, node: str, device: str | None = None) -> Callable[[Received], bool]:
    return lambda r: (r.topic.message_type == kind and r.topic.edge_node_id == node
                      and r.topic.device_id == device)


@asynccontextmanager
async def host(plant: Plant, identity: str | None = None) -> AsyncIterator[Host]:
    """A host application's view: subscribed to the plant's Sparkplug group before any agent
    starts, because births are not retained. Its Will is its STATE, as Sparkplug 3.0 has it."""
    assert plant.ops is not None and plant.ops.sparkplug is not None
    endpoint = plant.endpoint_for(identity) if identity else plant.broker.endpoint()
    host_id = f"scada-{secrets.token_hex(3)}"
    # A secured broker admits only the client ids of the identity's own.
    client_id = f"{plant.plant_id}.{identity}.{host_id}" if identity else host_id
    async with aiomqtt.Client(
            endpoint.host, endpoint.port, username=endpoint.username, password=endpoint.password,
            identifier=client_id, will=aiomqtt.Will(f"spBv1.0/STATE/{host_id}", json.dumps(
                {"online": False, "timestamp": get_current_timestamp()}), qos=1, retain=True),
            protocol=aiomqtt.ProtocolVersion.V5 if endpoint.protocol == "5"
            else aiomqtt.ProtocolVersion.V311) as client:
        await client.subscribe(f"spBv1.0/{plant.ops.sparkplug.group}/#", qos=1)
        watch = Host(client)
        task = asyncio.create_task(watch.collect())
        try:
            yield watch
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def rebirth() -> bytes:
    """Node Control/Rebirth, as a host application asks for it (without the datatype, which
    the node's birth gives)."""
    now = get_current_timestamp()
    return NCmd(timestamp=now, metrics=(Metric(timestamp=now, name=REBIRTH,
                                               datatype=DataType.BOOLEAN, value=True),)).encode()


def with_sparkplug(plant: Plant) -> tuple[Plant, str]:
    group = f"edgebus-test-{secrets.token_hex(4)}"
    return plant.model_copy(update={"liveness": LIVENESS,
                                    "ops": Ops(sparkplug=Sparkplug(group=group))}), group


async def test_births_data_rebirth_and_the_ndeath_of_a_killed_stage(
        tiny_llama_gguf: Path, mosquitto_broker: MosquittoBroker, tmp_path: Path) -> None:
    # A llama.cpp stage: Sparkplug is the agent's, not the engine's, and it starts without
    # importing torch.
    plant, group = with_sparkplug(plant_for(tiny_llama_gguf, mosquitto_broker, [(0, 6)],
                                            weights="gguf", kv_budget_mb=PROCESS_KV_BUDGET_MB))
    path = tmp_path / "plant.yaml"
    write_plant(plant, path)
    stop = asyncio.Event()
    async with host(plant) as scada:
        stage = subprocess.Popen(
            [sys.executable, "-m", "edgebus", "node", str(path), "--id", "stage-0",
             "--threads", "1"],
            stdout=(tmp_path / "stage-0.log").open("wb"), stderr=subprocess.STDOUT)
        coordinator = Coordinator(plant, tokenizer=tokenizer(plant.model))
        serving = asyncio.create_task(coordinator.serve(stop))
        try:
            async with asyncio.timeout(ONLINE_S):
                await coordinator._ready.wait()
            stage_birth = await scada.wait(of(MessageType.NBIRTH, "stage-0"))
            coordinator_birth = await scada.wait(of(MessageType.NBIRTH, "coordinator"))
            # Every metric a birth names has a datatype; the stage's status is in it.
            born = stage_birth.metrics()
            assert stage_birth.payload.seq == 0
            assert {BD_SEQ, REBIRTH, "rows", "kv_bytes", "rss_bytes", "compute_s", "busy",
                    "Properties/stage", "Properties/layers"} <= born.keys()
            assert born[REBIRTH] is False and born["Properties/layers"] == "[0, 6)"
            types = {m.name: m.datatype for m in stage_birth.payload.metrics}
            assert types[BD_SEQ] == DataType.UINT64 and types["rows"] == DataType.INT64
            assert types["busy"] == DataType.DOUBLE and types["last_error"] == DataType.STRING
            assert {"tokens", "in_flight"} <= coordinator_birth.metrics().keys()
            # The plant device, healthy once the stage is online.
            device = (await scada.wait(of(MessageType.DBIRTH, "coordinator", PLANT_DEVICE)))
            assert device.metrics()["stages_total"] == device.metrics()["nodes_total"] == 1
            await scada.wait(lambda r: r.topic.device_id == PLANT_DEVICE
                             and r.metrics().get("ready") is True)

            # A request changes the counters: NDATA carries only what changed.
            before = len(scada.received)
            request = GenerateRequest(id="spb-1", prompt="Alarm 4711 means", max_tokens=8,
                                      ignore_eos=True)
            assert (await ask(plant, request, timeout=60)).error is None
            rows = await scada.wait(lambda r: of(MessageType.NDATA, "stage-0")(r)
                                    and (r.metrics().get("rows") or 0) > 0, after=before)
            assert "Properties/role" not in rows.metrics()  # unchanged since the birth
            tokens = await scada.wait(lambda r: of(MessageType.NDATA, "coordinator")(r)
                                      and (r.metrics().get("tokens") or 0) >= 8, after=before)
            assert tokens.payload.seq > 0
            # One seq per message of a node (and its device), 0 at its one birth, counting up
            # by one: no metric came or went to cost a rebirth.
            for node in ["stage-0", "coordinator"]:
                seqs = [r.payload.seq for r in scada.received if r.topic.edge_node_id == node]
                assert seqs == list(range(len(seqs))), (node, seqs)

            # Node Control/Rebirth, as a host application asks for it.
            before = len(scada.received)
            await scada.client.publish(f"spBv1.0/{group}/NCMD/stage-0", rebirth(), qos=1)
            reborn = await scada.wait(of(MessageType.NBIRTH, "stage-0"), after=before)
            assert reborn.payload.seq == 0 and reborn.metrics()[BD_SEQ] == born[BD_SEQ]

            # kill -9: the broker publishes the stage's Will, with its birth's bdSeq.
            before = len(scada.received)
            os.kill(stage.pid, signal.SIGKILL)
            death = await scada.wait(of(MessageType.NDEATH, "stage-0"), after=before)
            assert death.payload.bd_seq_metric.name == BD_SEQ
            assert death.payload.bd_seq_metric.value == born[BD_SEQ]
            down = await scada.wait(lambda r: r.topic.device_id == PLANT_DEVICE
                                    and r.metrics().get("ready") is False, after=before)
            assert down.metrics()["stages_online"] == 0
        finally:
            stage.kill()
            stage.wait()
            stop.set()
            await serving
        # A clean exit says NDEATH itself: a clean disconnect discards the Will.
        death = await scada.wait(of(MessageType.NDEATH, "coordinator"))
        assert death.payload.bd_seq_metric.value == coordinator_birth.metrics()[BD_SEQ]


@pytest.mark.parametrize("kind", SECURED_KINDS)
async def test_with_security_each_agent_publishes_only_its_own_node(
        tiny_llama: Path, tmp_path: Path, kind: str) -> None:
    plant, group = with_sparkplug(secured_plant(
        tmp_path, f"mqtt://{LOOPBACK}:{free_port(LOOPBACK)}", model=tiny_llama,
        mqtt5=kind == "mosquitto"))
    broker: BrokerHandle = start_secured(kind, plant, tmp_path)
    try:
        async with host(plant, "ops") as scada, running(plant):
            for node in ["stage-0", "stage-1"]:
                await scada.wait(of(MessageType.NBIRTH, node))
            birth = await scada.wait(of(MessageType.NBIRTH, "coordinator"))
            await scada.wait(of(MessageType.DBIRTH, "coordinator", PLANT_DEVICE))
            # A host application that joined late asks for a rebirth.
            before = len(scada.received)
            await scada.client.publish(f"spBv1.0/{group}/NCMD/coordinator", rebirth(), qos=1)
            reborn = await scada.wait(of(MessageType.NBIRTH, "coordinator"), after=before)
            assert reborn.metrics()[BD_SEQ] == birth.metrics()[BD_SEQ]
            # stage-0 may not speak for stage-1. A marker it publishes next arrives after
            # the forged death would have (a broker keeps one publisher's order).
            now = get_current_timestamp()
            forged = NDeath(timestamp=now, bd_seq_metric=Metric(
                timestamp=now, name=BD_SEQ, datatype=DataType.UINT64, value=0))
            marker = NData(timestamp=now, seq=0, metrics=(Metric(
                timestamp=now, name="marker", datatype=DataType.BOOLEAN, value=True),))
            async with login(plant, "stage-0") as stage_0:
                with contextlib.suppress(aiomqtt.MqttCodeError):  # MQTT 5 may say so
                    await stage_0.publish(f"spBv1.0/{group}/NDEATH/stage-1", forged.encode(),
                                          qos=1)
                await stage_0.publish(f"spBv1.0/{group}/NDATA/stage-0",
                                      marker.encode(include_dtypes=True), qos=1)
                await scada.wait(lambda r: "marker" in r.metrics())
            assert not any(of(MessageType.NDEATH, "stage-1")(r) for r in scada.received)
    finally:
        broker.stop()


async def test_births_of_nodes_on_a_line_broker_cross_the_bridge(tiny_llama: Path,
                                                                  tmp_path: Path) -> None:
    site_port, line_port = free_port(LOOPBACK), free_port(LOOPBACK)
    plant, _ = with_sparkplug(bridged_plant(tiny_llama, tmp_path, site_port, line_port))
    write_mosquitto_config(plant, tmp_path / "site", bind=LOOPBACK)
    write_mosquitto_config(plant, tmp_path / "line", broker="line", bind=LOOPBACK)
    site = MosquittoBroker(tmp_path / "mosquitto-site", port=site_port,
                           include_dir=tmp_path / "site")
    line = MosquittoBroker(tmp_path / "mosquitto-line", port=line_port,
                           include_dir=tmp_path / "line")
    try:
        site.start()
        line.start()
        # The SCADA is on the site broker; stage-0 and stage-2 publish to the line broker.
        async with host(plant, "ops") as scada, running(plant):
            for node in ["stage-0", "stage-1", "stage-2", "coordinator"]:
                await scada.wait(of(MessageType.NBIRTH, node))
    finally:
        line.stop()
        site.stop()


@pytest.mark.parametrize("group", ["line/3", "line+", "#", ""])
def test_a_group_id_that_is_no_topic_level_is_refused(tiny_llama: Path, tmp_path: Path,
                                                      group: str) -> None:
    path = tmp_path / "plant.yaml"
    write_plant(make_plant(tiny_llama, stages=1), path)
    with path.open("a") as file:
        file.write(f"ops:\n  sparkplug:\n    group: {json.dumps(group)}\n")
    with pytest.raises(PlantConfigError, match=r"ops\.sparkplug\.group: Sparkplug group id .* "
                                               "cannot be an MQTT topic level"):
        load_plant(path)
