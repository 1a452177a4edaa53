"""`edgebus up` as an operator runs it: real processes, a real broker, real signals.

What must hold: every agent comes online and serves; SIGTERM stops all of them
cleanly (each publishes "offline") and `up` exits 0; a SIGKILLed `up` leaves no
orphan; a `kill -9` of a stage node mid-generation loses no request (its
standby takes over) and the node is restarted; an agent that keeps dying
stops the plant with exit code 1. Child pids come from the agents' retained
statuses and from /proc.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import aiomqtt
import pytest
import yaml
from brokers import BrokerHandle, free_port
from certs import tls_context
from gguf_models import PROCESS_KV_BUDGET_MB, with_kv_budget
from pipeline import plant_reference

from edgebus.core.errors import EdgebusError
from edgebus.core.messages import AgentStatus, GenerateRequest, GenerateResponse
from edgebus.core.processes import LOOPBACK
from edgebus.launcher import (
    RESTART_LIMIT,
    RESTART_MAX_DELAY_S,
    STAGE_SPINCOUNT,
    STOP_GRACE_S,
    PlantProcesses,
)
from plant_config import Plant, load_plant, make_plant, write_plant

# Two stages keep the plant at four processes (broker, stages, coordinator),
# each importing torch on what may be a two-core CI box.
STAGES = 2
# Measured: ~10 s from `up` to all online on a 2-core box, nearly all of it
# the agents importing torch and transformers side by side; 35 s and more for the
# failover test's 7 agents while two other xdist workers run their tests on the
# same 2 cores. A bound on failing, not a wait: a test goes on once all are online.
READY_S = 150.0
# `ask` is a Python start-up plus five tokens of a 64-wide model.
ASK_S = 30.0
# `up` gives its agents STOP_GRACE_S before SIGKILL, then stops the broker.
STOP_S = 2 * STOP_GRACE_S + 5.0
POLL_S = 0.05
# A killed agent is restarted after at most the backoff of its RESTART_LIMIT-th
# death, then loads (an import of torch) for as long as READY_S allows.
RESTART_S = RESTART_MAX_DELAY_S + READY_S
# Tokens per request in the failover test: enough decode steps that the kill
# lands mid-generation, which the test checks rather than assumes.
FAILOVER_TOKENS = 48
# Streamed deltas every request must have shown before the kill.
DELTAS_BEFORE_KILL = 2
# The failover test's requests answer within this after the kill: a replay is a
# prefill of a few dozen positions on a 64-wide model.
ANSWER_S = 120.0

Statuses = dict[str, AgentStatus]


def plant_file(model: Path, workdir: Path, broker: str = "embedded") -> tuple[Path, Plant]:
    """A STAGES-stage plant of llama.cpp stages (what `up` does is the same for every engine,
    and these agents start without importing torch), each reserving a small KV
    (gguf_models.with_kv_budget); with the embedded broker, on a free port (never 1883)."""
    plant = with_kv_budget(make_plant(model, stages=STAGES, broker=broker, plant_id="uptest",
                                      weights="gguf"))
    if plant.broker.embedded:
        plant = plant.model_copy(update={"broker": plant.broker.model_copy(
            update={"host": LOOPBACK, "port": free_port()})})
    path = workdir / "plant.yaml"
    write_plant(plant, path)
    return path, plant


def agent_ids(plant: Plant) -> list[str]:
    return [*(s.node for s in plant.stages), plant.coordinator.id]


# `edgebus up` whose restart backoff starts at the number in argv[1] instead of
# RESTART_DELAY_S: the launcher's own constant, set in the `up` process only, before its
# command line is read. Its restarts, their count and what it says are unchanged.
UP_WITH_RESTART_DELAY = ("import sys, edgebus.launcher as launcher; "
                         "launcher.RESTART_DELAY_S = float(sys.argv[1]); "
                         "from edgebus.cli import main; main(sys.argv[2:])")
# A backoff that doubles from this stays under a second over RESTART_LIMIT deaths
# (the 1 + 2 + 4 + 8 s of the default were most of a crash-loop test's time).
QUICK_RESTART_S = 0.05


@contextmanager
def edgebus_up(plant_path: Path, workdir: Path, *, restart_delay_s: float | None = None
               ) -> Iterator[subprocess.Popen[bytes]]:
    """`edgebus up` as a subprocess; on the way out, kills it if needed and prints its output.
    `restart_delay_s`: its first restart's backoff, instead of RESTART_DELAY_S."""
    output = workdir / "up.out"
    command = [sys.executable, "-m", "edgebus"] if restart_delay_s is None else \
        [sys.executable, "-c", UP_WITH_RESTART_DELAY, str(restart_delay_s)]
    with output.open("wb") as out:
        up = subprocess.Popen([*command, "up", str(plant_path)],
                              stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        yield up
    finally:
        children = children_of(up.pid)
        if up.poll() is None:
            up.kill()
            up.wait()
        # So that a failed test leaves nothing behind: the children die with `up`.
        wait_gone(children, STOP_S)
        print(f"--- edgebus up output ---\n{output.read_text(errors='replace')}")


def children_of(pid: int) -> list[int]:
    """Pids whose parent is `pid`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited while we looked
        # comm (field 2) is in parentheses and may hold spaces: split after it.
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == pid:
            found.append(int(entry.name))
    return found


def environment(pid: int) -> dict[str, str]:
    """The environment `pid` was started with, from /proc."""
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().partition("=")[::2] for e in entries if e)


def alive(pid: int) -> bool:
    """Whether `pid` still runs; a zombie has exited (only its status waits to be collected)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until none of `pids` runs; return those still running at `timeout`."""
    deadline = time.monotonic() + timeout
    while (running := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return running


def wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """`proc`'s exit code, or None if it still runs at `timeout`."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def all_are(agents: list[str], state: str) -> Callable[[Statuses], bool]:
    return lambda seen: all(a in seen and seen[a].state == state for a in agents)


class StatusWatch:
    """The latest retained status of every agent of a plant, kept up to date."""

    def __init__(self, client: aiomqtt.Client, events_topic: str) -> None:
        self.client = client
        self.events_topic = events_topic
        self.latest: Statuses = {}
        self.events: list[dict[str, str]] = []
        self._changed = asyncio.Event()

    async def collect(self) -> None:
        try:
            async for message in self.client.messages:
                assert isinstance(message.payload, bytes)
                if message.topic.value == self.events_topic:
                    self.events.append(json.loads(message.payload))
                    continue
                status = AgentStatus.model_validate_json(message.payload)
                self.latest[status.agent_id] = status
                self._changed.set()
        except aiomqtt.MqttError:
            pass  # the broker went away: `latest` keeps what it said last

    async def wait(self, done: Callable[[Statuses], bool], timeout: float) -> Statuses:
        async with asyncio.timeout(timeout):
            while not done(self.latest):
                self._changed.clear()
                await self._changed.wait()
        return dict(self.latest)


@asynccontextmanager
async def watch_statuses(plant: Plant, timeout: float = READY_S) -> AsyncIterator[StatusWatch]:
    """Subscribe to `{root}/status/+` and `{root}/events` (as the ops identity of a secured
    plant), retrying while the broker is not up yet."""
    endpoint = plant.ops_endpoint()
    async with asyncio.timeout(timeout):
        while True:
            client = aiomqtt.Client(endpoint.host, endpoint.port,
                                    username=endpoint.username, password=endpoint.password,
                                    identifier=plant.ops_client_id("watch"),
                                    tls_context=tls_context(endpoint))
            try:
                await client.__aenter__()
                break
            except aiomqtt.MqttError:
                await asyncio.sleep(POLL_S)
    try:
        await client.subscribe(plant.topics.status_filter, 1)
        await client.subscribe(plant.topics.events, 1)
        watch = StatusWatch(client, plant.topics.events)
        collector = asyncio.create_task(watch.collect())
        yield watch
        collector.cancel()
        await asyncio.gather(collector, return_exceptions=True)
    finally:
        await client.__aexit__(None, None, None)


async def test_up_serves_then_stops_cleanly_on_sigterm(tiny_llama_gguf: Path,
                                                      tmp_path: Path) -> None:
    plant_path, plant = plant_file(tiny_llama_gguf, tmp_path)
    agents = agent_ids(plant)
    with edgebus_up(plant_path, tmp_path) as up:
        async with watch_statuses(plant) as watch:
            online = await watch.wait(all_are(agents, "online"), READY_S)
            children = children_of(up.pid)
            assert len(children) == len(agents) + 1  # + the embedded broker
            assert {online[a].pid for a in agents} < set(children)
            # The stages' OpenMP threads sleep soon after a step, on cores they share.
            spin = {a: environment(online[a].pid).get("GOMP_SPINCOUNT") for a in agents}
            assert spin == {**{s.node: STAGE_SPINCOUNT for s in plant.stages},
                            plant.coordinator.id: None}

            ask = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "edgebus", "ask", str(plant_path), "hi",
                "--max-tokens", "5", "--json",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            out, err = await asyncio.wait_for(ask.communicate(), ASK_S)
            assert ask.returncode == 0, err.decode()
            response = GenerateResponse.model_validate_json(out)
            assert response.error is None
            assert 1 <= response.usage.completion_tokens <= 5

            up.send_signal(signal.SIGTERM)
            # Seen live: the embedded broker, and its retained messages, go with `up`.
            await watch.wait(all_are(agents, "offline"), STOP_S)
        assert wait_exit(up, STOP_S) == 0
        # `up` waited for each child before it exited: nothing is left to wait for.
        assert [pid for pid in children if alive(pid)] == []
    # The plant has no security: section, so each agent said so, once, at start.
    report = (tmp_path / "up.out").read_text()
    for agent in agents:
        warnings = [line for line in report.splitlines()
                    if line.startswith(f"[{agent}] ") and "security is off" in line]
        assert len(warnings) == 1, (agent, warnings)


async def test_children_die_with_a_sigkilled_up(tiny_llama_gguf: Path, tmp_path: Path,
                                                mosquitto_broker: BrokerHandle) -> None:
    # An external broker outlives `up`, so the statuses left behind can be read.
    plant_path, plant = plant_file(
        tiny_llama_gguf, tmp_path, f"mqtt://{mosquitto_broker.host}:{mosquitto_broker.port}")
    agents = agent_ids(plant)
    with edgebus_up(plant_path, tmp_path) as up:
        async with watch_statuses(plant) as watch:
            await watch.wait(all_are(agents, "online"), READY_S)
        children = children_of(up.pid)
        assert len(children) == len(agents)  # no broker of its own
        up.kill()
        up.wait()
        assert wait_gone(children, STOP_S) == []
    # PR_SET_PDEATHSIG sends SIGTERM, which the agents handle: a clean "offline" each,
    # retained, so a new subscriber gets it at once (the wait only bounds a hang).
    async with watch_statuses(plant) as watch:
        await watch.wait(all_are(agents, "offline"), READY_S)


def edgebus_cli(*args: str) -> str:
    """`edgebus ARGS` as an operator types it; its output (it must succeed)."""
    done = subprocess.run([sys.executable, "-m", "edgebus", *args], capture_output=True,
                          text=True, timeout=READY_S)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def on_a_free_port(plant_path: Path) -> Plant:
    """The plant file as `edgebus init` wrote it, its embedded broker moved off 1883 (where a
    Mosquitto, or another test, may listen) to a free loopback port, and its stages' KV
    budgets cut to what the tiny model's requests here need (gguf_models.with_kv_budget)."""
    data = yaml.safe_load(plant_path.read_text())
    data["broker"]["port"] = free_port()
    for stage in data["stages"]:
        stage["kv_budget_mb"] = PROCESS_KV_BUDGET_MB
    plant_path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_plant(plant_path)


async def test_kill_9_of_a_stage_node_under_up_loses_no_request_and_it_comes_back(
        tiny_llama_gguf: Path, tmp_path: Path) -> None:
    """docs/failover.md's flow as a new user follows it: `init --replicas 2`, `up`, requests,
    `kill -9` of a node. Its standby finishes its requests, token-exact; `up` restarts it.
    On llama.cpp stages, whose replay feeds the history as it was first fed, so that the
    standby's KV is bitwise the dead node's. (Restarting is `up`'s, whatever the engine; a
    torch stage's failover is checked in test_rehearse_faults.py and test_lost_frames.py.)"""
    plant_path = tmp_path / "plant.yaml"
    edgebus_cli("init", str(plant_path), "--model", str(tiny_llama_gguf), "--stages", "3",
                "--replicas", "2", "--weights", "gguf")
    plant = on_a_free_port(plant_path)
    assert plant.security is not None  # secure by default: the gateway logs in as plc-1
    agents = agent_ids(plant)
    victim = plant.pipeline[1].node_ids[0]
    batch = [GenerateRequest(id=f"r{i}", prompt=f"Press {i} reports a pressure drop of {i} bar",
                             max_tokens=FAILOVER_TOKENS, ignore_eos=True, stream=True)
             for i in range(8)]
    with edgebus_up(plant_path, tmp_path) as up:
        async with watch_statuses(plant) as watch:
            online = await watch.wait(all_are(agents, "online"), READY_S)
            async with Gateway(plant, "plc-1") as gateway:
                for request in batch:
                    await gateway.send(request)
                await gateway.until(lambda: all(gateway.deltas.get(r.id, 0) >= DELTAS_BEFORE_KILL
                                                for r in batch), ANSWER_S)
                os.kill(online[victim].pid, signal.SIGKILL)
                answered_before_kill = len(gateway.responses)
                await gateway.until(lambda: len(gateway.responses) == len(batch), ANSWER_S)
            # `up` restarted it: a new process, online, while everything else ran on.
            back = await watch.wait(lambda seen: seen[victim].state == "online"
                                    and seen[victim].pid != online[victim].pid, RESTART_S)
            assert up.poll() is None
            assert {a: back[a].pid for a in agents if a != victim} == \
                {a: online[a].pid for a in agents if a != victim}
            # And says so, once it has seen the new process's status too.
            await output_says(tmp_path / "up.out", f"{victim} online again", RESTART_S)
        up.send_signal(signal.SIGTERM)
        assert wait_exit(up, STOP_S) == 0
    # The kill landed mid-generation: requests were on the victim and were replayed.
    assert answered_before_kill < len(batch)
    assert any(victim in e["message"] and "replaying" in e["message"] for e in watch.events), \
        [e["message"] for e in watch.events]
    for request in batch:
        response = gateway.responses[request.id]
        assert response.error is None, response.error
        assert response.tokens == plant_reference(plant, request), request.id
    report = (tmp_path / "up.out").read_text()
    assert f"{victim} (pid {online[victim].pid}) was killed by SIGKILL (limit " in report
    assert "the kernel reported no OOM kill); restarting it" in report
    assert "security is off" not in report


async def output_says(path: Path, text: str, timeout: float) -> None:
    """Wait until the file at `path` holds `text`."""
    async with asyncio.timeout(timeout):
        while text not in path.read_text(errors="replace"):
            await asyncio.sleep(POLL_S)


class Gateway:
    """A PLC gateway as its own identity: sends requests, collects answers and deltas."""

    def __init__(self, plant: Plant, client_id: str) -> None:
        self.plant, self.client_id = plant, client_id
        self.responses: dict[str, GenerateResponse] = {}
        self.deltas: dict[str, int] = {}
        self._changed = asyncio.Event()
        endpoint = plant.endpoint_for(client_id)
        self.client = aiomqtt.Client(endpoint.host, endpoint.port, username=endpoint.username,
                                     password=endpoint.password,
                                     identifier=f"{plant.plant_id}.{client_id}",
                                     tls_context=tls_context(endpoint))
        self._collector: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Gateway:
        await self.client.__aenter__()
        await self.client.subscribe(self.plant.topics.response_filter(self.client_id), 1)
        self._collector = asyncio.create_task(self._collect())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._collector is not None
        self._collector.cancel()
        await asyncio.gather(self._collector, return_exceptions=True)
        await self.client.__aexit__(None, None, None)

    async def send(self, request: GenerateRequest) -> None:
        await self.client.publish(self.plant.topics.request(self.client_id),
                                  request.model_dump_json(), qos=1)

    async def _collect(self) -> None:
        async for message in self.client.messages:
            assert isinstance(message.payload, bytes)
            topic = message.topic.value
            if topic.endswith("/stream"):
                rid = topic.split("/")[-2]
                self.deltas[rid] = self.deltas.get(rid, 0) + 1
            else:
                response = GenerateResponse.model_validate_json(message.payload)
                self.responses.setdefault(response.id, response)
            self._changed.set()

    async def until(self, done: Callable[[], bool], timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while not done():
                self._changed.clear()
                await self._changed.wait()


async def test_an_agent_that_keeps_dying_stops_the_plant_with_exit_1(tiny_llama_gguf: Path,
                                                                     tmp_path: Path) -> None:
    plant_path, plant = plant_file(tiny_llama_gguf, tmp_path)
    agents = agent_ids(plant)
    victim = plant.stages[-1].node
    with edgebus_up(plant_path, tmp_path, restart_delay_s=QUICK_RESTART_S) as up:
        async with watch_statuses(plant) as watch:
            online = await watch.wait(all_are(agents, "online"), READY_S)
        children = children_of(up.pid)
        pid = online[victim].pid
        # Each of its processes is killed as soon as `up` has started it.
        for death in range(1, RESTART_LIMIT + 1):
            os.kill(pid, signal.SIGKILL)
            if death == RESTART_LIMIT:
                break
            pid = await next_child(up.pid, {*children_of(up.pid), pid}, RESTART_S)
        assert wait_exit(up, RESTART_S + STOP_S) == 1
        assert wait_gone([*children, pid], STOP_S) == []
    report = (tmp_path / "up.out").read_text()
    assert report.count("restarting it in") == RESTART_LIMIT - 1
    assert f"{victim} (pid {pid}) was killed by SIGKILL (limit " in report
    assert f"the kernel reported no OOM kill); it died {RESTART_LIMIT} times" in report
    assert "plant stops" in report and f"edgebus up {plant_path}" in report


async def next_child(parent: int, known: set[int], timeout: float) -> int:
    """The pid of a child of `parent` that is not in `known`, once there is one."""
    async with asyncio.timeout(timeout):
        while not (new := set(children_of(parent)) - known):
            await asyncio.sleep(POLL_S)
    [pid] = new
    return pid


def test_an_agent_that_cannot_start_stops_up_with_its_error(tiny_llama_gguf: Path,
                                                           tmp_path: Path) -> None:
    """A configuration error a restart would only repeat: `up` stops and quotes it."""
    plant_path = tmp_path / "plant.yaml"
    edgebus_cli("init", str(plant_path), "--model", str(tiny_llama_gguf), "--stages", "2",
                "--weights", "gguf")
    plant = on_a_free_port(plant_path)
    assert plant.security is not None
    (plant.security.credentials / "stage-1.password").unlink()
    with edgebus_up(plant_path, tmp_path) as up:
        assert wait_exit(up, READY_S + STOP_S) == 2
    report = (tmp_path / "up.out").read_text()
    assert "stage-1 (pid" in report and "exited with code 2 before it came online" in report
    assert "no password for 'stage-1'" in report
    assert "restarting" not in report


def test_a_taken_broker_port_fails_before_anything_starts(tiny_llama_gguf: Path,
                                                          tmp_path: Path) -> None:
    plant_path, plant = plant_file(tiny_llama_gguf, tmp_path)
    with socket.create_server((LOOPBACK, plant.broker.port)):  # as a Mosquitto on 1883 would
        plant_processes = PlantProcesses(plant_path)
        with pytest.raises(EdgebusError, match=f"port {plant.broker.port} .* already in use"):
            plant_processes.start()
    assert plant_processes.pids == {}


async def test_a_stage_killed_by_sigill_is_reported_with_what_to_do(
        tiny_llama_gguf: Path, tmp_path: Path) -> None:
    """SIGILL is a CPU refusing an instruction llama.cpp was built for (an Intel VM
    advertising AMX): `up` says so and where the fix is, and restarts the node."""
    plant_path, plant = plant_file(tiny_llama_gguf, tmp_path)
    victim = plant.stages[0].node
    with edgebus_up(plant_path, tmp_path, restart_delay_s=QUICK_RESTART_S) as up:
        async with watch_statuses(plant) as watch:
            online = await watch.wait(all_are(agent_ids(plant), "online"), READY_S)
            # `up` says "online again" only of an agent it has itself seen online once;
            # its table is printed when it has seen them all.
            await output_says(tmp_path / "up.out", f"plant {plant.plant_id!r} is up", READY_S)
            os.kill(online[victim].pid, signal.SIGILL)
            await output_says(tmp_path / "up.out", f"{victim} online again", RESTART_S)
        up.send_signal(signal.SIGTERM)
        assert wait_exit(up, STOP_S) == 0
    report = (tmp_path / "up.out").read_text()
    assert (f"{victim} (pid {online[victim].pid}) was killed by SIGILL: the CPU refused an "
            "instruction") in report
    assert "docs/deploy.md#llamacpp-on-the-box-weights-gguf" in report
