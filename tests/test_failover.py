"""Nothing lost: a killed stage node, a restarted or crashed broker, a coordinator that was down.

Agents run as real OS processes (`PlantProcesses`, what `edgebus up` runs, or
one by one with `AgentProcesses`) over a real Mosquitto, because what is under
test is how they behave when a process dies or a connection drops. The expected
tokens come from `transformers` `generate` in this process: a request that
failed over must answer exactly what it would have without the fault. The
model is the tiny random Llama, whose greedy tokens depend on their whole
history: a replay that lost or misplaced a position shows as surely as with
SmolLM2, and each process loads it in a fraction of the time.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from signal import SIGKILL

import plant_gateway
import pytest
from brokers import BrokerHandle, MosquittoBroker
from gguf_models import with_kv_budget
from plant_gateway import (
    AgentProcesses,
    Gateway,
    assert_exact,
    gateway,
    mid_generation,
    send,
)

from edgebus.core.messages import GenerateRequest
from edgebus.launcher import PlantProcesses
from plant_config import Liveness, Plant, make_plant, write_plant

# Fast liveness so a test sees a dead node within seconds, as a plant would
# within its own (longer) timeout.
LIVENESS = Liveness(heartbeat_s=0.5, timeout_s=2.0, stage_wait_s=10.0)
# The kill test's plant waits less for a stage with no live node: its last requests
# wait all of it before they are answered `unavailable`. Only they meet a stage with
# no live node (each earlier fault leaves its stage one), so a second is enough. (The
# broker tests keep LIVENESS: their stages are offline for as long as the broker
# takes to come back.)
NO_STANDBY_WAIT_S = 1.0
# Per-step timeout of the coordinator: the bound on "no request hangs".
STEP_TIMEOUT_S = 30.0
# Agents importing torch side by side on a 2-core box take ~10-20 s.
ONLINE_S = 120.0
# Tokens per request: a decode step of the tiny model takes milliseconds, so
# this many keep requests generating well past a fault that lands after their
# second or third token (the tests check the replays that show it did), while
# `generate` for the expected tokens stays cheap.
TOKENS = 48


def requests(tokens: int = TOKENS) -> list[GenerateRequest]:
    return plant_gateway.requests(tokens)


def write_plant_file(model: Path, broker: BrokerHandle, workdir: Path, *,
                     replicas: int, liveness: Liveness = LIVENESS) -> tuple[Path, Plant]:
    plant = with_kv_budget(make_plant(model, stages=2, broker=f"mqtt://{broker.host}:{broker.port}",
                                      plant_id="failover", replicas=replicas, weights="gguf"))
    plant = plant.model_copy(update={
        "liveness": liveness,
        "broker": plant.broker.model_copy(update={"protocol": "5" if broker.mqtt5 else "3.1.1"}),
        "coordinator": plant.coordinator.model_copy(
            update={"request_timeout_s": STEP_TIMEOUT_S})})
    path = workdir / "plant.yaml"
    write_plant(plant, path)
    return path, plant


@asynccontextmanager
async def plant_running(path: Path, logs: Path) -> AsyncIterator[PlantProcesses]:
    """Every agent of the plant file as an OS process, once all are online."""
    with PlantProcesses(path, log_dir=logs) as processes:
        processes.start()
        await processes.wait_online(ONLINE_S)
        yield processes


def failovers(gw: Gateway, plant: Plant) -> float:
    mine = [s for _, s in gw.statuses if s.agent_id == plant.coordinator.id]
    return mine[-1].metrics.get("failovers", 0.0) if mine else 0.0


async def test_kill_9_of_a_stage_node_fails_over_to_its_standby(
        tiny_llama_gguf: Path, mosquitto_broker: MosquittoBroker, tmp_path: Path) -> None:
    liveness = LIVENESS.model_copy(update={"stage_wait_s": NO_STANDBY_WAIT_S})
    path, plant = write_plant_file(tiny_llama_gguf, mosquitto_broker, tmp_path, replicas=2,
                                   liveness=liveness)
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
                       liveness.stage_wait_s + 30)
    # The Will: its retained status reads offline, in the MQTT session of its last
    # birth (the broker saw the connection die), and the coordinator replayed on
    # that, not on a missed heartbeat ("went offline" below).
    births = [s for t, s in gw.statuses if s.agent_id == victim and s.state == "online"
              and t < killed]
    offline = [s for _, s in gw.statuses if s.agent_id == victim and s.state == "offline"]
    assert births and offline and offline[0].bdseq == births[-1].bdseq
    # Requests were on the victim and went on elsewhere.
    replays = gw.messages("replaying")
    killed_replays = [m for m in replays if victim in m and "went offline" in m]
    hung_replays = [m for m in replays if frozen in m and "no heartbeat" in m]
    assert killed_replays and hung_replays, replays
    assert_exact(plant, gw, batch + hung)
    for request in late:
        error = gw.responses[request.id].error
        assert error is not None and error.code == "unavailable", error
        assert "stage 1" in error.message and standby in error.message
        assert gw.received[request.id] - sent < liveness.stage_wait_s + 5


# Debian's Mosquitto saves its database every 30 minutes (autosave_interval
# 1800): a crash loses whatever changed since the last save. A broker that
# saves as seldom loses, in a kill -9, every session, subscription and queued
# message it had: the worst case, not the lucky one.
DEBIAN_AUTOSAVE_S = 1800
# Mosquitto saves after every change with these (mosquitto.conf(5)).
SAVE_ON_EVERY_CHANGE = "autosave_on_changes true\n"


@pytest.mark.parametrize(("crash", "saves_every_change", "resend"), [
    (False, False, False), (True, True, False), (True, False, True)],
    ids=["restart", "kill-9, broker saves every change", "kill-9, gateway re-sends"])
async def test_a_broker_restart_or_crash_mid_generation_loses_no_request(
        crash: bool, saves_every_change: bool, resend: bool, tiny_llama_gguf: Path,
        make_mosquitto: Callable[..., MosquittoBroker], tmp_path: Path) -> None:
    """A restart saves the broker's database; after a crash, what it had not saved is
    gone: the subscription of a coordinator that reconnects after the gateway, and what
    the gateway sends meanwhile. Either the broker saves every change, or the gateway
    sends again what the coordinator (back in a new session) has not answered."""
    broker = make_mosquitto(persistence=True,
                            autosave_interval=1 if saves_every_change else DEBIAN_AUTOSAVE_S)
    if saves_every_change:
        broker.stop()
        with broker.conf_path.open("a") as conf:
            conf.write(SAVE_ON_EVERY_CHANGE)
        broker.start()
    path, plant = write_plant_file(tiny_llama_gguf, broker, tmp_path, replicas=1)
    batch = requests()
    # Sent while the broker is down: the gateway's client holds them until it is back.
    down = [r.model_copy(update={"id": f"down-{r.id}"}) for r in batch[:2]]
    coordinator = plant.coordinator.id
    with AgentProcesses(path, tmp_path) as agents:
        for stage in plant.stages:
            agents.start_stage(stage.node)
        agents.start_coordinator()
        async with gateway(plant, resend=resend) as (gw, bus):
            await gw.until_online([*(s.node for s in plant.stages), plant.coordinator.id])
            await send(bus, plant, batch, gw=gw)
            await mid_generation(gw, batch, 2)
            # Held still from before the fault, so that no request can end before it (the
            # tiny model's 48 tokens once all came out first), and back last (its reconnect
            # backoff may be the longest): until then, no session of its own may be left to
            # queue requests in.
            agents.kill(coordinator, signal.SIGSTOP)
            broker.stop(kill=crash)
            sending = asyncio.create_task(send(bus, plant, down, gw=gw))
            broker.start()
            await sending
            agents.kill(coordinator, signal.SIGCONT)
            # Every request answers, by replay, within its timeout.
            await gw.until_answered(batch + down, STEP_TIMEOUT_S + LIVENESS.stage_wait_s + 60)
            # Requests in flight were replayed: the coordinator counts each.
            await gw.until(lambda: failovers(gw, plant) > 0, 30)
            print(f"{'kill -9' if crash else 'restart'}: the gateway sent "
                  f"{gw.resent} unanswered request(s) again")
        assert all(proc.poll() is None for proc in agents.procs.values()), \
            "an agent died with the broker"
    assert_exact(plant, gw, batch + down)


@pytest.mark.parametrize("kind", ["mosquitto", "amqtt"])
async def test_a_request_sent_while_the_coordinator_is_down_is_answered(
        tiny_llama_gguf: Path, kind: str, request: pytest.FixtureRequest,
        tmp_path: Path) -> None:
    """The request waits in the coordinator's session; on Mosquitto the broker restarts too,
    and its persistence keeps it (amqtt keeps sessions in memory only)."""
    broker: BrokerHandle = (request.getfixturevalue("make_mosquitto")(persistence=True)
                            if kind == "mosquitto" else request.getfixturevalue("amqtt_broker"))
    path, plant = write_plant_file(tiny_llama_gguf, broker, tmp_path, replicas=1)
    sent = requests(tokens=8)[0]
    async with plant_running(path, tmp_path / "logs") as processes:
        coordinator = processes.pids[plant.coordinator.id]
        os.kill(coordinator, signal.SIGTERM)
        async with gateway(plant) as (gw, bus):
            await gw.until(lambda: any(s.agent_id == plant.coordinator.id
                                       and s.state == "offline" for _, s in gw.statuses), 30)
            await send(bus, plant, [sent])
        if kind == "mosquitto":
            broker.stop()
            broker.start()
        async with gateway(plant) as (gw, bus):
            restarted = subprocess.Popen(
                [sys.executable, "-m", "edgebus", "coordinator", str(path)],
                stdout=(tmp_path / "coordinator-2.log").open("wb"), stderr=subprocess.STDOUT)
            try:
                await gw.until(lambda: sent.id in gw.responses, 90)
            finally:
                restarted.terminate()
                restarted.wait(30)
    assert_exact(plant, gw, [sent])
