"""Debian's Mosquitto as a child process on a free loopback port, for benches and tests.

A plant's production broker is a Mosquitto run by the box's init system; this
helper starts one the same way edgebus expects it configured (anonymous on
the loopback, `set_tcp_nodelay true`) without touching the system's broker on
1883 or needing root. It writes its config and log into a directory of the
caller's choosing, and `stop()` then `start()` restarts it on the same port.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from broker.exposure import refuse_open_listener
from edgebus.core.errors import EdgebusError
from edgebus.core.processes import LOOPBACK, child_setup, free_port

INSTALL_HINT = "apt-get install mosquitto mosquitto-clients"

# Debian installs the broker in /usr/sbin, which is not on a non-root user's PATH.
_SEARCH_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/usr/local/sbin"])
# Mosquitto listens within ~25 ms here; the margin is for a loaded CI box.
START_TIMEOUT_S = 10.0
# It stops in ~0.1 s; the margin is as above.
STOP_TIMEOUT_S = 5.0
# How often start() checks whether the port accepts connections.
_POLL_INTERVAL_S = 0.01
# How much of the log an error message quotes: the end is where the reason is.
_LOG_TAIL_CHARS = 4000


def mosquitto_binary() -> str | None:
    """Path of the `mosquitto` broker binary, or None when it is not installed."""
    return shutil.which("mosquitto", path=_SEARCH_PATH)


def mosquitto_version() -> str | None:
    """E.g. "mosquitto version 2.0.11", or None when it is not installed."""
    binary = mosquitto_binary()
    if binary is None:
        return None
    # `-h` prints the version line first (and exits 3, which is not an error here).
    result = subprocess.run([binary, "-h"], capture_output=True, text=True, check=False)
    lines = (result.stdout or result.stderr).splitlines()
    return lines[0].strip() if lines else None


class MosquittoProcess:
    """A `mosquitto` child process listening on `host:port`; a context manager that stops it.

    `port=None` picks a free port once, so a restart keeps it. The config and
    the log (accumulated over restarts) are `workdir/mosquitto.conf` and
    `workdir/mosquitto.log`. `persistence=True` keeps retained messages,
    sessions and queued QoS>0 messages across a restart (saved at stop and
    every `autosave_interval` s), as a plant's broker should. With
    `include_dir` (what `edgebus broker mosquitto-config` wrote), the listener
    and access control come from the `*.conf` files there instead: `port`
    must then be the port they listen on. `log_all=True` logs every packet
    (`log_type all`), each PUBLISH and PUBACK with its client id and message
    id: what a check that every delivery is acknowledged reads.
    """

    def __init__(self, workdir: Path, *, host: str = LOOPBACK, port: int | None = None,
                 persistence: bool = False, autosave_interval: int = 1,
                 include_dir: Path | None = None, log_all: bool = False) -> None:
        binary = mosquitto_binary()
        if binary is None:
            raise EdgebusError(f"mosquitto is not installed: {INSTALL_HINT}")
        self._binary = binary
        self.host = host
        self.port = port if port is not None else free_port(host)
        # Its own listener admits anyone: loopback only. An include_dir brings a
        # secured listener (`edgebus broker mosquitto-config`).
        refuse_open_listener(host, self.port, secured=include_dir is not None, what="mosquitto")
        self.workdir = workdir
        self.persistence = persistence
        self.autosave_interval = autosave_interval
        self.include_dir = include_dir
        self.log_all = log_all
        self.conf_path = workdir / "mosquitto.conf"
        self.log_path = workdir / "mosquitto.log"
        self._proc: subprocess.Popen[bytes] | None = None
        workdir.mkdir(parents=True, exist_ok=True)
        self.conf_path.write_text(self._config())

    @property
    def url(self) -> str:
        """The plant file's `broker.url` for this broker."""
        return f"mqtt://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Process id while running, else None."""
        return None if self._proc is None else self._proc.pid

    def _config(self) -> str:
        lines = [] if self.include_dir is not None else [
            f"listener {self.port} {self.host}",
            "allow_anonymous true",
            # Without it Nagle + delayed ACK add 44 ms to every small QoS 1
            # request/reply on the loopback (88 ms when clients lack it too).
            "set_tcp_nodelay true",
        ]
        lines += [
            "log_dest stderr",
            "log_timestamp_format %H:%M:%S",
            # Started as root, mosquitto drops to the "mosquitto" user, which
            # cannot write into the caller's directory; naming the current
            # user keeps it as is (and is ignored when not root).
            f"user {pwd.getpwuid(os.geteuid()).pw_name}",
        ]
        if self.log_all:
            lines.append("log_type all")
        if self.include_dir is not None:
            lines.append(f"include_dir {self.include_dir}")
        if self.persistence:
            lines += ["persistence true", f"persistence_location {self.workdir}",
                      f"autosave_interval {self.autosave_interval}"]
        return "\n".join(lines) + "\n"

    def __enter__(self) -> MosquittoProcess:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        """Start the broker; it accepts TCP connections when this returns."""
        if self._proc is not None:
            raise EdgebusError(f"mosquitto on {self.host}:{self.port} is already running")
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen([self._binary, "-c", str(self.conf_path)],
                                          stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, preexec_fn=child_setup())
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _accepts_tcp(self.host, self.port):
            if self._proc.poll() is not None:
                code, self._proc = self._proc.returncode, None
                raise EdgebusError(f"mosquitto exited with code {code} at start:\n"
                                   f"{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise EdgebusError(f"mosquitto did not listen on {self.host}:{self.port} within "
                                   f"{START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")
            time.sleep(_POLL_INTERVAL_S)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, *, kill: bool = False) -> None:
        """SIGTERM the broker (SIGKILL after STOP_TIMEOUT_S), or SIGKILL at once to mimic a
        crash; idempotent."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        if kill:
            proc.kill()
        else:
            proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def log_tail(self) -> str:
        """The end of the broker's log, for error messages."""
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
