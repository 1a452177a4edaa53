"""One rehearsal: the plant's boxes built on this machine, its agents running in them, torn down.

`Rehearsal` is a context manager: whatever `start` built, `stop` takes down
(processes, control groups, namespaces, the bridge), on a normal exit, an
exception, Ctrl-C or SIGTERM alike. Each agent is a real OS process, started
as `nsenter --net=/run/netns/NS python -m edgebus ...` and put into its box's
control group before it runs a line of Python. Not `ip netns exec`: that also
mounts a fresh /sys, without /sys/fs/cgroup, so an agent could not read its
box's memory limit, took the machine's free memory for its own, and loaded
what its box could not hold (the OOM killer ended a 9 GB model's stage on a
4 GiB box, where the stage's own check would have refused it with numbers).
The plant file the agents read is a copy of the user's with the broker's
address rewritten to the broker box's address on the bridge.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType

from edgebus.core.errors import EdgebusError
from edgebus.core.memory_limits import describe_kill, rss_bytes
from edgebus.core.processes import child_setup
from edgebus.rehearse import cgroups, disk, leftovers, netns
from edgebus.rehearse.sizing import BoxShare, box_shares, broker_box, coordinator_box
from plant_config import Plant, write_plant
from plant_config.broker_section import BrokerTls
from plant_config.certificates import ca_key_path, default_files, issue

MOSQUITTO = "/usr/sbin/mosquitto"
# Where `ip netns add` keeps a namespace's handle, which nsenter enters.
NETNS_DIR = "/run/netns"
# Mosquitto listens within ~25 ms; the margin is for a loaded machine.
BROKER_START_S = 10.0
# An agent stops in ~1 s after SIGTERM (it publishes "offline" first).
STOP_TIMEOUT_S = 10.0
_POLL_S = 0.05
# How much of an agent's log an error quotes: the end, where the reason is.
LOG_TAIL_CHARS = 3000
# Signals that end a rehearsal early: each tears down like Ctrl-C does.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class Options:
    """How to rehearse: the machine's share for the plant, and where broker and coordinator go."""

    cpu_total: float | None = None  # None: sizing.DEFAULT_CPU_TOTAL
    memory_scale: float = 1.0
    broker_box: str | None = None
    coordinator_box: str | None = None
    # Request groups the coordinator keeps in flight; None: its default (one per stage).
    batch_groups: int | None = None


@dataclass(frozen=True)
class Online:
    """An agent's first start, its process started to its first "online" (a stage's cut and
    load), and what its box had used by then: whether its disk or its CPU bound it."""

    seconds: float
    cpu_s: float  # its box's CPU time, a broker's and coordinator's there included
    disk: cgroups.DiskBytes | None  # what its box read and wrote (None: no io controller)


def missing() -> list[str]:
    """Everything this machine lacks for a rehearsal, each with what to do about it."""
    problems = netns.missing() + cgroups.missing()
    if not Path(MOSQUITTO).is_file():
        problems.append(f"Mosquitto at {MOSQUITTO}, the broker a rehearsal runs — "
                        "apt-get install mosquitto")
    return list(dict.fromkeys(problems))


class _Stopped(BaseException):
    """SIGTERM or SIGHUP: unwinds like KeyboardInterrupt, so every `finally` tears down."""


class Rehearsal:
    """The plant's boxes as namespaces and control groups, and its agents running inside."""

    def __init__(self, plant: Plant, workdir: Path, options: Options = Options(), *,
                 progress: Callable[[str], None] = lambda _: None) -> None:
        problems = missing()
        if problems:
            raise EdgebusError("this machine cannot rehearse a plant; it lacks:\n  - "
                               + "\n  - ".join(problems))
        if plant.brokers:
            raise EdgebusError("the plant has line brokers (brokers:), which a rehearsal does "
                               "not run yet — rehearse a copy without them")
        self.source = plant
        self.options = options
        self.shares = box_shares(plant, cpu_total=options.cpu_total,
                                 memory_scale=options.memory_scale)
        self.broker_box = broker_box(plant, self.shares, options.broker_box)
        self.coordinator_box = coordinator_box(self.shares, self.broker_box,
                                               options.coordinator_box)
        self.workdir = workdir
        self.progress = progress
        self.run_id = secrets.token_hex(3)
        self.network = netns.Network(self.run_id)
        self.groups: dict[str, cgroups.BoxGroup] = {}
        self.tree: cgroups.CgroupTree | None = None
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.box_of: dict[str, str] = {}  # agent (or "broker") -> its box
        self.plant: Plant = plant  # the rewritten copy once start() has run
        self.plant_path = workdir / "plant.yaml"
        self._saved_handlers: dict[int, object] = {}
        self.last_rss: dict[str, int] = {}  # agent -> its RSS when last seen (watch_memory)
        self.started_at: dict[str, float] = {}  # agent -> time.monotonic() of its start
        self.online: dict[str, Online] = {}  # agent -> its first start (came_online)
        # agent -> what the plan counted for it, in words (run_rehearse's fit check)
        self.planned: dict[str, str] = {}

    # -- setup --------------------------------------------------------------

    def __enter__(self) -> Rehearsal:
        for sig in _STOP_SIGNALS:
            self._saved_handlers[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            self.stop()
        finally:
            for sig, handler in self._saved_handlers.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
        if isinstance(exc, _Stopped):
            raise KeyboardInterrupt from None

    @staticmethod
    def _on_signal(signum: int, frame: FrameType | None) -> None:
        raise _Stopped(signal.Signals(signum).name)

    def share(self, box: str) -> BoxShare:
        return next(share for share in self.shares if share.box == box)

    def start(self) -> None:
        """Build the boxes, start the broker and every agent (not waiting for them online)."""
        self.build_boxes()
        self._start_broker()
        for stage in self.plant.stages:
            self.start_agent(stage.node)
        self.start_agent(self.plant.coordinator.id)

    def build_boxes(self) -> None:
        """The boxes alone, empty: namespaces, links and control groups. `start` then runs
        the plant in them; a peer the plant is compared with runs its own processes there
        instead (`spawn`), on the same quotas and limits."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "logs").mkdir(exist_ok=True)
        self.progress(f"building {len(self.shares)} boxes (run {self.run_id}): namespaces on "
                      f"bridge {self.network.bridge} ({self.network.subnet}), control groups")
        leftovers.record(self.run_id)  # before anything is built: --clean finds it all
        self.network.create()
        self.tree = cgroups.open_tree(self.run_id)
        # What a box reads and writes at first start: the model, and its stage files in the
        # agents' $EDGEBUS_HOME here.
        stored = [self.source.model, self.workdir]
        limited = disk.devices(stored) if any(s.disk for s in self.shares) else []
        for share in self.shares:
            link = self.network.add_box(share.box, share.link_mbit)
            group = self.groups[share.box] = self.tree.create(share.box, share.cpu_cores,
                                                              share.memory_bytes)
            if share.disk is not None:
                group.set_disk(limited, round(share.disk.read_mb_s * 1e6),
                               round(share.disk.write_mb_s * 1e6))
            self.progress(f"  {share.box}: {link.address}, {share.cpu_cores:.2f} cores, "
                          f"{share.memory_bytes >> 20} MiB, link "
                          + (f"{share.link_mbit:g} Mbit/s" if share.link_mbit else "unlimited")
                          + ", disk " + (f"{share.disk.read_mb_s:g} / {share.disk.write_mb_s:g} "
                                         f"MB/s read / write on {', '.join(limited)}"
                                         if share.disk else "unlimited"))
        # Every box reads the model from disk, at its own rate where it has one.
        disk.drop_from_cache([self.source.model])
        self.plant = self._rewritten()
        write_plant(self.plant, self.plant_path)

    def address(self, box: str) -> str:
        """`box`'s address on the rehearsal's bridge."""
        return self.network.links[box].address

    def _rewritten(self) -> Plant:
        """The plant with its broker at the broker box's address: over TLS where the plant
        speaks it and its CA's key is at hand, else over plain MQTT."""
        endpoint = self.source.broker_endpoint()
        address = self.network.links[self.broker_box].address
        broker = self.source.broker.model_copy(update={
            # The embedded broker speaks 3.1.1; Mosquitto, which stands in for it, speaks 5 too.
            "url": f"mqtt://{address}:{endpoint.port}",
            "protocol": self.source.broker.protocol or "5", "ca_file": None})
        update: dict[str, object] = {"broker": broker}
        if self.source.security is not None:
            # Passwords and ACLs stay. The broker's configuration makes the passwords that are
            # missing: into a copy, never into the plant's own credentials directory.
            credentials = self.workdir / "credentials"
            if self.source.security.credentials.is_dir():
                shutil.copytree(self.source.security.credentials, credentials)
            credentials.mkdir(mode=0o700, exist_ok=True)
            tls = self._tls(credentials, address)
            if tls is not None:
                update["broker"] = broker.model_copy(update={
                    "url": f"mqtts://{address}:{endpoint.port}", "ca_file": tls.cafile})
            update["security"] = self.source.security.model_copy(
                update={"tls": tls, "credentials": credentials})
        return self.source.model_copy(update=update)

    def _tls(self, credentials: Path, address: str) -> BrokerTls | None:
        """The rehearsal broker's TLS: a certificate for its address on the bridge (the
        plant's own name the real hosts), issued in the copy of the credentials from the
        plant's CA, whose clients' certificates then hold too. None (plain MQTT, as every
        agent then warns) where the plant speaks plain or this box lacks the CA's key."""
        assert self.source.security is not None
        own = self.source.security.listener_tls
        if own is None or not ca_key_path(own.cafile).is_file():
            return None
        files = default_files(credentials)
        files["cafile"].parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        for source, target in ((own.cafile, files["cafile"]),
                               (ca_key_path(own.cafile), ca_key_path(files["cafile"]))):
            if source.resolve() != target.resolve():
                shutil.copy2(source, target)
        issue(files["cafile"], files["certfile"], files["keyfile"], common_name=address,
              hosts=[address])
        return BrokerTls(**files, require_certificate=own.require_certificate)

    def _start_broker(self) -> None:
        link = self.network.links[self.broker_box]
        port = self.plant.broker.endpoint().port
        broker_dir = self.workdir / "broker"
        broker_dir.mkdir(exist_ok=True)
        lines = ["log_dest stderr", "log_timestamp_format %H:%M:%S",
                 # Started as root, Mosquitto would become user "mosquitto", who cannot
                 # read the rehearsal's files.
                 f"user {pwd.getpwuid(os.geteuid()).pw_name}"]
        if self.plant.security is None:
            # Anonymous, as the plant is: only the private bridge reaches this listener.
            lines += [f"listener {port} {link.address}", "allow_anonymous true",
                      "set_tcp_nodelay true"]
        else:
            from broker.mosquitto_config import write_mosquitto_config

            included = broker_dir / "conf.d"
            included.mkdir(exist_ok=True)
            write_mosquitto_config(self.plant, included, bind=link.address)
            lines.append(f"include_dir {included}")
        conf = broker_dir / "mosquitto.conf"
        conf.write_text("\n".join(lines) + "\n")
        over = "plain MQTT" if self.plant.speaks_plain() else "TLS"
        self.progress(f"starting Mosquitto on {self.broker_box} ({link.address}:{port}, {over})")
        self.spawn("broker", self.broker_box, [MOSQUITTO, "-c", str(conf)])
        deadline = time.monotonic() + BROKER_START_S
        while not self._accepts(link.address, port):
            if self.procs["broker"].poll() is not None or time.monotonic() > deadline:
                raise EdgebusError(f"Mosquitto did not listen on {link.address}:{port}:\n"
                                   f"{self.log_tail('broker')}")
            time.sleep(_POLL_S)

    @staticmethod
    def _accepts(address: str, port: int) -> bool:
        # From the host namespace, through the bridge: the path every client takes.
        with socket.socket() as sock:
            sock.settimeout(1.0)
            return sock.connect_ex((address, port)) == 0

    def start_agent(self, agent: str) -> None:
        """Start (or start again) a stage node or the coordinator in its box."""
        command = [sys.executable, "-m", "edgebus"]
        if agent == self.plant.coordinator.id:
            groups = ([] if self.options.batch_groups is None
                      else ["--batch-groups", str(self.options.batch_groups)])
            argv = [*command, "coordinator", str(self.plant_path), *groups]
            box = self.coordinator_box
        else:
            # One thread: the box's quota is at most a core (sizing.MAX_BOX_CORES).
            argv = [*command, "node", str(self.plant_path), "--id", agent, "--threads", "1"]
            box = agent
        self.spawn(agent, box, argv)

    def spawn(self, name: str, box: str, argv: list[str],
              env: dict[str, str] | None = None) -> None:
        """Run `argv` as `name` inside `box`: its namespace and control group, its output
        into logs/`name`.log, stopped at teardown."""
        if name in self.procs and self.procs[name].poll() is None:
            raise EdgebusError(f"{name} is already running")
        namespace = self.network.links[box].namespace
        join = [os.fsencode(path) for path in self.groups[box].procs_files()]
        die_with_parent = child_setup()

        def preexec() -> None:
            # Between fork and exec: plain system calls only.
            if die_with_parent is not None:
                die_with_parent()
            pid = str(os.getpid()).encode()
            for path in join:
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.write(fd, pid)
                finally:
                    os.close(fd)

        env = {**(os.environ if env is None else env),
               "EDGEBUS_HOME": str(self.workdir / "home"), "HF_HUB_OFFLINE": "1",
               "OMP_NUM_THREADS": "1"}
        log = (self.workdir / "logs" / f"{name}.log").open("ab")
        with log:
            self.procs[name] = subprocess.Popen(
                ["nsenter", f"--net={NETNS_DIR}/{namespace}", *argv], stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, preexec_fn=preexec)
        self.box_of[name] = box
        self.started_at[name] = time.monotonic()

    # -- while running ---------------------------------------------------------

    def set_link(self, box: str, up: bool) -> None:
        """Plug in (`up`) or pull the cable of `box`."""
        self.progress(f"link of {box} {'up' if up else 'down'}")
        self.network.set_link(box, up)

    def stop_agent(self, agent: str) -> None:
        """Stop `agent` as systemd would (SIGTERM, then SIGKILL), if it runs."""
        self._terminate([agent])

    def came_online(self, agent: str) -> None:
        """Note `agent`'s first start as it ends (the first time it is seen online)."""
        if agent not in self.online:
            group = self.groups[self.box_of[agent]]
            self.online[agent] = Online(seconds=time.monotonic() - self.started_at[agent],
                                        cpu_s=group.cpu_usage_s(), disk=group.disk_bytes())

    def pid(self, agent: str) -> int:
        return self.procs[agent].pid

    def dead(self) -> dict[str, int]:
        """Agents (and the broker) that have exited, with their exit codes."""
        return {name: code for name, proc in self.procs.items()
                if (code := proc.poll()) is not None}

    def describe_exit(self, name: str) -> str:
        """How `name` (an agent, or "broker") ended, e.g. "jetson (pid 4242) was killed by
        the kernel's OOM killer, out of memory (limit 700 MiB ...)"."""
        proc = self.procs[name]
        code = proc.returncode
        assert code is not None
        if code != -signal.SIGKILL:
            return f"{name} (pid {proc.pid}) exited with code {code}"
        box = self.box_of[name]
        group = self.groups[box]
        # Each box's group is made for the rehearsal, its counter 0 before anything ran.
        how = describe_kill(proc.pid, started_s=self.started_at[name],
                            limit_bytes=self.share(box).memory_bytes,
                            limit_source=f"box {box}: memory_mb x --memory-scale, its "
                            f"control group's limit", group_counted=group.oom_kills() > 0,
                            peak_bytes=group.peak_bytes(), last_rss=self.last_rss.get(name),
                            share=self.planned.get(name, ""))
        return f"{name} (pid {proc.pid}) {how}"

    def watch_memory(self) -> None:
        """Note every running agent's RSS: what it held if it is killed."""
        for name, proc in self.procs.items():
            if proc.poll() is None and (rss := rss_bytes(proc.pid)) is not None:
                self.last_rss[name] = rss

    def log_tail(self, name: str) -> str:
        path = self.workdir / "logs" / f"{name}.log"
        try:
            return path.read_text(errors="replace")[-LOG_TAIL_CHARS:]
        except FileNotFoundError:
            return "(no log)"

    # -- teardown ---------------------------------------------------------------

    def stop(self) -> None:
        """Stop every process, then remove control groups, namespaces and the bridge.

        Agents first, the broker last, so their "offline" statuses still reach it.
        """
        # Nothing is measured any more, and a process finalising torch on a
        # third of a core took ~1.5 s: without the quotas, teardown took a third
        # of the time.
        for group in self.groups.values():
            with contextlib.suppress(OSError):
                group.set_cpu(None)
        agents = [name for name in self.procs if name != "broker"]
        self._terminate(agents)
        self._terminate([name for name in self.procs if name == "broker"])
        self.procs.clear()
        errors = []
        if self.tree is not None:
            try:
                self.tree.remove()
            except OSError as exc:
                errors.append(f"control groups: {exc}")
        try:
            self.network.remove()
        except netns.NetworkError as exc:
            errors.append(str(exc))
        if errors:
            raise EdgebusError("teardown left something behind: " + "; ".join(errors)
                               + " — `edgebus rehearse --clean` removes it")
        leftovers.forget(self.run_id)

    def _terminate(self, names: list[str]) -> None:
        procs = [self.procs[name] for name in names]
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
