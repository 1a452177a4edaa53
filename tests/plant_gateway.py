"""A PLC gateway and a plant's agents as OS processes, for tests of faults.

`Gateway` is a real MQTT client with a persistent session, as a PLC gateway
would be: it sends requests and keeps every response, stream delta, status
and event it sees, counting responses per request id (a request answered
twice shows). `AgentProcesses` starts each agent of a plant file as its own
`python -m edgebus ...` process, so a test can `kill -9` exactly one and
start it again, as systemd's Restart=on-failure would.
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

import aiomqtt
from pipeline import plant_reference

from edgebus.core.client import BusClient
from edgebus.core.messages import AgentStatus, GenerateRequest, GenerateResponse
from edgebus.core.processes import child_setup
from node_agent.cancel import cancel_all
from plant_config import Plant

# Agents importing torch side by side on a 2-core box take ~10-40 s.
ONLINE_S = 180.0
# `Gateway.until` checks its condition on every message, and this often without one: a
# condition may hang on what no message tells (a journal's files, another thread's count),
# and waiting for the next message made it wait for the next heartbeat, up to 2 s.
RECHECK_S = 0.05
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


def requests(tokens: int, *, prefix: str = "r", count: int = len(PROMPTS)) -> list[GenerateRequest]:
    """Greedy requests that stream, `tokens` long each (no early end of sequence)."""
    return [GenerateRequest(id=f"{prefix}{i}", prompt=PROMPTS[i % len(PROMPTS)],
                            max_tokens=tokens, ignore_eos=True, stream=True)
            for i in range(count)]


@dataclass
class Gateway:
    """A PLC gateway: what it has received, and waiting for more."""

    plant: Plant
    client_id: str = "plc"
    responses: dict[str, GenerateResponse] = field(default_factory=dict)
    answers: dict[str, int] = field(default_factory=dict)  # response messages per request id
    received: dict[str, float] = field(default_factory=dict)
    deltas: dict[str, int] = field(default_factory=dict)
    statuses: list[tuple[float, AgentStatus]] = field(default_factory=list)
    events: list[dict[str, object]] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # The gateway side of the contract (docs/failover.md): when the coordinator
    # comes online in a new session, publish again what it has not answered.
    resend: bool = False
    bus: BusClient | None = None
    sent: dict[str, GenerateRequest] = field(default_factory=dict)
    resent: int = 0

    def on_message(self, message: aiomqtt.Message) -> None:
        payload = message.payload if isinstance(message.payload, bytes) else b""
        topic = message.topic.value
        if topic.startswith(f"{self.plant.topic_root}/status/"):
            status = AgentStatus.model_validate_json(payload)
            previous = self.status(status.agent_id)
            self.statuses.append((time.monotonic(), status))
            if (self.resend and status.agent_id == self.plant.coordinator.id
                    and status.state == "online" and previous is not None
                    and status.bdseq != previous.bdseq):
                self._resend()
        elif topic == self.plant.topics.events:
            self.events.append(json.loads(payload))
        elif topic.endswith("/stream"):
            rid = topic.split("/")[-2]
            self.deltas[rid] = self.deltas.get(rid, 0) + 1
        else:
            response = GenerateResponse.model_validate_json(payload)
            self.responses.setdefault(response.id, response)
            self.answers[response.id] = self.answers.get(response.id, 0) + 1
            self.received.setdefault(response.id, time.monotonic())
        self.changed.set()

    def _resend(self) -> None:
        assert self.bus is not None
        for request in self.sent.values():
            if request.id not in self.responses:
                self.resent += 1
                self.bus.send(self.plant.topics.request(self.client_id),
                              request.model_dump_json())

    async def until(self, condition: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            self.changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"timed out; responses so far: {sorted(self.responses)}")
            with suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(remaining, RECHECK_S))

    async def until_answered(self, batch: list[GenerateRequest], timeout: float) -> None:
        await self.until(lambda: all(r.id in self.responses for r in batch), timeout)

    async def until_offline(self, agent_id: str, timeout: float) -> None:
        def offline() -> bool:
            status = self.status(agent_id)
            return status is not None and status.state == "offline"
        await self.until(offline, timeout)

    def status(self, agent_id: str) -> AgentStatus | None:
        """The last status of `agent_id` seen."""
        mine = [s for _, s in self.statuses if s.agent_id == agent_id]
        return mine[-1] if mine else None

    def online(self, agent_id: str, *, after: int = 0) -> bool:
        """Whether `agent_id` is online in a session (bdseq) newer than `after`."""
        status = self.status(agent_id)
        return status is not None and status.state == "online" and status.bdseq > after

    async def until_online(self, agents: list[str], *, after: dict[str, int] | None = None,
                           timeout: float = ONLINE_S) -> None:
        after = after or {}
        await self.until(lambda: all(self.online(a, after=after.get(a, 0)) for a in agents),
                         timeout)

    def metric(self, agent_id: str, name: str) -> float:
        status = self.status(agent_id)
        return status.metrics.get(name, 0.0) if status is not None else 0.0

    def messages(self, words: str) -> list[str]:
        """Event messages that contain `words`."""
        return [str(e["message"]) for e in self.events if words in str(e["message"])]


@asynccontextmanager
async def gateway(plant: Plant, client_id: str = "plc", *,
                  resend: bool = False) -> AsyncIterator[tuple[Gateway, BusClient]]:
    """A gateway with a persistent session: responses wait for it across a broker restart.

    `resend`: publish unanswered requests again whenever the coordinator
    comes back in a new session (what a gateway does to outlive a broker crash).
    """
    gw = Gateway(plant, client_id, resend=resend)
    topics = plant.topics
    watched = [(topics.status_filter, 1), (topics.events, 1)]
    # With security on, `client_id` must be one of security.gateways, and the statuses
    # and events, which a gateway may not read, come through the plant's ops identity.
    secured = plant.security is not None
    bus = BusClient(plant.endpoint_for(client_id) if secured else plant.broker.endpoint(),
                    f"{plant.plant_id}.{client_id}",
                    subscriptions=[(topics.response_filter(client_id), 1),
                                   *([] if secured else watched)],
                    persistent=True)
    watch = [BusClient(plant.ops_endpoint(), plant.ops_client_id(f"{client_id}-watch"),
                       subscriptions=watched)] if secured else []
    gw.bus = bus
    runners = [asyncio.create_task(client.run(gw.on_message)) for client in [bus, *watch]]
    try:
        for client in [bus, *watch]:
            await client.wait_connected(10)
        yield gw, bus
    finally:
        # Not cancel and gather: Python 3.11's wait_for, inside aiomqtt, may lose a cancel.
        await cancel_all(runners)


async def send(bus: BusClient, plant: Plant, batch: list[GenerateRequest],
               client_id: str = "plc", gw: Gateway | None = None) -> None:
    for request in batch:
        if gw is not None:
            gw.sent[request.id] = request
        await bus.publish(plant.topics.request(client_id), request.model_dump_json(), qos=1)


async def mid_generation(gw: Gateway, batch: list[GenerateRequest], tokens: int,
                         timeout: float = 120) -> None:
    """Wait until every request of `batch` has streamed `tokens` tokens."""
    await gw.until(lambda: min(gw.deltas.get(r.id, 0) for r in batch) >= tokens, timeout)


def assert_exact(plant: Plant, gw: Gateway, batch: list[GenerateRequest]) -> None:
    for request in batch:
        response = gw.responses[request.id]
        assert response.error is None, (request.id, response.error)
        assert response.tokens == plant_reference(plant, request), request.id


class AgentProcesses:
    """Agents of one plant file, each `python -m edgebus ...` in its own process.

    Unlike `edgebus up`, nothing restarts an agent here: the test kills and
    starts them one by one. Journals and caches live under `workdir/home`
    (EDGEBUS_HOME), logs in `workdir/logs/<agent>-<n>.log`.
    """

    def __init__(self, plant_path: Path, workdir: Path) -> None:
        self.plant_path = plant_path
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "EDGEBUS_HOME": str(workdir / "home"),
                    "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._starts: dict[str, int] = {}

    def start_stage(self, node: str) -> None:
        self._start(node, ["node", str(self.plant_path), "--id", node, "--threads", "1"])

    def start_coordinator(self, instance: str | None = None, name: str = "coordinator") -> None:
        env = {"EDGEBUS_INSTANCE": instance} if instance else {}
        self._start(name, ["coordinator", str(self.plant_path)], env)

    def _start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> None:
        if name in self.procs and self.procs[name].poll() is None:
            raise RuntimeError(f"{name} is already running")
        count = self._starts[name] = self._starts.get(name, 0) + 1
        with (self.logs / f"{name}-{count}.log").open("wb") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "edgebus", *args], stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env={**self.env, **(env or {})},
                preexec_fn=child_setup())

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig`; for a deadly one, wait for the process to end."""
        proc = self.procs[name]
        proc.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            proc.wait(60)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def log(self, name: str) -> str:
        return "\n".join(path.read_text(errors="replace")[-4000:]
                         for path in sorted(self.logs.glob(f"{name}-*.log")))

    def __enter__(self) -> AgentProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


@asynccontextmanager
async def edgebus_up(plant: Path, log: Path, timeout: float
                     ) -> AsyncIterator[subprocess.Popen[bytes]]:
    """`edgebus up PLANT` as an operator starts it, its output in `log`, from the moment it
    says the plant is up (it has seen every agent online) until SIGTERM at the end."""
    with log.open("wb") as out:
        up = subprocess.Popen([sys.executable, "-m", "edgebus", "up", str(plant)],
                              stdout=out, stderr=subprocess.STDOUT)
    try:
        async with asyncio.timeout(timeout):
            while "is up" not in log.read_text():
                assert up.poll() is None, log.read_text()
                await asyncio.sleep(0.1)
        yield up
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout)
