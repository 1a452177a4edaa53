"""Nothing lost: a killed stage node, a restarted broker, a coordinator that was down.

Agents run as real OS processes (`PlantProcesses`, what `edgebus up` runs)
over a real Mosquitto, because what is under test is how they behave when a
process dies or a connection drops. The expected tokens come from
`transformers` `generate` in this process: a request that failed over must
answer exactly what it would have without the fault.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from signal import SIGKILL

import aiomqtt
import pytest
from brokers import MosquittoBroker
from pipeline import reference_tokens

from edgebus.client import BusClient
from edgebus.launcher import PlantProcesses
from edgebus.messages import AgentStatus, GenerateRequest, GenerateResponse
from plant_config import Liveness, Plant, make_plant, write_plant

pytestmark = pytest.mark.slow

# Fast liveness so a test sees a dead node within seconds, as a plant would
# within its own (longer) timeout.
LIVENESS = Liveness(heartbeat_s=0.5, timeout_s=2.0, stage_wait_s=10.0)
# Per-step timeout of the coordinator: the bound on "no request hangs".
STEP_TIMEOUT_S = 30.0
# Agents importing torch side by side on a 2-core box take ~10-20 s.
ONLINE_S = 120.0
# Tokens per request: enough decode steps that a fault lands mid-generation.
TOKENS = 24
PROMPTS = [
    "The hydraulic press on line 3 reports a pressure drop. Likely causes are",
    "Summarise the lockout-tagout procedure for a conveyor motor:",
    "A PLC alarm says 'axis 2 following error'. What should the operator check?",
    "List three ways to reduce compressed-air leaks in a plant:",
    "Explain why a bearing temperature rising slowly over a week matters:",
    "Write a short shift handover note for a packaging line:",
    "What is the difference between preventive and predictive maintenance?",
    "Give two reasons a torque wrench reading may be wrong:",
]


def requests(tokens: int = TOKENS) -> list[GenerateRequest]:
    return [GenerateRequest(id=f"r{i}", prompt=p, max_tokens=tokens, ignore_eos=True,
                            stream=True) for i, p in enumerate(PROMPTS)]


def write_plant_file(model: Path, broker: MosquittoBroker, workdir: Path, *,
                     replicas: int) -> tuple[Path, Plant]:
    plant = make_plant(model, stages=2, broker=broker.url, plant_id="failover",
                       replicas=replicas)
    plant = plant.model_copy(update={
        "liveness": LIVENESS,
        "coordinator": plant.coordinator.model_copy(
            update={"request_timeout_s": STEP_TIMEOUT_S})})
    path = workdir / "plant.yaml"
    write_plant(plant, path)
    return path, plant


@dataclass
class Gateway:
    """A PLC gateway with a persistent session: responses wait for it across a broker restart."""

    plant: Plant
    client_id: str = "plc"
    responses: dict[str, GenerateResponse] = field(default_factory=dict)
    received: dict[str, float] = field(default_factory=dict)
    deltas: dict[str, int] = field(default_factory=dict)
    statuses: list[tuple[float, AgentStatus]] = field(default_factory=list)
    events: list[dict[str, str]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def on_message(self, message: aiomqtt.Message) -> None:
        payload = message.payload if isinstance(message.payload, bytes) else b""
        topic = message.topic.value
        if topic.startswith(f"{self.plant.topic_root}/status/"):
            self.statuses.append((time.monotonic(), AgentStatus.model_validate_json(payload)))
        elif topic == self.plant.topics.events:
            self.events.append(json.loads(payload))
        elif topic.endswith("/stream"):
            rid = topic.split("/")[-2]
            self.deltas[rid] = self.deltas.get(rid, 0) + 1
        else:
            response = GenerateResponse.model_validate_json(payload)
            self.responses.setdefault(response.id, response)
            self.received.setdefault(response.id, time.monotonic())
        self.changed.set()

    async def until(self, condition: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            self.changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out; responses so far: {sorted(self.responses)}")
            with suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), remaining)


@asynccontextmanager
async def gateway(plant: Plant) -> AsyncIterator[tuple[Gateway, BusClient]]:
    gw = Gateway(plant)
    topics = plant.topics
    bus = BusClient(plant.broker.endpoint(), f"{plant.plant_id}.{gw.client_id}",
                    subscriptions=[(f"{topics.root}/llm/response/{gw.client_id}/#", 1),
                                   (topics.status_filter, 1), (topics.events, 1)],
                    persistent=True)
    runner = asyncio.create_task(bus.run(gw.on_message))
    try:
        await bus.wait_connected(10)
        yield gw, bus
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


@asynccontextmanager
async def plant_running(path: Path, logs: Path) -> AsyncIterator[PlantProcesses]:
    """Every agent of the plant file as an OS process, once all are online."""
    with PlantProcesses(path, log_dir=logs) as processes:
        processes.start()
        await processes.wait_online(ONLINE_S)
        yield processes


async def mid_generation(gw: Gateway, batch: list[GenerateRequest], tokens: int) -> None:
    """Wait until every request of `batch` has streamed `tokens` tokens."""
    await gw.until(lambda: min(gw.deltas.get(r.id, 0) for r in batch) >= tokens, 60)


async def send(bus: BusClient, plant: Plant, batch: list[GenerateRequest]) -> None:
    for request in batch:
        await bus.publish(plant.topics.request("plc"), request.model_dump_json(), qos=1)


def failovers(gw: Gateway, plant: Plant) -> float:
    mine = [s for _, s in gw.statuses if s.agent_id == plant.coordinator.id]
    return mine[-1].metrics.get("failovers", 0.0) if mine else 0.0


def assert_exact(model: Path, gw: Gateway, batch: list[GenerateRequest]) -> None:
    for request in batch:
        response = gw.responses[request.id]
        assert response.error is None, response.error
        assert response.tokens == reference_tokens(model, request), request.id


async def test_kill_9_of_a_stage_node_fails_over_to_its_standby(
        smollm2_dir: Path, mosquitto_broker: MosquittoBroker, tmp_path: Path) -> None:
    path, plant = write_plant_file(smollm2_dir, mosquitto_broker, tmp_path, replicas=2)
    victim, standby = plant.pipeline[1].node_ids
    frozen = plant.pipeline[0].node_ids[0]
    batch = requests()
    hung = [r.model_copy(update={"id": f"hung-{r.id}"}) for r in batch[:4]]
    late = [r.model_copy(update={"id": f"late-{r.id}"}) for r in batch[:2]]
    async with plant_running(path, tmp_path / "logs") as processes, gateway(plant) as (gw, bus):
        await send(bus, plant, batch)
        await mid_generation(gw, batch, 3)
        killed = time.monotonic()
        os.kill(processes.pids[victim], SIGKILL)
        await gw.until(lambda: len(gw.responses) == len(batch), 120)
        # A hung box (or a cut cable): its connection stays open, only the
        # heartbeats stop. Requests spread over both stage-0 nodes; those
        # on the frozen one fail over once its heartbeat is overdue.
        await send(bus, plant, hung)
        await mid_generation(gw, hung, 3)
        os.kill(processes.pids[frozen], signal.SIGSTOP)
        await gw.until(lambda: all(r.id in gw.responses for r in hung), 120)
        os.kill(processes.pids[frozen], SIGKILL)
        # No standby left for stage 1: requests fail, clearly and in bounded time.
        os.kill(processes.pids[standby], SIGKILL)
        await gw.until(lambda: any(s.agent_id == standby and s.state == "offline"
                                   for _, s in gw.statuses), 30)
        sent = time.monotonic()
        await send(bus, plant, late)
        await gw.until(lambda: all(r.id in gw.responses for r in late),
                       LIVENESS.stage_wait_s + 30)
    # The Will: its retained status reads offline, in the MQTT session of its last
    # birth (the broker saw the connection die), and the coordinator replayed on
    # that, not on a missed heartbeat ("went offline" below).
    births = [s for t, s in gw.statuses if s.agent_id == victim and s.state == "online"
              and t < killed]
    offline = [s for _, s in gw.statuses if s.agent_id == victim and s.state == "offline"]
    assert births and offline and offline[0].bdseq == births[-1].bdseq
    # Requests were on the victim and went on elsewhere.
    replays = [e["message"] for e in gw.events if "replaying" in e["message"]]
    killed_replays = [m for m in replays if victim in m and "went offline" in m]
    hung_replays = [m for m in replays if frozen in m and "no heartbeat" in m]
    assert killed_replays and hung_replays, replays
    assert_exact(smollm2_dir, gw, batch + hung)
    for request in late:
        error = gw.responses[request.id].error
        assert error is not None and error.code == "unavailable", error
        assert "stage 1" in error.message and standby in error.message
        assert gw.received[request.id] - sent < LIVENESS.stage_wait_s + 5


async def test_a_broker_restart_mid_generation_loses_no_request(
        smollm2_dir: Path, make_mosquitto: Callable[..., MosquittoBroker],
        tmp_path: Path) -> None:
    broker = make_mosquitto(persistence=True)
    path, plant = write_plant_file(smollm2_dir, broker, tmp_path, replicas=1)
    batch = requests()
    async with plant_running(path, tmp_path / "logs") as processes:
        async with gateway(plant) as (gw, bus):
            await send(bus, plant, batch)
            await mid_generation(gw, batch, 2)
            broker.stop()
            broker.start()
            restarted = time.monotonic()
            # Every request answers: by replay, or with an error, within its timeout.
            await gw.until(lambda: len(gw.responses) == len(batch),
                           STEP_TIMEOUT_S + LIVENESS.stage_wait_s + 30)
            # Requests in flight were replayed: the coordinator counts each.
            await gw.until(lambda: failovers(gw, plant) > 0, 10)
        assert processes.poll() is None, "an agent died with the broker"
    assert max(gw.received.values()) - restarted < STEP_TIMEOUT_S + LIVENESS.stage_wait_s
    done = [r for r in batch if gw.responses[r.id].error is None]
    failed = [gw.responses[r.id].error for r in batch if gw.responses[r.id].error is not None]
    assert all(e is not None and e.code in ("timeout", "unavailable") for e in failed)
    assert_exact(smollm2_dir, gw, done)
    # Replay makes the common case a completion, not an error.
    assert len(done) == len(batch), failed


async def test_a_request_sent_while_the_coordinator_is_down_is_answered(
        smollm2_dir: Path, make_mosquitto: Callable[..., MosquittoBroker],
        tmp_path: Path) -> None:
    broker = make_mosquitto(persistence=True)
    path, plant = write_plant_file(smollm2_dir, broker, tmp_path, replicas=1)
    request = requests(tokens=8)[0]
    async with plant_running(path, tmp_path / "logs") as processes:
        coordinator = processes.pids[plant.coordinator.id]
        os.kill(coordinator, signal.SIGTERM)
        async with gateway(plant) as (gw, bus):
            await gw.until(lambda: any(s.agent_id == plant.coordinator.id
                                       and s.state == "offline" for _, s in gw.statuses), 30)
            await send(bus, plant, [request])
        # The broker restarts too, while the request waits: persistence keeps it.
        broker.stop()
        broker.start()
        async with gateway(plant) as (gw, bus):
            restarted = subprocess.Popen(
                [sys.executable, "-m", "edgebus", "coordinator", str(path)],
                stdout=(tmp_path / "coordinator-2.log").open("wb"), stderr=subprocess.STDOUT)
            try:
                await gw.until(lambda: request.id in gw.responses, 90)
            finally:
                restarted.terminate()
                restarted.wait(30)
    assert_exact(smollm2_dir, gw, [request])
