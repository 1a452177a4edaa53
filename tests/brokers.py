"""Real MQTT brokers for integration tests: amqtt in a thread, Mosquitto as a subprocess.

Both kinds hide behind `BrokerHandle` (host, port, kind, mqtt5, start, stop),
so a test parametrized over brokers does not care which one it talks to.
`stop()` then `start()` restarts a broker on the same port, as a plant's broker
restarts under its clients.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import socket
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path

from broker.embedded import EmbeddedBroker

LOOPBACK = "127.0.0.1"

# Debian installs the broker in /usr/sbin, which is not on a non-root user's PATH.
_MOSQUITTO_SEARCH_PATH = os.pathsep.join(
    [os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])
MOSQUITTO_INSTALL_HINT = "apt-get install mosquitto mosquitto-clients"

# Both brokers are listening within ~25 ms here; the margin is for a loaded CI box.
_START_TIMEOUT_S = 10.0
# Both stop in ~0.1 s (Mosquitto saving its persistence file included); margin as above.
_STOP_TIMEOUT_S = 5.0
_PORT_POLL_INTERVAL_S = 0.01
# How much of the broker's log a failure message quotes: the end is where the reason is.
_LOG_TAIL_CHARS = 4000


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        port: int = sock.getsockname()[1]
        return port


def mosquitto_binary() -> str | None:
    """Path of the `mosquitto` broker binary, or None when it is not installed."""
    return shutil.which("mosquitto", path=_MOSQUITTO_SEARCH_PATH)


class BrokerHandle(ABC):
    """A broker a test can reach at `host:port`, stop and start again on the same port."""

    kind: str
    host: str = LOOPBACK
    port: int

    @property
    @abstractmethod
    def mqtt5(self) -> bool:
        """Whether the broker speaks MQTT 5 (else 3.1.1 only)."""

    @abstractmethod
    def start(self) -> None:
        """Start the broker; it accepts connections when this returns."""

    @abstractmethod
    def stop(self) -> None:
        """Stop the broker; idempotent."""

    def __repr__(self) -> str:
        return f"<{self.kind} broker {self.host}:{self.port}>"


class AmqttBroker(BrokerHandle):
    """`EmbeddedBroker` on its own event loop in a daemon thread.

    Its own loop makes it independent of the loop (and loop scope) of the
    test using it, and lets synchronous tests use it too. amqtt keeps state
    in memory only: a restart loses retained messages and sessions.
    """

    kind = "amqtt"

    def __init__(self) -> None:
        self.port = 0  # the first start picks a free port; restarts reuse it
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None

    @property
    def mqtt5(self) -> bool:
        return False

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"{self!r} is already running")
        started = threading.Event()
        failure: list[BaseException] = []

        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop_event = asyncio.Event()
            try:
                async with EmbeddedBroker(self.host, self.port) as broker:
                    self.port = broker.port
                    started.set()
                    await self._stop_event.wait()
            except Exception as exc:  # handed to start()'s caller, the thread just ends
                failure.append(exc)
            finally:
                started.set()

        self._thread = threading.Thread(target=asyncio.run, args=(serve(),),
                                        name="amqtt-broker", daemon=True)
        self._thread.start()
        if not started.wait(_START_TIMEOUT_S):
            raise RuntimeError(f"amqtt did not start within {_START_TIMEOUT_S} s")
        if failure:
            self._thread.join()
            self._thread = None
            raise failure[0]

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        assert self._loop is not None and self._stop_event is not None
        self._loop.call_soon_threadsafe(self._stop_event.set)
        thread.join(_STOP_TIMEOUT_S)
        if thread.is_alive():
            raise RuntimeError(f"amqtt did not shut down within {_STOP_TIMEOUT_S} s")


class MosquittoBroker(BrokerHandle):
    """A `mosquitto` subprocess with a generated config in `workdir`.

    `persistence=True` keeps retained messages, sessions and queued QoS>0
    messages across a restart (written at stop and every `autosave_interval` s).
    Its log accumulates over restarts in `workdir/mosquitto.log`.
    """

    kind = "mosquitto"

    def __init__(self, workdir: Path, *, persistence: bool = False,
                 autosave_interval: int = 1) -> None:
        binary = mosquitto_binary()
        if binary is None:
            raise FileNotFoundError(f"mosquitto is not installed: {MOSQUITTO_INSTALL_HINT}")
        self._binary = binary
        self.port = free_port()
        self.workdir = workdir
        self.persistence = persistence
        self.autosave_interval = autosave_interval
        self.conf_path = workdir / "mosquitto.conf"
        self.log_path = workdir / "mosquitto.log"
        self._proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)
        self.conf_path.write_text(self._config())

    @property
    def mqtt5(self) -> bool:
        return True

    def _config(self) -> str:
        lines = [
            f"listener {self.port} {self.host}",
            "allow_anonymous true",
            # Without it Nagle + delayed ACK add 44 ms to every small QoS 1
            # request/reply on the loopback (88 ms when clients lack it too).
            "set_tcp_nodelay true",
            "log_dest stderr",
            "log_timestamp_format %H:%M:%S",
            # Started as root, mosquitto drops to the "mosquitto" user, which
            # cannot write into a test's tmp dir; naming the current user keeps
            # it as is (and is ignored when not root).
            f"user {_current_user()}",
        ]
        if self.persistence:
            lines += [
                "persistence true",
                f"persistence_location {self.workdir}",
                f"autosave_interval {self.autosave_interval}",
            ]
        return "\n".join(lines) + "\n"

    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError(f"{self!r} is already running")
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen([self._binary, "-c", str(self.conf_path)],
                                          stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not _accepts_tcp(self.host, self.port):
            if self._proc.poll() is not None:
                rc, self._proc = self._proc.returncode, None
                raise RuntimeError(f"mosquitto exited with code {rc} at start:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mosquitto did not listen on {self.host}:{self.port} "
                                   f"within {_START_TIMEOUT_S} s:\n{self.log_tail()}")
            time.sleep(_PORT_POLL_INTERVAL_S)

    def stop(self, *, kill: bool = False) -> None:
        """SIGTERM (a clean shutdown that saves persistence), or SIGKILL to mimic a crash."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        if kill:
            proc.kill()
        else:
            proc.terminate()
        try:
            proc.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"mosquitto ignored SIGTERM for {_STOP_TIMEOUT_S} s:\n"
                               f"{self.log_tail()}") from None

    def log_tail(self) -> str:
        """The end of mosquitto's log, for failure messages."""
        try:
            return self.log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        except FileNotFoundError:
            return "(no log written)"


def _accepts_tcp(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _current_user() -> str:
    return pwd.getpwuid(os.geteuid()).pw_name
