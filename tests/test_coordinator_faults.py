"""The coordinator can die: `kill -9` mid-generation, then a restart, or a second one.

Every agent is an OS process over a real broker, and the gateway a real MQTT
client with a persistent session, as a PLC gateway's would be. The model is
the tiny random Llama: what is under test is the coordinator's death, and a
token-exact answer on it shows a request resumed with the right history as
well as SmolLM2 would, for a fraction of the load and decode time. A request is
answered once: after every expected answer, every coordinator is stopped and
its "offline" status awaited. A coordinator publishes that status after all
its answers, on the same connection, and the broker passes one client's
messages on in the order it received them, so any second answer, from any
coordinator, has arrived by then; no order between coordinators is assumed.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from brokers import AmqttBroker, BrokerHandle, MosquittoBroker
from gguf_models import with_kv_budget
from plant_gateway import (
    AgentProcesses,
    Gateway,
    assert_exact,
    gateway,
    mid_generation,
    requests,
    send,
)

from broker.mosquitto_config import write_mosquitto_config
from edgebus.core.errors import EdgebusError
from edgebus.core.processes import LOOPBACK
from node_agent.coordinator.agent import Coordinator
from node_agent.journal import default_directory
from plant_config import Liveness, Plant, make_plant, write_plant
from plant_config.broker_section import Security

# Fast liveness, so a dead agent is seen within seconds.
LIVENESS = Liveness(heartbeat_s=0.5, timeout_s=3.0, stage_wait_s=60.0)
# Tokens per request. A decode step of the tiny model takes milliseconds: 45
# more after the third, when the kill lands, keep every request generating
# well past it (the tests check that it did, by `resumed`, rather than assume
# it), while `generate` for the expected tokens stays cheap.
TOKENS = 48
WAIT_S = 600.0
# A refused coordinator exits once it has read the plant file and its tokenizer (~5 s
# on 2 cores, importing torch): a wide margin for a loaded box.
REFUSED_S = 120.0


def write_plant_file(model: Path, broker: BrokerHandle, workdir: Path, plant_id: str, *,
                     instances: tuple[str, ...] = (),
                     security: Security | None = None) -> tuple[Path, Plant]:
    plant = with_kv_budget(make_plant(model, stages=2,
                                      broker=f"mqtt://{broker.host}:{broker.port}",
                                      plant_id=plant_id, weights="gguf"))
    plant = plant.model_copy(update={
        "liveness": LIVENESS,
        "broker": plant.broker.model_copy(update={"protocol": "5" if broker.mqtt5 else "3.1.1"}),
        "coordinator": plant.coordinator.model_copy(update={"instances": list(instances)}),
        "security": security})
    path = workdir / "plant.yaml"
    write_plant(plant, path)
    return path, plant


async def answered_once(gw: Gateway, agents: AgentProcesses, coordinators: dict[str, str],
                        expected: list[str]) -> None:
    """Wait for `expected` answers, stop every coordinator (agent id: process name) and
    wait for its "offline" status, then check each request was answered once."""
    await gw.until(lambda: all(rid in gw.responses for rid in expected), WAIT_S)
    for name in coordinators.values():
        agents.kill(name, signal.SIGTERM)
    for agent_id in coordinators:
        await gw.until_offline(agent_id, 60)
    twice = {rid: n for rid, n in gw.answers.items() if n != 1}
    assert not twice, f"answered more than once: {twice}"


@pytest.mark.parametrize("kind", ["mosquitto", "amqtt"])
async def test_a_coordinator_killed_mid_generation_answers_every_request_once_restarted(
        kind: str, tiny_llama_gguf: Path, tmp_path: Path, request: pytest.FixtureRequest,
        monkeypatch: pytest.MonkeyPatch) -> None:
    broker: BrokerHandle = request.getfixturevalue(f"{kind}_broker")
    path, plant = write_plant_file(tiny_llama_gguf, broker, tmp_path, "restart")
    monkeypatch.setenv("EDGEBUS_HOME", str(tmp_path / "home"))  # where the agents keep it
    journal = default_directory(plant.plant_id, plant.topic_root, plant.coordinator.id)
    coordinator = plant.coordinator.id
    batch = requests(TOKENS, count=4)
    with AgentProcesses(path, tmp_path) as agents:
        for stage in plant.stages:
            agents.start_stage(stage.node)
        agents.start_coordinator()
        async with gateway(plant) as (gw, bus):
            await gw.until_online([*(s.node for s in plant.stages), coordinator])
            await send(bus, plant, batch)
            await mid_generation(gw, batch, 3)
            before = gw.status(coordinator)
            assert before is not None
            agents.kill("coordinator")  # kill -9: no clean exit, no offline status of its own
            agents.start_coordinator()  # as systemd's Restart=on-failure would
            await gw.until_online([coordinator], after={coordinator: before.bdseq})
            await gw.until_answered(batch, WAIT_S)
            # Every one of them came back from the journal, and the journal is empty again.
            await gw.until(lambda: gw.metric(coordinator, "requests_done") >= len(batch),
                           WAIT_S)
            assert gw.metric(coordinator, "resumed") == len(batch)
            await gw.until(lambda: not list(journal.glob("*.json")), 60)
            await answered_once(gw, agents, {coordinator: "coordinator"},
                                [r.id for r in batch])
    assert_exact(plant, gw, batch)


async def test_two_coordinators_share_requests_and_either_can_die(
        tiny_llama_gguf: Path, tmp_path: Path) -> None:
    """With security on, as `edgebus init` sets it up: both log in as the coordinator,
    and each one's status and Will, which the other watches, must pass the ACL."""
    conf = tmp_path / "conf"
    broker = MosquittoBroker(tmp_path / "mosquitto", include_dir=conf)
    path, plant = write_plant_file(
        tiny_llama_gguf, broker, tmp_path, "pair", instances=("b",),
        security=Security(credentials=tmp_path / "credentials", gateways=["plc"], ops=["ops"]))
    write_mosquitto_config(plant, conf, bind=LOOPBACK)
    first, second = plant.coordinator.id, f"{plant.coordinator.id}.b"
    processes = {first: "coordinator", second: "coordinator-b"}
    everyone = []
    with broker, AgentProcesses(path, tmp_path) as agents:
        for stage in plant.stages:
            agents.start_stage(stage.node)

        def start(coordinator: str) -> None:
            agents.start_coordinator(instance=None if coordinator == first else "b",
                                     name=processes[coordinator])

        start(first)
        start(second)
        async with gateway(plant) as (gw, bus):
            await gw.until_online([*(s.node for s in plant.stages), first, second])
            for round_, (victim, survivor) in enumerate([(first, second), (second, first)]):
                batch = requests(TOKENS, prefix=f"{round_}-", count=8)
                await send(bus, plant, batch)
                await mid_generation(gw, batch, 3)
                dead = gw.status(victim)
                assert dead is not None
                agents.kill(processes[victim])
                await gw.until_offline(victim, 60)
                # New requests, while the victim is down: the survivor answers all of
                # them, those the broker handed to the victim's session too.
                later = requests(8, prefix=f"{round_}-later-", count=4)
                await send(bus, plant, later)
                await gw.until_answered(later, WAIT_S)
                assert agents.procs[processes[victim]].poll() is not None  # still dead
                # The victim's own requests in flight wait in its journal for its restart.
                start(victim)
                await gw.until_online([victim], after={victim: dead.bdseq})
                # The kill landed mid-generation: some of the batch was the victim's, in
                # flight, and its new process took those from its journal.
                assert gw.metric(victim, "resumed") > 0
                await gw.until_answered(batch, WAIT_S)
                everyone += batch + later
                print(f"round {round_}: {survivor} served {gw.metric(survivor, 'drained'):.0f} "
                      f"request(s) from {victim}'s session; {victim} resumed "
                      f"{gw.metric(victim, 'resumed'):.0f} from its journal")
            await answered_once(gw, agents, processes, [r.id for r in everyone])
    assert_exact(plant, gw, everyone)


def test_several_coordinators_need_mqtt_5_and_a_declared_name(
        tiny_llama_gguf: Path, amqtt_broker: AmqttBroker, mosquitto_broker: MosquittoBroker,
        tmp_path: Path) -> None:
    _, plant = write_plant_file(tiny_llama_gguf, amqtt_broker, tmp_path, "amqtt", instances=("b",))
    with pytest.raises(EdgebusError, match="MQTT 5 shared subscription"):
        Coordinator(plant, journal_dir=tmp_path / "journal")
    _, plant = write_plant_file(tiny_llama_gguf, mosquitto_broker, tmp_path, "mosquitto")
    with pytest.raises(EdgebusError, match=r"not in the plant file's coordinator\.instances"):
        Coordinator(plant, instance="c", journal_dir=tmp_path / "journal")


async def test_a_second_coordinator_with_the_same_id_and_home_is_refused(
        tiny_llama_gguf: Path, amqtt_broker: AmqttBroker, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`edgebus coordinator` started twice on one box (one by hand beside systemd's): the
    second stops at once, naming the first, which goes on serving."""
    path, plant = write_plant_file(tiny_llama_gguf, amqtt_broker, tmp_path, "twice")
    monkeypatch.setenv("EDGEBUS_HOME", str(tmp_path / "home"))  # where the agents keep it
    journal = default_directory(plant.plant_id, plant.topic_root, plant.coordinator.id)
    with AgentProcesses(path, tmp_path) as agents:
        agents.start_coordinator()
        async with gateway(plant) as (gw, _):
            await gw.until_online([plant.coordinator.id])
        # Refused, it exits; let in, it would serve until killed and time out here.
        second = subprocess.run([sys.executable, "-m", "edgebus", "coordinator", str(path)],
                                env=agents.env, capture_output=True, text=True,
                                timeout=REFUSED_S)
        assert second.returncode != 0
        assert f"another coordinator process (pid {agents.pid('coordinator')})" in second.stderr
        assert agents.procs["coordinator"].poll() is None, agents.log("coordinator")
        agents.kill("coordinator", signal.SIGTERM)
        assert agents.procs["coordinator"].returncode == 0, agents.log("coordinator")
    assert not journal.parent.exists()  # the lock went with it, and an empty journal
