"""`edgebus up`: every agent of a plant file on this machine, each in its own OS process.

On a real plant each stage is its own box. `up` is the bench and single-box
form of that: the same agents and the same MQTT traffic, one process each, so
a crash, a kill or a slow model load behaves as it would across boxes. When
the plant uses the embedded broker, that is one more process, started first
and stopped last (so the agents' "offline" statuses and Last Wills still
reach it).

No orphans: every child asks the kernel for SIGTERM when its parent dies
(PR_SET_PDEATHSIG), so a SIGKILLed `up` takes its children with it; and every
child runs in its own session, so a terminal's Ctrl-C reaches `up` alone,
which then stops the agents in order.

`up` supervises as systemd's `Restart=on-failure` would on a real plant: an
agent (or the embedded broker) that crashes or is killed is reported, with
how it died, and started again after a backoff, while the rest keep serving,
so a standby takes over the dead node's requests. It stops everything only on
Ctrl-C or SIGTERM, or when one agent keeps dying (RESTART_LIMIT times within
RESTART_WINDOW_S). An agent that exits before it ever came online is not
restarted: nothing it ran has worked yet, which is a configuration problem
(a bad plant file, a missing password file) that a restart would repeat, so
`up` stops with that agent's last output. One killed by a signal is, even
then: a kill says nothing about its configuration, and `up` may simply not
have seen its "online" yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import IO, Literal, TextIO

import aiomqtt

from broker.exposure import refuse_open_listener
from edgebus.core import tls
from edgebus.core.client import BusClient
from edgebus.core.endpoint import BrokerEndpoint
from edgebus.core.errors import BusError, EdgebusError
from edgebus.core.memory_limits import MemoryLimit, memory_limit, rss_bytes
from edgebus.core.processes import child_setup, cores
from edgebus.core.statuses import StatusReader
from plant_config import Plant, load_plant

# amqtt listens ~0.2 s after its interpreter starts here; the margin is for a
# Raspberry Pi importing Python packages from an SD card.
BROKER_START_TIMEOUT_S = 30.0
# A stage reports "online" only once its layers are loaded: a multi-GB slice
# read from an SD card takes minutes.
READY_TIMEOUT_S = 600.0
# A clean agent exit publishes "offline" (bounded by the client's 2 s close
# timeout) after finishing the forward step in flight, seconds on a slow box.
STOP_GRACE_S = 10.0
# How often children are checked for an exit: a crash is reported at once,
# and a poll costs nothing.
POLL_INTERVAL_S = 0.1
# An error quotes the end of a child's output: that is where the traceback is.
TAIL_LINES = 20
# Bytes of a log file read to find its last lines; tracebacks are far shorter.
_TAIL_BYTES = 64 * 1024
# How long one broker probe waits for a CONNACK.
_PROBE_TIMEOUT_S = 1.0
BROKER_NAME = "broker"
# A dead agent starts again after this, doubled for each earlier death within
# RESTART_WINDOW_S (1, 2, 4, 8 s), as systemd's RestartSec= with RestartSteps=
# does: the first restart is quick, so a standby's load falls back soon, and a
# crash loop does not hog a box that is loading models.
RESTART_DELAY_S = 1.0
RESTART_MAX_DELAY_S = 30.0
# An agent that dies this often within RESTART_WINDOW_S is given up on, and `up`
# stops the plant: systemd's StartLimitBurst=5, over a minute rather than its
# 10 s, because each restart here reloads a model for seconds.
RESTART_LIMIT = 5
RESTART_WINDOW_S = 60.0

# libgomp's spin, in rounds, before an OpenMP thread that waits goes to sleep (its default,
# 300,000, is milliseconds). llama.cpp's threads wait microseconds between the ops of a
# step and milliseconds between a stage's frames: at 10,000 they still spin across the
# first and sleep through the second, leaving the cores to the stages, broker and
# coordinator that share the box. Every stage starts with it, unless the environment sets
# it. Measured on 2 cores (AMD EPYC), SmolLM2 Q4_1, 3 stages of 2 threads, single stream,
# medians of alternating runs: 10.6 tok/s at 10,000, 8.1 at 300,000, 9.0 at 1,000 under
# load 13-16; 33.5 at 10,000, 26.5 at 300,000 under load 3 (alike at loads 5-9); 1.3B shape,
# quiet box: steps summed 70 ms at 300,000, 45-49 ms at 10,000
# (docs/architecture.md#stages-that-sleep-while-they-wait).
STAGE_SPINCOUNT = "10000"

# Forwarded child lines are written whole, one at a time, so they never interleave.
_OUTPUT_LOCK = threading.Lock()

Role = Literal["broker", "stage", "coordinator"]


@dataclass
class _Child:
    """One agent (or the broker) and the process running it."""

    name: str
    role: Role
    argv: list[str]
    log_path: Path | None
    cpus: list[int] | None = None
    env: dict[str, str] = field(default_factory=dict)  # under the environment's own values
    proc: subprocess.Popen[bytes] | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    readers: list[threading.Thread] = field(default_factory=list)
    # Supervision (`edgebus up`): whether any of its processes came online,
    # when it died within the restart window, and when it is due to start again.
    ever_online: bool = False
    started_at: float = 0.0  # time.monotonic() when its current process was started
    deaths: deque[float] = field(default_factory=deque)
    restart_at: float | None = None
    given_up: bool = False  # exited cleanly: left stopped, as systemd would
    # What tells an OOM kill from another SIGKILL: the memory limit over the process, its
    # control group's oom_kill counter when it started, its RSS when last seen.
    memory: MemoryLimit | None = None
    oom_kills_at_start: int | None = None
    last_rss: int | None = None

    def watch_memory(self) -> None:
        """Note the process's RSS while it runs: what it held when it is killed."""
        if self.proc is not None and self.proc.returncode is None:
            self.last_rss = rss_bytes(self.proc.pid) or self.last_rss


def shared_threads(stages: int) -> int:
    """A stage's threads where `stages` stages share this box and the plant sets none."""
    return max(1, cores() // stages)


def shared_groups(stages: int) -> int:
    """Request groups the coordinator keeps in flight where `stages` stages share this box:
    as many as can compute at once, one per core (why: PlantProcesses.__init__)."""
    return min(stages, cores())


class PlantProcesses:
    """Every agent of one plant file, each in its own process; a context manager that stops them.

    `log_dir=None`: children write to this process's stdout/stderr, each line
    prefixed with "[name] "; otherwise each child writes `log_dir/<name>.log`.
    `cpus` pins agents (by name, "broker" included) to CPU lists (Linux only).
    """

    def __init__(self, plant_path: Path, *, log_dir: Path | None = None,
                 cpus: dict[str, list[int]] | None = None) -> None:
        # Loading checks the file and the model directory before anything starts.
        self.plant: Plant = load_plant(plant_path)
        self.plant_path = plant_path
        self.log_dir = log_dir
        plant = self.plant
        command = [sys.executable, "-m", "edgebus"]
        children: list[_Child] = []
        if plant.broker.embedded:
            settings = plant.broker
            refuse_open_listener(settings.bind or settings.host, settings.port,
                                 secured=plant.security is not None,
                                 what=f"{plant_path}: the embedded broker")
            if any(stage.node == BROKER_NAME for stage in plant.stages):
                raise EdgebusError(f"{plant_path}: a stage node is named {BROKER_NAME!r}, the "
                                   "name `edgebus up` gives the embedded broker: rename the node")
            children.append(self._child(BROKER_NAME, "broker",
                                        [*command, "broker", str(plant_path)]))
        # Every agent runs on this one box, so stages that do not set their
        # threads share the cores: oversubscribed, they wait on each other's
        # spinning OpenMP threads (measured on 2 cores, 3 stages: 150-280 ms
        # per token with all cores each, ~70 ms with one each). With STAGE_SPINCOUNT
        # two threads each still lose to one each, single stream (SmolLM2: 33.5
        # against 42.4 tok/s at load 3, 10.6 against 14.5 at load 13-16, 45.6 against
        # 52.5 on a quiet box).
        # And they keep as many request groups in flight as stages can compute
        # at once: one per core, not one per stage (measured, 3 stages on 2
        # cores, 16 requests: 1 group 62-65 tok/s, 2 groups 71-94, 3 groups
        # 72-74). Pinned stages stand for boxes and keep one group per stage.
        # Standby replicas idle until a failover, so the cores go by stage, not by node.
        shared = str(shared_threads(len(plant.pipeline)))
        groups = [] if cpus else ["--batch-groups", str(shared_groups(len(plant.pipeline)))]
        stages = [self._child(stage.node, "stage",
                              [*command, "node", str(plant_path), "--id", stage.node,
                               "--threads", str(stage.threads or shared)])
                  for stage in plant.stages]
        for child in stages:
            child.env["GOMP_SPINCOUNT"] = STAGE_SPINCOUNT
        children += stages
        children.append(self._child(plant.coordinator.id, "coordinator",
                                    [*command, "coordinator", str(plant_path), *groups]))
        cpus = cpus or {}
        unknown = set(cpus) - {c.name for c in children}
        if unknown:
            raise EdgebusError(f"cannot pin {', '.join(sorted(unknown))}: not an agent of "
                               f"{plant_path}")
        for child in children:
            child.cpus = cpus.get(child.name)
        self._children = children
        self._stopped = False

    def _child(self, name: str, role: Role, argv: list[str]) -> _Child:
        log_path = None if self.log_dir is None else self.log_dir / f"{name}.log"
        return _Child(name, role, argv, log_path)

    def __enter__(self) -> PlantProcesses:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def pids(self) -> dict[str, int]:
        """Process id of every child started, by agent id ("broker" for the broker)."""
        return {c.name: c.proc.pid for c in self._children if c.proc is not None}

    @property
    def agents(self) -> list[str]:
        """Agent ids that report a status: the stage nodes and the coordinator."""
        return [c.name for c in self._children if c.role != "broker"]

    def start(self) -> None:
        """Start the broker (returning once it answers MQTT), then the stages, then the coordinator.

        Call it from the main thread: the kernel's parent-death signal fires
        when the *thread* that started a child exits. On failure, whatever
        was started is stopped again.
        """
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for child in self._children:
                if child.role == "broker":
                    self._check_broker_port()
                    self._spawn(child)
                    self._wait_broker(child)
                    child.ever_online = True
                else:
                    self._spawn(child)
        except BaseException:
            self.stop()
            raise

    async def wait_online(self, timeout: float, *,
                          on_online: Callable[[str], None] | None = None) -> None:
        """Return once every stage node and the coordinator report "online".

        Only a status carrying the pid of the process started here counts, so a
        stale retained status left on an external broker by an earlier run
        does not. `on_online(agent_id)` is called as each one comes up.
        Raises EdgebusError if a child exits meanwhile, or at `timeout`.
        """
        async with StatusWatch(self) as watch:
            waiting = set(self.agents)
            deadline = time.monotonic() + timeout
            while waiting:
                dead = self.poll()
                if dead is not None:
                    raise EdgebusError(f"{self.describe_exit(dead[0])} before the plant came "
                                       f"online.\n{self._tail_report(dead[0])}")
                watch.check()
                for agent in sorted(waiting & watch.online()):
                    waiting.discard(agent)
                    if on_online is not None:
                        on_online(agent)
                if time.monotonic() > deadline:
                    raise EdgebusError(self._not_online(waiting, timeout, watch))
                await asyncio.sleep(POLL_INTERVAL_S)

    def _not_online(self, waiting: set[str], timeout: float, watch: StatusWatch) -> str:
        endpoint = watch.bus.endpoint
        why = ("" if watch.bus.connected else f" (could not connect to the broker at "
               f"{endpoint.host}:{endpoint.port} to watch {self.plant.topics.status_filter})")
        logs = "" if self.log_dir is None else f"; their logs are in {self.log_dir}"
        return f"not online after {timeout:.0f} s: {', '.join(sorted(waiting))}{why}{logs}"

    def poll(self) -> tuple[str, int] | None:
        """(name, exit code) of the first child found exited, or None while all run."""
        for child in self._children:
            child.watch_memory()
            if child.proc is not None and child.proc.poll() is not None:
                return child.name, child.proc.returncode
        return None

    def describe_exit(self, name: str) -> str:
        """E.g. "stage-1 (pid 4242) was killed by SIGTERM", or by the OOM killer, with the
        memory limit and what it held."""
        proc = self._by_name(name).proc
        assert proc is not None and proc.returncode is not None
        code = proc.returncode
        child = self._by_name(name)
        if code == -signal.SIGKILL and child.memory is not None:
            how = child.memory.describe_kill(proc.pid, started_s=child.started_at,
                                             kills_before=child.oom_kills_at_start,
                                             last_rss=child.last_rss)
        elif code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
            if -code == signal.SIGILL:  # a CPU refusing an instruction a library was built for
                from node_agent.engines.llamacpp.rebuild_hint import sigill_hint

                how += sigill_hint()
        elif code == 0:
            how = "exited cleanly (code 0)"
        else:
            how = f"exited with code {code}"
        return f"{name} (pid {proc.pid}) {how}"

    def restart(self, name: str) -> int:
        """Start a new process for `name`, whose last one has exited; return its pid."""
        child = self._by_name(name)
        assert child.proc is not None and child.proc.poll() is not None
        child.readers = [reader for reader in child.readers if reader.is_alive()]
        self._spawn(child)
        assert child.proc is not None
        return child.proc.pid

    def stop(self) -> None:
        """SIGTERM the agents, SIGKILL those still running after STOP_GRACE_S, then the broker.

        Idempotent. The agents go first and the broker last, so their
        "offline" statuses (or, for a killed one, its Last Will) are published.
        """
        if self._stopped:
            return
        self._stopped = True
        _terminate([c for c in self._children if c.role != "broker"])
        _terminate([c for c in self._children if c.role == "broker"])
        for child in self._children:
            for reader in child.readers:
                reader.join(STOP_GRACE_S)

    # -- internals ----------------------------------------------------------------

    def _by_name(self, name: str) -> _Child:
        for child in self._children:
            if child.name == name:
                return child
        raise KeyError(name)

    def _spawn(self, child: _Child) -> None:
        # Unbuffered: a child's lines must reach its log or our terminal as they
        # are written, not when an 8 KiB buffer fills or at exit.
        env = {**child.env, **os.environ, "PYTHONUNBUFFERED": "1"}
        with contextlib.ExitStack() as files:  # the child keeps its own log descriptor
            out: int | IO[bytes] = subprocess.PIPE
            err = subprocess.PIPE
            if child.log_path is not None:
                out, err = files.enter_context(child.log_path.open("ab")), subprocess.STDOUT
            child.proc = subprocess.Popen(child.argv, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=err, env=env, start_new_session=True,
                                          preexec_fn=child_setup(child.cpus))
            child.started_at = time.monotonic()
        child.memory = memory_limit(child.proc.pid)
        child.oom_kills_at_start = child.memory.oom_kills()
        child.last_rss = None
        if child.log_path is not None:
            return
        assert child.proc.stdout is not None and child.proc.stderr is not None
        for stream, sink in ((child.proc.stdout, sys.stdout), (child.proc.stderr, sys.stderr)):
            reader = threading.Thread(target=_forward, args=(stream, sink, child),
                                      name=f"output-{child.name}", daemon=True)
            reader.start()
            child.readers.append(reader)

    def _check_broker_port(self) -> None:
        """Fail now, with a clear message, if the embedded broker's port is taken.

        Debian's mosquitto package starts a broker on 1883, the default port:
        without this check the agents would start, find that broker, and the
        failure would surface only as the embedded broker's exit.
        """
        settings = self.plant.broker
        host = settings.bind or settings.host
        try:
            addresses = socket.getaddrinfo(host, settings.port, type=socket.SOCK_STREAM,
                                           flags=socket.AI_PASSIVE)
        except OSError:
            return  # an unresolvable bind address: the broker itself says so
        for family, kind, proto, _, address in addresses:
            with socket.socket(family, kind, proto) as sock:
                # As asyncio's server does: a port with connections in TIME_WAIT is free.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    sock.bind(address)
                except OSError as exc:
                    if exc.errno == errno.EADDRINUSE:
                        raise EdgebusError(
                            f"{self.plant_path}: port {settings.port} on {host} is already in "
                            "use (a Mosquitto?), so the embedded broker cannot listen there: "
                            "set broker.port to a free port, or point broker.url at the broker "
                            "that holds it") from None

    def _wait_broker(self, child: _Child) -> None:
        endpoint = self.plant.broker_endpoint()
        deadline = time.monotonic() + BROKER_START_TIMEOUT_S
        assert child.proc is not None
        while not _mqtt_accepts(endpoint):
            if child.proc.poll() is not None:
                raise EdgebusError(f"the embedded broker: {self.describe_exit(child.name)} at "
                                   f"start.\n{self._tail_report(child.name)}")
            if time.monotonic() > deadline:
                raise EdgebusError(f"the embedded broker did not answer on {endpoint.host}:"
                                   f"{endpoint.port} within {BROKER_START_TIMEOUT_S:.0f} s."
                                   f"\n{self._tail_report(child.name)}")
            time.sleep(POLL_INTERVAL_S)

    def _tail(self, name: str) -> list[str]:
        child = self._by_name(name)
        if child.log_path is None:
            return list(child.tail)
        try:
            with child.log_path.open("rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - _TAIL_BYTES))
                return log.read().decode(errors="replace").splitlines()[-TAIL_LINES:]
        except OSError:
            return []

    def _tail_report(self, name: str) -> str:
        lines = self._tail(name)
        where = self._by_name(name).log_path
        full = f" (full log: {where})" if where is not None else ""
        if not lines:
            return f"It wrote no output{full}."
        body = "\n".join(f"    {line}" for line in lines)
        return f"Last lines of its output{full}:\n{body}"


class StatusWatch:
    """The plant's retained statuses, watched as its ops identity while `async with` lasts.

    An agent counts as online while its newest status says "online" and
    carries the pid of the process running it now: a status retained by an
    earlier run, or by the process a restart replaced, does not count.
    """

    def __init__(self, processes: PlantProcesses) -> None:
        self.processes = processes
        # Agent id -> pid of its newest status if that says online, else None, and
        # the MQTT session (bdseq) of that status: a Will the broker publishes
        # late, after the restarted agent's birth, belongs to an older session.
        self._pids: dict[str, int | None] = {}
        self._bdseq: dict[str, int] = {}
        self._statuses = StatusReader(lambda text: _say(text, error=True))
        plant = processes.plant
        self.topics = plant.topics
        self.bus = BusClient(plant.ops_endpoint(), plant.ops_client_id("up"),
                             subscriptions=[(plant.topics.status_filter, 1)])
        self._runner: asyncio.Task[None] | None = None

    async def __aenter__(self) -> StatusWatch:
        self._runner = asyncio.create_task(self.bus.run(self._on_message))
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._runner is not None:
            self._runner.cancel()
            await asyncio.gather(self._runner, return_exceptions=True)

    def _on_message(self, message: aiomqtt.Message) -> None:
        agent = self.topics.agent_of_status_topic(message.topic.value)
        if agent is None or not isinstance(message.payload, bytes | str):
            return
        status = self._statuses.read(agent, message.payload)
        if status is None:
            return  # not this agent's status, so nothing to watch
        if status.bdseq < self._bdseq.get(agent, 0):
            return
        self._bdseq[agent] = status.bdseq
        self._pids[agent] = status.pid if status.state == "online" else None

    def check(self) -> None:
        """Raise what ended the watch: a refused connection (credentials, ACL) ends it."""
        if self._runner is not None and self._runner.done():
            self._runner.result()
            raise EdgebusError("the status watch ended unexpectedly")

    def online(self) -> set[str]:
        """The agents online now, in the process running them now."""
        found = set()
        for name, pid in self.processes.pids.items():
            if pid is not None and self._pids.get(name) == pid:
                found.add(name)
                self.processes._by_name(name).ever_online = True
        return found


def _terminate(children: list[_Child]) -> None:
    """SIGTERM `children` together, wait up to STOP_GRACE_S, SIGKILL the rest."""
    running = [c.proc for c in children if c.proc is not None and c.proc.poll() is None]
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _forward(stream: IO[bytes], sink: TextIO, child: _Child) -> None:
    """Copy a child's output to `sink` line by line, prefixed with its name (reader thread)."""
    prefix = f"[{child.name}] "
    with stream:
        for raw in stream:
            line = raw.decode(errors="replace").rstrip("\n")
            child.tail.append(line)
            # A closed terminal (`up | head`) must not stop the draining: a
            # child blocked on a full pipe would hang.
            with _OUTPUT_LOCK, contextlib.suppress(OSError, ValueError):
                sink.write(f"{prefix}{line}\n")
                sink.flush()


def _mqtt_accepts(endpoint: BrokerEndpoint) -> bool:
    """Whether the MQTT broker at `endpoint` answers an anonymous MQTT 3.1.1 CONNECT.

    A full handshake rather than a bare TCP connect: amqtt logs an error for
    every connection that closes without sending a CONNECT. A refusal counts:
    a secured broker refuses anonymous clients, and answering shows it is up.
    Over TLS where the broker serves it, its certificate checked as every agent checks it:
    a wrong one is said in one line (BusError) rather than waited out.
    """
    host, port = endpoint.host, endpoint.port
    client_id = f"edgebus-up-probe-{os.getpid()}".encode()
    # Protocol name "MQTT", level 4 (3.1.1), clean session, keepalive 0; then the client id.
    body = b"\x00\x04MQTT\x04\x02\x00\x00" + len(client_id).to_bytes(2, "big") + client_id
    connect = bytes([0x10, len(body)]) + body  # body < 128 bytes: a one-byte length
    context = tls.client_context(replace(endpoint, cert_file=None, key_file=None)) \
        if endpoint.tls else None
    try:
        with contextlib.ExitStack() as stack:
            sock = stack.enter_context(socket.create_connection((host, port),
                                                                timeout=_PROBE_TIMEOUT_S))
            if context is not None:
                sock = stack.enter_context(context.wrap_socket(sock, server_hostname=host))
            sock.sendall(connect)
            connack = sock.recv(4)
            if connack[3:4] == b"\x00":  # admitted: say goodbye (a refused one was closed)
                sock.sendall(b"\xe0\x00")  # DISCONNECT
    except ssl.SSLError as exc:
        refused = tls.explain(exc, endpoint)
        if refused is not None:
            raise BusError(refused) from None
        return False
    except OSError:
        return False
    return connack[:2] == b"\x20\x02"  # CONNACK, whatever its return code


# -- `edgebus up` ------------------------------------------------------------------


def run_up(plant_path: Path) -> int:
    """`edgebus up PLANT`: start the plant, report it online, keep it running until told to stop.

    A dead agent is restarted (see the module's docstring). Returns 0 after
    SIGINT/SIGTERM (everything stopped cleanly) and 1 when an agent kept dying.
    A failure to come online raises EdgebusError (with the culprit's last
    output), after stopping the rest.
    """
    with PlantProcesses(plant_path) as plant:
        from node_agent.fit import check_plant_fits_here

        check_plant_fits_here(plant.plant)  # before anything starts, as a box's node does
        return asyncio.run(_up(plant))


async def _up(plant: PlantProcesses) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # Installed before anything starts: a Ctrl-C or SIGTERM while agents load
    # still stops them in order.
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    try:
        return await _serve(plant, stop)
    finally:
        # Still inside the loop, so a second Ctrl-C only re-sets `stop` and
        # cannot interrupt the shutdown half-way.
        if plant.pids:
            print("edgebus up: stopping the plant", flush=True)
            plant.stop()
            print("edgebus up: stopped", flush=True)


def _say(text: str, *, error: bool = False) -> None:
    print(f"edgebus up: {text}", file=sys.stderr if error else sys.stdout, flush=True)


async def _serve(plant: PlantProcesses, stop: asyncio.Event) -> int:
    started = time.monotonic()
    plant.start()
    _say(f"started {', '.join(f'{n} (pid {p})' for n, p in plant.pids.items())}; "
         f"waiting for {len(plant.agents)} agents to load and come online")
    deadline = started + READY_TIMEOUT_S
    up = False
    async with StatusWatch(plant) as watch:
        seen_online: dict[str, int] = {}  # agent -> pid last reported online
        while not stop.is_set():
            now = time.monotonic()
            code = _supervise(plant, now)
            if code is not None:
                return code
            watch.check()
            online = watch.online()
            for agent in sorted(online):
                pid = plant.pids[agent]
                if seen_online.get(agent) != pid:
                    again = " again" if agent in seen_online else ""
                    seen_online[agent] = pid
                    loaded = now - plant._by_name(agent).started_at
                    _say(f"{agent} online{again} after {loaded:.1f} s (pid {pid})")
            if not up and online >= set(plant.agents):
                up = True
                print(_table(plant), flush=True)
            if not up and now > deadline:
                raise EdgebusError(plant._not_online(set(plant.agents) - online,
                                                     READY_TIMEOUT_S, watch))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_INTERVAL_S):
                    await stop.wait()
    return 0


def _supervise(plant: PlantProcesses, now: float) -> int | None:
    """Report children that died and restart those due; 1 once one keeps dying, else None.

    Raises EdgebusError for a child that died before it ever came online.
    """
    for child in plant._children:
        proc = child.proc
        if proc is None or child.given_up:
            continue
        child.watch_memory()
        if child.restart_at is None and proc.poll() is not None:
            how = plant.describe_exit(child.name)
            if not child.ever_online and proc.returncode >= 0:
                raise EdgebusError(f"{how} before it came online.\n"
                                   f"{plant._tail_report(child.name)}")
            if proc.returncode == 0:
                # As systemd's Restart=on-failure: a clean exit was asked for.
                child.given_up = True
                _say(f"{how}; it is not restarted, as a clean exit was asked for (Ctrl-C "
                     "stops `up` itself)", error=True)
                continue
            child.deaths.append(now)
            while child.deaths and child.deaths[0] < now - RESTART_WINDOW_S:
                child.deaths.popleft()
            if len(child.deaths) >= RESTART_LIMIT:
                _say(f"{how}; it died {len(child.deaths)} times within {RESTART_WINDOW_S:.0f} s, "
                     "so it is not restarted again and the plant stops. Fix what kills it, "
                     f"then run `edgebus up {plant.plant_path}` again.\n"
                     f"{plant._tail_report(child.name)}", error=True)
                return 1
            delay = min(RESTART_MAX_DELAY_S, RESTART_DELAY_S * 2 ** (len(child.deaths) - 1))
            child.restart_at = now + delay
            _say(f"{how}; restarting it in {delay:.0f} s (death {len(child.deaths)} within "
                 f"{RESTART_WINDOW_S:.0f} s; at {RESTART_LIMIT} the plant stops); the rest keep "
                 "serving", error=True)
        elif child.restart_at is not None and now >= child.restart_at:
            child.restart_at = None
            _say(f"restarted {child.name} (pid {plant.restart(child.name)})")
    return None


def _table(plant: PlantProcesses) -> str:
    endpoint = plant.plant.broker_endpoint()
    over = "TLS" if endpoint.tls else "plain MQTT, in clear"
    detail = {BROKER_NAME: f"{endpoint.host}:{endpoint.port} ({over})"}
    detail.update({s.node: f"layers [{s.layers[0]}, {s.layers[1]})" for s in plant.plant.stages})
    detail[plant.plant.coordinator.id] = f"requests on {plant.plant.topics.request_filter}"
    pids = plant.pids
    width = max(len(name) for name in pids)
    rows = [f"  {name:<{width}}  pid {pid:<8} {detail[name]}" for name, pid in pids.items()]
    broker = "" if plant.plant.broker.embedded else (f" (broker {endpoint.host}:{endpoint.port}"
                                                     f", {over})")
    return "\n".join([f"plant {plant.plant.plant_id!r} is up{broker}:", *rows,
                      f'ask it: edgebus ask {plant.plant_path} "Hello"   stop: Ctrl-C'])
