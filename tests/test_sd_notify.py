"""systemd notification: the protocol module, and a real agent process talking it.

The agent test plays systemd's part: it binds the datagram socket that
$NOTIFY_SOCKET names, sets a short $WATCHDOG_USEC, starts `edgebus
coordinator` as an OS process against a real broker, and reads what arrives.
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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from brokers import AmqttBroker, free_port
from pipeline import plant_for

from edgebus.core import sd_notify
from edgebus.core.processes import LOOPBACK
from plant_config import make_plant, write_plant

# 100 ms: the agent pings every 50 ms, so a test sees many pings in half a second.
WATCHDOG_USEC = 100_000
PERIOD_S = WATCHDOG_USEC / 2e6
# The agent imports torch and transformers before it connects: ~10 s on a
# loaded two-core box.
START_S = 60.0
# The client retries a lost broker after 0.25 s, then backs off to 10 s; a
# loaded box may add seconds to any of these steps.
RECONNECT_S = 60.0
# How long to wait for a datagram the agent must send: a ping comes every
# PERIOD_S, but a loaded box may keep the agent off the CPU for seconds.
PING_S = 30.0
# A clean exit finishes within the client's 2 s close timeout.
STOP_S = 15.0
# Watchdog periods the broker stays away: every datagram the agent sends in
# that time, however many, is checked for a ping that must not be there.
QUIET_PERIODS = 10


@pytest.fixture
def notify_socket() -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket in the abstract namespace, and its $NOTIFY_SOCKET spelling."""
    name = f"edgebus-test-{secrets.token_hex(6)}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    sock.setblocking(False)
    with sock:
        yield sock, "@" + name


async def receive(sock: socket.socket, timeout: float) -> list[str]:
    """The next datagram's assignments."""
    data = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 4096), timeout)
    return data.decode().split("\n")


async def until(sock: socket.socket, assignment: str, timeout: float) -> list[list[str]]:
    """Every datagram up to and including the first holding `assignment` (a prefix)."""
    seen: list[list[str]] = []
    deadline = time.monotonic() + timeout
    while not seen or not any(a.startswith(assignment) for a in seen[-1]):
        seen.append(await receive(sock, max(0.0, deadline - time.monotonic())))
    return seen


@contextmanager
def notifying(args: list[str], notify_address: str, log: Path
              ) -> Iterator[subprocess.Popen[bytes]]:
    """`edgebus ARGS` as systemd would start it with WatchdogSec=; killed if still running at
    the end, its output (in `log`) printed so a failing test's report shows it."""
    env = {**os.environ, "NOTIFY_SOCKET": notify_address, "WATCHDOG_USEC": str(WATCHDOG_USEC)}
    env.pop("WATCHDOG_PID", None)
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "edgebus", *args], env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        print(f"--- {args[0]} log ---\n{log.read_text(errors='replace')}")


def test_notify_sends_one_datagram_to_a_path_socket(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        sd_notify.notify("READY=1", "STATUS=serving")
        sock.settimeout(5)
        assert sock.recv(4096) == b"READY=1\nSTATUS=serving"


async def test_notify_reaches_an_abstract_socket(notify_socket: tuple[socket.socket, str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    sock, address = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    sd_notify.notify("STOPPING=1")
    assert await receive(sock, 5) == ["STOPPING=1"]


def test_watchdog_period_is_half_the_timeout_and_only_for_this_process(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert sd_notify.watchdog_period() is None
    monkeypatch.setenv("WATCHDOG_USEC", "90000000")
    assert sd_notify.watchdog_period() == 45.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sd_notify.watchdog_period() == 45.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # set for another process
    assert sd_notify.watchdog_period() is None


async def test_agent_is_ready_once_connected_and_pings_only_while_connected(
        tmp_path: Path, tiny_llama_gguf: Path, amqtt_broker: AmqttBroker,
        notify_socket: tuple[socket.socket, str]) -> None:
    # llama.cpp stages: their coordinator starts without importing torch.
    plant_path = tmp_path / "plant.yaml"
    write_plant(plant_for(tiny_llama_gguf, amqtt_broker, [(0, 3), (3, 6)], weights="gguf"),
                plant_path)
    sock, address = notify_socket
    log = tmp_path / "coordinator.log"
    with notifying(["coordinator", str(plant_path)], address, log) as agent:
        before_ready = await until(sock, "READY=1", START_S)
        assert not any("WATCHDOG=1" in d for d in before_ready), before_ready
        assert f"STATUS=connected to the broker at {amqtt_broker.host}:{amqtt_broker.port}" \
            in before_ready[-1]
        await until(sock, "WATCHDOG=1", PING_S)

        amqtt_broker.stop()
        lost = await until(sock, "STATUS=lost the broker", RECONNECT_S)
        assert "WATCHDOG=1" not in lost[-1], lost
        await asyncio.sleep(QUIET_PERIODS * PERIOD_S)
        amqtt_broker.start()  # same port: the agent reconnects, and the pings resume
        # Everything the agent said while the broker was away, up to the datagram
        # that says it is connected again: no ping among it, however long it took.
        back = await until(sock, "STATUS=connected", RECONNECT_S)
        assert not any("WATCHDOG=1" in d for d in back[:-1]), back
        assert "WATCHDOG=1" in back[-1], back  # the pings resume with the connection

        agent.send_signal(signal.SIGTERM)
        await until(sock, "STOPPING=1", STOP_S)
        assert agent.wait(STOP_S) == 0


async def test_embedded_broker_is_ready_once_listening_and_pings(
        tmp_path: Path, tiny_llama: Path, notify_socket: tuple[socket.socket, str]) -> None:
    port = free_port()
    plant = make_plant(tiny_llama, stages=2, plant_id="notify")
    plant = plant.model_copy(update={"broker": plant.broker.model_copy(
        update={"host": LOOPBACK, "port": port})})
    plant_path = tmp_path / "plant.yaml"
    write_plant(plant, plant_path)
    sock, address = notify_socket
    log = tmp_path / "broker.log"
    with notifying(["broker", str(plant_path)], address, log) as broker:
        ready = await until(sock, "READY=1", START_S)
        assert f"STATUS=listening on {LOOPBACK}:{port}" in ready[-1]
        with socket.create_connection((LOOPBACK, port), timeout=5):
            pass  # READY=1 came once it listens
        await until(sock, "WATCHDOG=1", PING_S)
        broker.send_signal(signal.SIGTERM)
        await until(sock, "STOPPING=1", STOP_S)
        assert broker.wait(STOP_S) == 0
