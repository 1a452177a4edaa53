"""An alarm storm: requests past what the plant can start wait their turn, fairly, bounded.

The coordinator's waiting room (node_agent/coordinator/waiting_room.py), with
every agent an OS process over Mosquitto and the gateways real MQTT clients.
The storm is sent before the plant's one stage is started: the requests in
flight then wait for a stage, and the room holds exactly what it is shown to
hold, whatever the speed of the box; once the stage starts, every request
waiting is served. The model is the tiny random Llama in GGUF: the room, not
the model, is under test, and a token-exact answer against llama.cpp's for
the request alone shows a request that waited is served as if it had not.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from brokers import MosquittoBroker
from gguf_models import with_kv_budget
from plant_gateway import AgentProcesses, Gateway, assert_exact, gateway, requests, send

from edgebus.core.messages import GenerateRequest
from node_agent.coordinator.waiting_room import UNMEASURED_RETRY_S
from node_agent.journal import default_directory
from plant_config import Liveness, Plant, make_plant, write_plant

# Heartbeats every half second, so the room's length shows in the status soon. The
# requests in flight before the stage starts wait for it up to stage_wait_s: longer than
# any test takes to send its storm.
LIVENESS = Liveness(heartbeat_s=0.5, timeout_s=3.0, stage_wait_s=300.0)
# Two requests in flight, a gateway may hold both; ten may wait.
IN_FLIGHT, QUEUE = 2, 10
# The plant's longest wait: longer than the tests take, so no request but those that
# ask for less runs out of time.
MAX_WAIT_S = 600.0
# Tokens per request: a few decode steps of the tiny model.
TOKENS = 8
WAIT_S = 300.0
# `edgebus status`: a Python start-up and its listening window, on a loaded box.
STATUS_S = 60.0
# How long `edgebus status` listens here (its --wait). The stage has not started, so it
# never reports, and status listens all of its window for it: 2 s by default, where the
# coordinator's retained status, the one the test reads, arrives within milliseconds.
STATUS_WAIT_S = 1.0


def write_plant_file(model: Path, broker: MosquittoBroker, workdir: Path) -> tuple[Path, Plant]:
    plant = with_kv_budget(make_plant(model, stages=1, broker=f"mqtt://{broker.host}:"
                                      f"{broker.port}", plant_id="storm", weights="gguf"))
    plant = plant.model_copy(update={
        "liveness": LIVENESS,
        "broker": plant.broker.model_copy(update={"protocol": "5"}),
        "coordinator": plant.coordinator.model_copy(update={
            "max_in_flight": IN_FLIGHT, "max_in_flight_per_client": IN_FLIGHT,
            "max_queue": QUEUE, "max_wait_s": MAX_WAIT_S})})
    path = workdir / "plant.yaml"
    write_plant(plant, path)
    return path, plant


async def until_waiting(gw: Gateway, plant: Plant, count: int) -> None:
    """Until the coordinator's status shows `count` requests in its waiting room."""
    await gw.until(lambda: gw.metric(plant.coordinator.id, "queue") == count, WAIT_S)


def busy_with_retry(gw: Gateway, rid: str, words: str) -> None:
    error = gw.responses[rid].error
    assert error is not None and error.code == "busy" and words in error.message, error
    assert error.retry_after_s is not None and error.retry_after_s > 0, error


async def test_a_storm_waits_fairly_and_past_its_bound_or_deadline_is_told_when_to_retry(
        tiny_llama_gguf: Path, mosquitto_broker: MosquittoBroker, tmp_path: Path) -> None:
    """A burst past max_in_flight is served whole and token-exact, another gateway's single
    request is not served last, a waiting request can be cancelled, and past the room's
    bound or a request's deadline the answer is `busy` with a retry time; nothing is lost
    or answered twice."""
    path, plant = write_plant_file(tiny_llama_gguf, mosquitto_broker, tmp_path)
    coordinator = plant.coordinator.id
    burst = requests(TOKENS, prefix="f", count=IN_FLIGHT + 8)
    single = requests(TOKENS, prefix="p", count=1)
    with AgentProcesses(path, tmp_path) as agents:
        agents.start_coordinator()
        async with gateway(plant, "flood") as (flood, flood_bus), \
                gateway(plant, "plc") as (plc, plc_bus):
            await flood.until_online([coordinator])
            # One gateway's burst: two in flight (waiting for the stage), eight waiting.
            await send(flood_bus, plant, burst, "flood", flood)
            await until_waiting(flood, plant, len(burst) - IN_FLIGHT)
            # Another gateway's single request, behind the whole burst.
            await send(plc_bus, plant, single, "plc", plc)
            # A waiting request its gateway cancels leaves the room, answered `cancelled`.
            cancelled = requests(TOKENS, prefix="c", count=1)
            await send(plc_bus, plant, cancelled, "plc", plc)
            await until_waiting(plc, plant, len(burst) - IN_FLIGHT + 2)
            await plc_bus.publish(plant.topics.cancel("plc"), '{"id": "c0"}', qos=1)
            await plc.until(lambda: "c0" in plc.responses, WAIT_S)
            # Deadlines: none (busy at once), a short one (busy once it runs out), and one
            # past the plant's (refused, saying what the plant allows).
            deadlines = [GenerateRequest(id="now", prompt="Axis 2 fault", max_tokens=TOKENS,
                                         max_wait_s=0),
                         GenerateRequest(id="short", prompt="Axis 2 fault", max_tokens=TOKENS,
                                         max_wait_s=0.2),
                         GenerateRequest(id="long", prompt="Axis 2 fault", max_tokens=TOKENS,
                                         max_wait_s=MAX_WAIT_S + 1)]
            await send(plc_bus, plant, deadlines, "plc", plc)
            await plc.until(lambda: {"now", "short", "long"} <= set(plc.responses), WAIT_S)
            # The bound: one more fills the room, the one after is refused at once.
            full = requests(TOKENS, prefix="g", count=2)
            await send(flood_bus, plant, full, "flood", flood)
            await flood.until(lambda: "g1" in flood.responses, WAIT_S)
            assert "g0" not in flood.responses  # it waits
            await until_waiting(flood, plant, QUEUE)
            # The burst's first waiting request has waited since before `short` ran out.
            assert flood.metric(coordinator, "oldest_wait_s") >= 0.2
            # What an operator sees: the room's length and its oldest wait.
            shown = subprocess.run([sys.executable, "-m", "edgebus", "status", str(path),
                                    "--wait", str(STATUS_WAIT_S)],
                                   capture_output=True, text=True, timeout=STATUS_S).stdout
            row = next(line for line in shown.splitlines() if line.startswith(coordinator))
            assert re.search(rf"\b{QUEUE}, \d+s\b", row), shown
            agents.start_stage(plant.stages[0].node)
            served = [*burst, full[0]]
            await flood.until_answered(served, WAIT_S)
            await plc.until_answered(single, WAIT_S)
    error = plc.responses["c0"].error
    assert error is not None and error.code == "cancelled" and "while it waited" in error.message
    busy_with_retry(plc, "now", "it asked not to wait (max_wait_s 0)")
    busy_with_retry(plc, "short", "as long as its max_wait_s allows")
    error = plc.responses["long"].error
    assert error is not None and error.code == "max_wait" and "of 600 s" in error.message
    busy_with_retry(flood, "g1", f"and {QUEUE} wait for a slot, the bound is {QUEUE}")
    # Nothing had finished yet: the retry time is the one asked before any rate is known.
    assert flood.responses["g1"].error.retry_after_s == UNMEASURED_RETRY_S  # type: ignore[union-attr]
    assert_exact(plant, flood, served)
    assert_exact(plant, plc, single)
    # Round robin across gateways: the single request came behind eight of the burst, and
    # was started with the first slot the burst's next request did not take.
    assert plc.received["p0"] < max(flood.received[r.id] for r in served)
    assert all(n == 1 for gw in (flood, plc) for n in gw.answers.values())


async def test_requests_waiting_when_the_coordinator_is_killed_are_answered_after_restart(
        tiny_llama_gguf: Path, mosquitto_broker: MosquittoBroker, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Journaled before they are acknowledged, waiting requests outlive a `kill -9`, and
    the restarted coordinator serves them, once each."""
    monkeypatch.setenv("EDGEBUS_HOME", str(tmp_path / "home"))  # where the agents keep it
    path, plant = write_plant_file(tiny_llama_gguf, mosquitto_broker, tmp_path)
    coordinator = plant.coordinator.id
    journal = default_directory(plant.plant_id, plant.topic_root, coordinator)
    batch = requests(TOKENS, count=IN_FLIGHT + 4)
    with AgentProcesses(path, tmp_path) as agents:
        agents.start_coordinator()
        async with gateway(plant) as (gw, bus):
            await gw.until_online([coordinator])
            await send(bus, plant, batch, gw=gw)
            await until_waiting(gw, plant, len(batch) - IN_FLIGHT)
            assert len(list(journal.glob("*.json"))) == len(batch)
            before = gw.status(coordinator)
            assert before is not None
            agents.kill("coordinator", signal.SIGKILL)
            agents.start_coordinator()
            await gw.until_online([coordinator], after={coordinator: before.bdseq})
            agents.start_stage(plant.stages[0].node)
            await gw.until_answered(batch, WAIT_S)
            await gw.until(lambda: gw.metric(coordinator, "requests_done") >= len(batch),
                           WAIT_S)
            assert gw.metric(coordinator, "resumed") == len(batch)
            await gw.until(lambda: not list(journal.glob("*.json")), 60)
            agents.kill("coordinator", signal.SIGTERM)
            await gw.until_offline(coordinator, 60)
    assert_exact(plant, gw, batch)
    assert all(n == 1 for n in gw.answers.values()), gw.answers
