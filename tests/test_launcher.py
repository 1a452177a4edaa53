"""`edgebus up` as an operator runs it: real processes, a real broker, real signals.

What must hold: every agent comes online and serves; SIGTERM stops all of them
cleanly (each publishes "offline") and `up` exits 0; a SIGKILLed `up` leaves no
orphan; a child that dies takes the plant down with exit code 1. Child pids
come from the agents' retained statuses and from /proc.
"""

from __future__ import annotations

import asyncio
import os
import secrets
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
from brokers import LOOPBACK, BrokerHandle, free_port

from edgebus.errors import EdgebusError
from edgebus.launcher import STOP_GRACE_S, PlantProcesses
from edgebus.messages import AgentStatus, GenerateResponse
from plant_config import Plant, make_plant, write_plant

# Two stages keep the plant at four processes (broker, stages, coordinator),
# each importing torch on what may be a two-core CI box.
STAGES = 2
# Measured: ~10 s from `up` to all online on a 2-core box, nearly all of it
# the agents importing torch and transformers side by side.
READY_S = 45.0
# `ask` is a Python start-up plus five tokens of a 64-wide model.
ASK_S = 30.0
# `up` gives its agents STOP_GRACE_S before SIGKILL, then stops the broker.
STOP_S = 2 * STOP_GRACE_S + 5.0
POLL_S = 0.05

Statuses = dict[str, AgentStatus]


def plant_file(model: Path, workdir: Path, broker: str = "embedded") -> tuple[Path, Plant]:
    """A STAGES-stage plant; with the embedded broker, on a free port (never 1883)."""
    plant = make_plant(model, stages=STAGES, broker=broker, plant_id="uptest")
    if plant.broker.embedded:
        plant = plant.model_copy(update={"broker": plant.broker.model_copy(
            update={"host": LOOPBACK, "port": free_port()})})
    path = workdir / "plant.yaml"
    write_plant(plant, path)
    return path, plant


def agent_ids(plant: Plant) -> list[str]:
    return [*(s.node for s in plant.stages), plant.coordinator.id]


@contextmanager
def edgebus_up(plant_path: Path, workdir: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`edgebus up` as a subprocess; on the way out, kills it if needed and prints its output."""
    output = workdir / "up.out"
    with output.open("wb") as out:
        up = subprocess.Popen([sys.executable, "-m", "edgebus", "up", str(plant_path)],
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

    def __init__(self, client: aiomqtt.Client) -> None:
        self.client = client
        self.latest: Statuses = {}
        self._changed = asyncio.Event()

    async def collect(self) -> None:
        try:
            async for message in self.client.messages:
                assert isinstance(message.payload, bytes)
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
    """Subscribe to `{root}/status/+`, retrying while the broker is not up yet."""
    endpoint = plant.broker.endpoint()
    async with asyncio.timeout(timeout):
        while True:
            client = aiomqtt.Client(endpoint.host, endpoint.port,
                                    identifier=f"watch-{secrets.token_hex(4)}")
            try:
                await client.__aenter__()
                break
            except aiomqtt.MqttError:
                await asyncio.sleep(POLL_S)
    try:
        await client.subscribe(plant.topics.status_filter, 1)
        watch = StatusWatch(client)
        collector = asyncio.create_task(watch.collect())
        yield watch
        collector.cancel()
        await asyncio.gather(collector, return_exceptions=True)
    finally:
        await client.__aexit__(None, None, None)


async def test_up_serves_then_stops_cleanly_on_sigterm(tiny_llama: Path, tmp_path: Path) -> None:
    plant_path, plant = plant_file(tiny_llama, tmp_path)
    agents = agent_ids(plant)
    with edgebus_up(plant_path, tmp_path) as up:
        async with watch_statuses(plant) as watch:
            online = await watch.wait(all_are(agents, "online"), READY_S)
            children = children_of(up.pid)
            assert len(children) == len(agents) + 1  # + the embedded broker
            assert {online[a].pid for a in agents} < set(children)

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
        assert wait_gone(children, 1.0) == []


async def test_children_die_with_a_sigkilled_up(tiny_llama: Path, tmp_path: Path,
                                                mosquitto_broker: BrokerHandle) -> None:
    # An external broker outlives `up`, so the statuses left behind can be read.
    plant_path, plant = plant_file(
        tiny_llama, tmp_path, f"mqtt://{mosquitto_broker.host}:{mosquitto_broker.port}")
    agents = agent_ids(plant)
    with edgebus_up(plant_path, tmp_path) as up:
        async with watch_statuses(plant) as watch:
            await watch.wait(all_are(agents, "online"), READY_S)
        children = children_of(up.pid)
        assert len(children) == len(agents)  # no broker of its own
        up.kill()
        up.wait()
        assert wait_gone(children, STOP_S) == []
    # PR_SET_PDEATHSIG sends SIGTERM, which the agents handle: a clean "offline" each.
    async with watch_statuses(plant) as watch:
        await watch.wait(all_are(agents, "offline"), 5.0)


async def test_a_dead_stage_stops_the_plant_with_exit_1(tiny_llama: Path,
                                                        tmp_path: Path) -> None:
    plant_path, plant = plant_file(tiny_llama, tmp_path)
    agents = agent_ids(plant)
    with edgebus_up(plant_path, tmp_path) as up:
        async with watch_statuses(plant) as watch:
            online = await watch.wait(all_are(agents, "online"), READY_S)
        children = children_of(up.pid)
        victim = plant.stages[-1].node
        os.kill(online[victim].pid, signal.SIGKILL)
        assert wait_exit(up, STOP_S) == 1
        assert wait_gone(children, 1.0) == []
    report = (tmp_path / "up.out").read_text()
    assert f"{victim} (pid {online[victim].pid}) was killed by SIGKILL" in report


def test_a_taken_broker_port_fails_before_anything_starts(tiny_llama: Path,
                                                          tmp_path: Path) -> None:
    plant_path, plant = plant_file(tiny_llama, tmp_path)
    with socket.create_server((LOOPBACK, plant.broker.port)):  # as a Mosquitto on 1883 would
        plant_processes = PlantProcesses(plant_path)
        with pytest.raises(EdgebusError, match=f"port {plant.broker.port} .* already in use"):
            plant_processes.start()
    assert plant_processes.pids == {}
