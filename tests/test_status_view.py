"""The ops view: retained statuses with numbers to chart, bdseq, the plan, `edgebus status`.

Everything goes through real brokers. The bdseq test cuts an agent's TCP
connection under it (a proxy between agent and broker drops it, as a pulled
cable would), so the broker publishes the agent's real Last Will.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import aiomqtt
from brokers import AmqttBroker, BrokerHandle
from pipeline import ask_all, plant_for, running

from edgebus.core import versions
from edgebus.core.client import BusClient
from edgebus.core.endpoint import BrokerEndpoint
from edgebus.core.frames import VERSION
from edgebus.core.messages import AgentStatus, GenerateRequest
from edgebus.core.topics import Topics
from edgebus.status_view import ClusterView
from node_agent.runtime import presence, publish_plan, serve_until
from node_agent.status_payload import StatusPayload
from plant_config import CoordinatorSpec, Liveness, write_plant

# A status per 0.3 s: the test sees several heartbeats within a second or two.
HEARTBEAT_S = 0.3
# Generous: `edgebus status` is a Python start-up plus a 2 s listening window at most.
STATUS_CLI_S = 30.0
# How long an expected status (a birth, a Will, a last error) may take to show up,
# polled with `edgebus status` runs that each start a Python: seconds apiece on
# a loaded box. Only a bound on a hang; nothing is timed.
EXPECT_S = 60.0
# Tokens the test request generates, so the coordinator's counter has something to count.
TOKENS = 8
# Between the two statuses whose rate is checked: long enough that the clock's
# resolution does not matter.
RATE_PAUSE_S = 0.2
# Agents count as stale (and as dead, to the coordinator) after this long without
# a heartbeat: far above HEARTBEAT_S, so that a loaded box that delays a few
# heartbeats does not fail the test; it checks freshness, not staleness.
LIVENESS_TIMEOUT_S = 30.0
# How long `edgebus status` listens for the agent that never ran: its default of 2 s is
# margin for a remote broker, which the test's on this host does not need.
MISSING_WAIT_S = "0.5"


# MQTT's fixed header: the packet type in the first byte's high nibble (PUBACK: 4), then
# the remaining length in up to four bytes of seven bits each.
PUBACK_TYPE = 4
LENGTH_BYTES_MAX = 4


class CuttableProxy:
    """A TCP proxy to the broker whose connections the test can drop without a DISCONNECT,
    and whose PUBACKs to the client wait while `pubacks` is clear (what follows them too)."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.port = 0
        self.pubacks = asyncio.Event()
        self.pubacks.set()
        self._transports: list[asyncio.WriteTransport] = []

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[CuttableProxy]:
        server = await asyncio.start_server(self._accept, self.target[0], 0)
        self.port = server.sockets[0].getsockname()[1]
        async with server:
            yield self
            self.cut()

    def cut(self) -> None:
        """Abort every proxied connection, both ways: the broker sees its client vanish."""
        for transport in self._transports:
            transport.abort()
        self._transports.clear()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._transports += [writer.transport, up_writer.transport]
        await asyncio.gather(_pipe(reader, up_writer), self._to_client(up_reader, writer))

    async def _to_client(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        """The broker's packets, one at a time, each PUBACK once `pubacks` is set."""
        with suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                packet = await reader.readexactly(1)
                length = shift = 0
                for _ in range(LENGTH_BYTES_MAX):
                    byte = (await reader.readexactly(1))[0]
                    packet += bytes([byte])
                    length |= (byte & 0x7F) << shift
                    shift += 7
                    if byte < 0x80:
                        break
                packet += await reader.readexactly(length)
                if packet[0] >> 4 == PUBACK_TYPE:
                    await self.pubacks.wait()
                writer.write(packet)
                await writer.drain()
        writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with suppress(ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.close()


def endpoint_via(broker: BrokerHandle, port: int) -> BrokerEndpoint:
    return BrokerEndpoint(host=broker.host, port=port, tls=False, username=None, password=None,
                          protocol="5" if broker.mqtt5 else "3.1.1", ca_file=None,
                          keepalive_s=30)


async def next_status(messages: AsyncIterator[aiomqtt.Message],
                      wanted: Callable[[AgentStatus], bool]) -> AgentStatus:
    async with asyncio.timeout(EXPECT_S):
        async for message in messages:
            assert isinstance(message.payload, bytes)
            status = AgentStatus.model_validate_json(message.payload)
            if wanted(status):
                return status
    raise AssertionError("the subscription ended")


async def test_an_agent_stopped_before_its_birth_is_acknowledged_leaves_offline(
        broker: BrokerHandle) -> None:
    """A stop after the online status reached the broker, before its PUBACK reached the
    agent, still leaves the retained status offline: the clean DISCONNECT sends no Will to
    say so (`edgebus up` killed as its agents came online, on a loaded box)."""
    topics = Topics(f"edgebus-test/{secrets.token_hex(4)}")
    proxy = CuttableProxy(broker.host, broker.port)
    proxy.pubacks.clear()  # the birth's PUBACK waits in the proxy
    async with (proxy.serving(),
                aiomqtt.Client(broker.host, broker.port,
                               identifier=f"watch-{secrets.token_hex(4)}") as watcher):
        await watcher.subscribe(topics.status("agent-x"), 1)
        agent = BusClient(endpoint_via(broker, proxy.port), f"early-{secrets.token_hex(4)}",
                          presence=presence(topics, "agent-x", "stage", stage=0, layers=(0, 3)))
        stop = asyncio.Event()
        # No heartbeat within the test: it would say online again.
        runner = asyncio.create_task(serve_until(stop, agent, lambda message: None,
                                                 heartbeat_s=LIVENESS_TIMEOUT_S))
        await next_status(watcher.messages, lambda s: s.state == "online")
        stop.set()
        offline = asyncio.create_task(
            next_status(watcher.messages, lambda s: s.state == "offline"))
        # The agent says offline (and waits for its PUBACK too), or leaves without a word.
        await asyncio.wait([offline, runner], return_when=asyncio.FIRST_COMPLETED)
        proxy.pubacks.set()
        await runner
        offline.cancel()
    async with aiomqtt.Client(broker.host, broker.port,
                              identifier=f"late-{secrets.token_hex(4)}") as late:
        await late.subscribe(topics.status("agent-x"), 1)
        left = await next_status(late.messages, lambda s: True)  # the retained one
    assert left.state == "offline"


async def test_will_carries_its_births_bdseq_and_a_reconnect_starts_the_next(
        broker: BrokerHandle) -> None:
    topics = Topics(f"edgebus-test/{secrets.token_hex(4)}")
    async with (CuttableProxy(broker.host, broker.port).serving() as proxy,
                aiomqtt.Client(broker.host, broker.port,
                               identifier=f"watch-{secrets.token_hex(4)}") as watcher):
        await watcher.subscribe(topics.status("agent-x"), 1)
        agent = BusClient(endpoint_via(broker, proxy.port), f"bdseq-{secrets.token_hex(4)}",
                          presence=presence(topics, "agent-x", "stage", stage=0, layers=(0, 3)))
        runner = asyncio.create_task(agent.run(lambda message: None))
        try:
            messages = watcher.messages
            birth = await next_status(messages, lambda s: s.state == "online")
            assert birth.bdseq > 0 and birth.rss_bytes and birth.rss_bytes > 0
            assert birth.uptime_s is not None and birth.uptime_s >= 0

            proxy.cut()
            death = await next_status(messages, lambda s: s.state == "offline")
            assert death.bdseq == birth.bdseq  # the Will built for that connection
            rebirth = await next_status(messages, lambda s: s.state == "online")
            assert rebirth.bdseq == birth.bdseq + 1
            # Let the birth's PUBACK land first: on Python 3.11 a cancel that races
            # it inside aiomqtt's asyncio.wait_for is swallowed and run() goes on.
            await agent.wait_connected(EXPECT_S)
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)

    # What bdseq is for: the Will of the first session, arriving late, loses.
    view = ClusterView()
    view.take(rebirth)
    view.take(death)
    assert view.statuses["agent-x"] == rebirth
    view.take(death.model_copy(update={"bdseq": rebirth.bdseq}))  # this session's death wins
    assert view.statuses["agent-x"].state == "offline"


def test_status_carries_rates_of_its_counters() -> None:
    counters = {"tokens": 0.0, "in_flight": 2.0}
    payload = StatusPayload("coordinator", "coordinator", metrics=lambda: dict(counters))
    # The rate's interval runs between the clock reads inside the two payload()
    # calls: it starts after `before`, ends before `after`, and holds the pause.
    before = time.monotonic()
    first = AgentStatus.model_validate_json(payload("online", 7))
    assert "tokens_per_s" not in first.metrics  # no interval yet
    time.sleep(RATE_PAUSE_S)
    counters["tokens"] = 10.0
    second = AgentStatus.model_validate_json(payload("online", 7))
    after = time.monotonic()
    assert 10.0 / (after - before) <= second.metrics["tokens_per_s"] <= 10.0 / RATE_PAUSE_S
    assert second.metrics["in_flight"] == 2.0 and "in_flight_per_s" not in second.metrics
    assert second.bdseq == 7


async def edgebus_status(plant_path: Path, *args: str) -> tuple[int, str]:
    """`edgebus status` as an operator runs it; its exit code and output."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "edgebus", "status", str(plant_path), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), STATUS_CLI_S)
    assert proc.returncode is not None
    assert proc.returncode in (0, 1), err.decode()
    return proc.returncode, out.decode()


async def status_json_until(plant_path: Path, done: Callable[[dict[str, Any]], bool]
                            ) -> tuple[int, dict[str, Any]]:
    data: dict[str, Any] = {}
    try:
        async with asyncio.timeout(EXPECT_S):
            while True:
                code, out = await edgebus_status(plant_path, "--json")
                data = json.loads(out)
                if done(data):
                    return code, data
                await asyncio.sleep(HEARTBEAT_S)
    except TimeoutError:
        raise AssertionError(f"`edgebus status` never showed it; last: {data}") from None


def agent(data: dict[str, Any], agent_id: str) -> dict[str, Any]:
    return next(a for a in data["agents"] if a["agent_id"] == agent_id)


async def test_edgebus_status_shows_the_live_plant(tiny_llama: Path, amqtt_broker: AmqttBroker,
                                                   tmp_path: Path) -> None:
    plant = plant_for(tiny_llama, amqtt_broker, [(0, 3), (3, 6)]).model_copy(
        update={"liveness": Liveness(heartbeat_s=HEARTBEAT_S, timeout_s=LIVENESS_TIMEOUT_S)})
    plant_path = tmp_path / "plant.yaml"
    write_plant(plant, plant_path)
    async with running(plant):
        tool = BusClient(plant.broker.endpoint(), f"test.tool-{secrets.token_hex(4)}")
        runner = asyncio.create_task(tool.run(lambda message: None))
        try:
            await publish_plan(tool, plant)
            # No stage can read this: stage-1 reports an error, its status says so.
            await tool.publish(plant.topics.activations("stage-1"), b"not a frame")
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
        [response] = await ask_all(plant, [GenerateRequest(
            id="r1", prompt="hello", max_tokens=TOKENS, ignore_eos=True)])
        assert response.error is None

        code, data = await status_json_until(plant_path, lambda d: (
            agent(d, "stage-1")["status"]["last_error"] is not None
            and agent(d, "coordinator")["status"]["metrics"].get("tokens") == TOKENS
            # A stage frees a request's KV on RELEASE, which may land after the answer.
            and all(agent(d, node)["status"]["metrics"].get("kv_bytes") == 0
                    for node in ("stage-0", "stage-1"))
            and "busy" in agent(d, "stage-0")["status"]["metrics"]))
        assert code == 0
        assert [a["agent_id"] for a in data["agents"]] == ["stage-0", "stage-1", "coordinator"]
        assert data["plan"]["stages"] == [{"index": 0, "layers": [0, 3], "nodes": ["stage-0"]},
                                          {"index": 1, "layers": [3, 6], "nodes": ["stage-1"]}]
        assert data["plan"]["coordinator"] == "coordinator"
        for index, node in enumerate(["stage-0", "stage-1"]):
            entry = agent(data, node)
            status = entry["status"]
            assert entry["state"] == "online" and 0 <= entry["age_s"] < plant.liveness.timeout_s
            assert (status["role"], status["stage"]) == ("stage", index)
            assert status["layers"] == list(plant.stages[index].layers)
            assert status["rss_bytes"] > 0 and status["uptime_s"] > 0 and status["bdseq"] > 0
            assert status["metrics"]["rows"] > 0 and status["metrics"]["kv_bytes"] == 0
            assert 0 <= status["metrics"]["busy"] <= 1 and status["metrics"]["rows_per_s"] >= 0
        # The stage's own words for the frame it dropped, whatever they are.
        last_error = agent(data, "stage-1")["status"]["last_error"]
        assert last_error.startswith("dropped ")
        assert f"frame on {plant.topics.activations('stage-1')}" in last_error
        assert agent(data, "stage-0")["status"]["last_error"] is None
        coordinator = agent(data, "coordinator")["status"]
        assert coordinator["role"] == "coordinator" and coordinator["metrics"]["in_flight"] == 0
        assert coordinator["metrics"]["tokens_per_s"] >= 0

        code, text = await edgebus_status(plant_path)
        assert code == 0
        lines = text.splitlines()
        assert lines[0] == f"plant 'test', topic root {plant.topic_root}"
        assert lines[1] == "plan: 0: [0, 3) stage-0  1: [3, 6) stage-1"
        # Last, what the link speaks: this plant, made here without TLS, in clear.
        assert lines[-1].startswith("TLS: off: the plant's broker speaks plain MQTT")
        table = [re.split(r"\s{2,}", line) for line in lines[2:-1]]
        header = table[0]
        rows = {row[0]: dict(zip(header, row, strict=True)) for row in table[1:]}
        assert header[:8] == ["AGENT", "ROLE", "STAGE", "LAYERS", "ENGINE", "VERSION", "STATE",
                              "AGE"]
        assert list(rows) == ["stage-0", "stage-1", "coordinator"]
        assert rows["stage-1"]["LAYERS"] == "[3, 6)" and rows["stage-1"]["STATE"] == "online"
        assert rows["stage-1"]["ENGINE"].startswith("torch fp32 x")
        assert rows["coordinator"]["ENGINE"] == "-"
        # The release and the frame version each agent speaks; a torch stage cuts no file.
        assert {row["VERSION"] for row in rows.values()} == {f"{versions.EDGEBUS} f{VERSION}"}
        assert rows["stage-1"]["LAST ERROR"].startswith("dropped ")
        assert rows["coordinator"]["IN FLIGHT"] == "0" and rows["stage-0"]["LAST ERROR"] == "-"
        assert rows["coordinator"]["DRAFTS"] == "-"  # the plant does not draft
        assert rows["stage-0"]["RSS"].endswith(("M", "G"))

        # A plant file naming an agent that never ran: it is missing, and the
        # agent the broker knows but the file does not name is still listed.
        other = plant.model_copy(update={"coordinator": CoordinatorSpec(id="standby")})
        other_path = tmp_path / "other.yaml"
        write_plant(other, other_path)
        # It waits --wait for the agent that never reports; the retained statuses of the
        # others arrive within milliseconds of subscribing.
        code, out = await edgebus_status(other_path, "--json", "--wait", MISSING_WAIT_S)
        other_data = json.loads(out)
        assert code == 1
        assert agent(other_data, "standby")["state"] == "missing"
        assert agent(other_data, "coordinator")["state"] == "online"

    # Stopped cleanly, every agent says offline itself.
    code, data = await status_json_until(
        plant_path, lambda d: all(a["state"] == "offline" for a in d["agents"]))
    assert code == 1
