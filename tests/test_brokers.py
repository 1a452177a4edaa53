"""The brokers edgebus runs on, checked for what the bus relies on.

QoS 1 delivery, retained status messages, Last Will when an agent dies,
restarts on the same port, and small request/reply latency (Nagle). Each
broker test runs against both real brokers: amqtt in-process and Mosquitto.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import aiomqtt
import pytest
from brokers import MOSQUITTO_INSTALL_HINT, BrokerHandle, MosquittoBroker, free_port

from broker.embedded import EmbeddedBroker
from edgebus.core.client import NODELAY
from edgebus.core.errors import BusError

# paho (under aiomqtt) leaves Nagle on; without this every small request/reply
# waits for the peer's delayed ACK: 88 ms measured on the loopback.
SOCKET_OPTIONS = (NODELAY,)
# Generous for the loopback, where a delivery takes about a millisecond.
DELIVERY_TIMEOUT_S = 5.0
# A message that must not arrive is shown absent by a sentinel: a message sent
# after the moment the wrong one would have been sent, which a broker delivers
# in order, so it arrives after that one. No wait for silence, which a loaded
# box can stretch past any window.
SENTINEL = b"sentinel"
# A dying client subprocess must connect within this, Python start-up included.
CHILD_CONNECT_TIMEOUT_S = 15.0
KIB = bytes(range(256)) * 4


def client(broker: BrokerHandle, will: aiomqtt.Will | None = None) -> aiomqtt.Client:
    return aiomqtt.Client(broker.host, broker.port, will=will, socket_options=SOCKET_OPTIONS)


async def next_message(sub: aiomqtt.Client, timeout: float = DELIVERY_TIMEOUT_S) -> aiomqtt.Message:
    async with asyncio.timeout(timeout):
        return await anext(sub.messages)


async def test_qos1_round_trip(broker: BrokerHandle) -> None:
    async with client(broker) as sub, client(broker) as pub:
        await sub.subscribe("t/qos1", qos=1)
        await pub.publish("t/qos1", KIB, qos=1)
        msg = await next_message(sub)
    assert msg.topic.value == "t/qos1"
    assert msg.payload == KIB
    assert msg.qos == 1
    assert not msg.retain


async def test_persistent_session_gets_what_it_missed(broker: BrokerHandle) -> None:
    """QoS 1 messages published while a clean_session=False subscriber is away reach it later."""
    def agent() -> aiomqtt.Client:
        return aiomqtt.Client(broker.host, broker.port, identifier="agent-7",
                              clean_session=False, socket_options=SOCKET_OPTIONS)

    async with agent() as sub:
        await sub.subscribe("t/act/agent-7", qos=1)
    async with client(broker) as pub:
        await pub.publish("t/act/agent-7", KIB, qos=1)
    async with agent() as sub:
        msg = await next_message(sub)
    assert msg.payload == KIB


async def test_a_returning_client_subscribes_before_it_acknowledges_what_it_left(
        broker: BrokerHandle, caplog: pytest.LogCaptureFixture) -> None:
    """A persistent session's client that left holding a QoS 1 message unacknowledged gets
    it again on its return, and its SUBSCRIBE is answered before it acknowledges it, as an
    edgebus client does (`BusClient.run`): the broker's wait for that PUBACK must not hold
    up the SUBSCRIBE (amqtt 0.12.1's did, until its 5 s timeout, then dropped the message
    as unacknowledged)."""
    def coordinator() -> aiomqtt.Client:
        agent = aiomqtt.Client(broker.host, broker.port, identifier="coordinator-7",
                               clean_session=False, socket_options=SOCKET_OPTIONS)
        agent._client.manual_ack_set(True)  # the paho client under aiomqtt
        return agent

    async with coordinator() as first:
        await first.subscribe("t/answers", qos=1)
        async with client(broker) as stage:
            await stage.publish("t/answers", KIB, qos=1)
        await next_message(first)  # left unacknowledged
    async with coordinator() as back:
        await back.subscribe("t/requests", qos=1)
        again = await next_message(back)
        back._client.ack(again.mid, again.qos)
        # The broker reads a connection's packets in order: once this comes back, it has
        # read the PUBACK before it.
        await back.publish("t/requests", SENTINEL, qos=1)
        assert (await next_message(back)).payload == SENTINEL
    assert again.payload == KIB
    assert not [r for r in caplog.records if "Timeout waiting for PUBACK" in r.getMessage()]


async def test_small_request_reply_is_not_delayed_by_nagle(broker: BrokerHandle) -> None:
    """A 1 KiB QoS 1 request and its reply, through the broker twice, stay far below 40 ms.

    Nagle's algorithm plus delayed ACK adds 40+ ms per hop when either the
    broker (Mosquitto without `set_tcp_nodelay true`) or a client leaves it on.
    """
    warmup, measured = 3, 20
    ready = asyncio.Event()

    async def echo() -> None:
        async with client(broker) as peer:
            await peer.subscribe("t/req", qos=1)
            ready.set()
            for _ in range(warmup + measured):
                request = await next_message(peer)
                await peer.publish("t/rep", request.payload, qos=1)

    echo_task = asyncio.create_task(echo())
    await asyncio.wait_for(ready.wait(), DELIVERY_TIMEOUT_S)
    round_trips_ms = []
    async with client(broker) as requester:
        await requester.subscribe("t/rep", qos=1)
        for _ in range(warmup + measured):
            start = time.perf_counter()
            await requester.publish("t/req", KIB, qos=1)
            await next_message(requester)
            round_trips_ms.append((time.perf_counter() - start) * 1000)
    await echo_task
    median_ms = statistics.median(round_trips_ms[warmup:])
    assert median_ms < 20, f"median request/reply {median_ms:.1f} ms: Nagle is on somewhere"


async def test_retained_message_reaches_late_subscriber(broker: BrokerHandle) -> None:
    async with client(broker) as pub:
        await pub.publish("t/status/a", b"online", qos=1, retain=True)
    async with client(broker) as late:
        await late.subscribe("t/status/#", qos=1)
        msg = await next_message(late)
    assert (msg.topic.value, msg.payload, msg.retain) == ("t/status/a", b"online", True)


async def test_retained_messages_go_only_to_matching_subscribers(broker: BrokerHandle) -> None:
    # amqtt 0.12.1 unpatched sends a connecting client the retained messages
    # matching *other* clients' filters; an agent would read status JSON as frames.
    async with client(broker) as watcher:
        await watcher.subscribe("t/status/+", qos=1)
        await watcher.publish("t/status/a", b"online", qos=1, retain=True)
        async with client(broker) as stage:
            await stage.subscribe("t/act/stage-0", qos=1)
            # A wrong retained message is sent at CONNECT, before this.
            await watcher.publish("t/act/stage-0", SENTINEL, qos=1)
            msg = await next_message(stage)
    assert (msg.topic.value, msg.payload) == ("t/act/stage-0", SENTINEL)


async def test_empty_retained_message_clears_the_topic(broker: BrokerHandle) -> None:
    async with client(broker) as pub:
        await pub.publish("t/status/gone", b"online", qos=1, retain=True)
        await pub.publish("t/status/gone", b"", qos=1, retain=True)
        await pub.publish("t/status/kept", b"online", qos=1, retain=True)
    async with client(broker) as late:
        await late.subscribe("t/status/#", qos=1)
        # Both brokers send a subscription's retained messages before anything
        # published after its SUBACK (amqtt awaits them before it delivers more).
        await late.publish("t/status/sentinel", SENTINEL, qos=1)
        seen = []
        while (msg := await next_message(late)).payload != SENTINEL:
            seen.append((msg.topic.value, msg.payload))
    assert seen == [("t/status/kept", b"online")]


# A node agent in miniature: connects with a retained Last Will, then hangs
# until killed, the way a crashed or powered-off box goes away.
_DYING_CLIENT = """
import asyncio, socket, sys
import aiomqtt

async def main():
    host, port, topic = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    will = aiomqtt.Will(topic, b"offline", qos=1, retain=True)
    async with aiomqtt.Client(host, port, identifier="dying-agent", will=will):
        print("connected", flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


async def child_says(child: asyncio.subprocess.Process) -> bytes:
    """The next line a client subprocess prints (its start-up included in the bound)."""
    assert child.stdout is not None
    return await asyncio.wait_for(child.stdout.readline(), CHILD_CONNECT_TIMEOUT_S)


async def test_last_will_is_published_when_a_client_dies(broker: BrokerHandle) -> None:
    topic = "t/status/dying-agent"
    async with client(broker) as watcher:
        await watcher.subscribe(topic, qos=1)
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _DYING_CLIENT, broker.host, str(broker.port), topic,
            stdout=asyncio.subprocess.PIPE)
        try:
            assert await child_says(child) == b"connected\n"
        finally:
            child.kill()
            await child.wait()
        will = await next_message(watcher)
    assert (will.topic.value, will.payload, will.qos) == (topic, b"offline", 1)
    async with client(broker) as late:
        await late.subscribe(topic, qos=1)
        retained = await next_message(late)
    assert (retained.payload, retained.retain) == (b"offline", True)


# A coordinator in miniature: takes a request it acknowledges only once journaled, and is
# killed before that.
_HOLDING_CLIENT = """
import asyncio, sys
import aiomqtt

async def main():
    host, port, topic = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    async with aiomqtt.Client(host, port, identifier="holding-agent",
                              clean_session=False) as agent:
        agent._client.manual_ack_set(True)
        await agent.subscribe(topic, qos=1)
        print("subscribed", flush=True)
        async for _ in agent.messages:
            print("got", flush=True)
            await asyncio.sleep(3600)

asyncio.run(main())
"""


async def test_what_a_killed_client_left_unacknowledged_is_delivered_again(
        broker: BrokerHandle) -> None:
    """A request the coordinator was killed holding is not lost: its persistent session
    gets it again on its return (stock amqtt 0.12.1 dropped it; docs/failover.md)."""
    topic = "t/request/holding-agent"
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLDING_CLIENT, broker.host, str(broker.port), topic,
        stdout=asyncio.subprocess.PIPE)
    try:
        assert await child_says(child) == b"subscribed\n"
        async with client(broker) as gateway:
            await gateway.publish(topic, KIB, qos=1)
        assert await child_says(child) == b"got\n"
    finally:
        child.kill()
        await child.wait()
    async with aiomqtt.Client(broker.host, broker.port, identifier="holding-agent",
                              clean_session=False, socket_options=SOCKET_OPTIONS) as back:
        again = await next_message(back)
    assert again.payload == KIB


async def test_no_last_will_on_clean_disconnect(broker: BrokerHandle) -> None:
    topic = "t/status/leaving-agent"
    async with client(broker) as watcher:
        await watcher.subscribe(topic, qos=1)
        async with client(broker, will=aiomqtt.Will(topic, b"offline", qos=1)):
            pass
        # The DISCONNECT was on the broker's socket before `other` connected, and
        # `other` publishes only after its CONNACK: a wrongly sent Will, sent
        # when the broker handles that DISCONNECT, would come before the sentinel.
        async with client(broker) as other:
            await other.publish(topic, SENTINEL, qos=1)
        msg = await next_message(watcher)
    assert msg.payload == SENTINEL


def test_broker_hangs_up_on_a_client_that_never_sends_connect(broker: BrokerHandle) -> None:
    """A TCP health probe must not leave a socket open on the broker side."""
    with socket.create_connection((broker.host, broker.port), timeout=DELIVERY_TIMEOUT_S) as sock:
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(1) == b"", "the broker kept the connection open"


async def test_broker_survives_clients_that_misbehave(broker: BrokerHandle) -> None:
    """Port probes, garbage, a truncated CONNECT and a reset socket must not take it down."""
    address = (broker.host, broker.port)
    with socket.create_connection(address):
        pass
    with socket.create_connection(address) as sock:
        sock.sendall(b"\xff\xff\xff\xff\xff not mqtt")
    with socket.create_connection(address) as sock:
        sock.sendall(b"\x10\x20\x00\x04MQ")
    with socket.create_connection(address) as sock:
        # CONNECT, MQTT 3.1.1, clean session, keepalive 60, client id "rst"
        sock.sendall(b"\x10\x0f\x00\x04MQTT\x04\x02\x00\x3c\x00\x03rst")
        sock.recv(4)  # CONNACK
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    # The reset was on the broker's socket before the round trip's client
    # connected; the round trip shows the broker still serving after it.
    await test_qos1_round_trip(broker)


async def test_restart_on_same_port(broker: BrokerHandle) -> None:
    port = broker.port
    async with client(broker) as before:
        await before.publish("t/x", b"1", qos=1)
    broker.stop()
    with pytest.raises(aiomqtt.MqttError):
        async with client(broker):
            pass
    broker.start()
    assert broker.port == port
    await test_qos1_round_trip(broker)


async def test_mosquitto_restarts_after_being_killed(mosquitto_broker: MosquittoBroker) -> None:
    mosquitto_broker.stop(kill=True)
    mosquitto_broker.start()
    await test_qos1_round_trip(mosquitto_broker)


async def test_mosquitto_persistence_keeps_retained_across_restart(
        make_mosquitto: Callable[..., MosquittoBroker]) -> None:
    broker = make_mosquitto(persistence=True)
    async with client(broker) as pub:
        await pub.publish("t/status/kept", b"online", qos=1, retain=True)
    broker.stop()
    assert (broker.workdir / "mosquitto.db").is_file()
    broker.start()
    async with client(broker) as late:
        await late.subscribe("t/status/#", qos=1)
        msg = await next_message(late)
    assert (msg.payload, msg.retain) == (b"online", True)


def test_broker_kinds(amqtt_broker: BrokerHandle, mosquitto_broker: BrokerHandle) -> None:
    assert (amqtt_broker.kind, amqtt_broker.mqtt5) == ("amqtt", False)
    assert (mosquitto_broker.kind, mosquitto_broker.mqtt5) == ("mosquitto", True)
    assert amqtt_broker.port != mosquitto_broker.port


def test_mosquitto_command_line_clients(mosquitto_broker: MosquittoBroker) -> None:
    pub, sub = shutil.which("mosquitto_pub"), shutil.which("mosquitto_sub")
    if pub is None or sub is None:
        pytest.fail(f"mosquitto_pub/mosquitto_sub are not installed: {MOSQUITTO_INSTALL_HINT}")
    target = ["-h", mosquitto_broker.host, "-p", str(mosquitto_broker.port)]
    subprocess.run([pub, *target, "-t", "t/cli", "-m", "hello", "-q", "1", "-r"],
                   check=True, timeout=DELIVERY_TIMEOUT_S)
    got = subprocess.run([sub, *target, "-t", "t/cli", "-C", "1", "-v",
                          "-W", str(int(DELIVERY_TIMEOUT_S))],
                         check=True, capture_output=True, text=True, timeout=2 * DELIVERY_TIMEOUT_S)
    assert got.stdout == "t/cli hello\n"


async def test_embedded_broker_picks_a_port_and_reports_a_busy_one() -> None:
    async with EmbeddedBroker(port=0) as first:
        assert first.port != 0
        async with aiomqtt.Client(first.host, first.port, socket_options=SOCKET_OPTIONS):
            pass
        with pytest.raises(BusError, match=f"cannot listen on 127.0.0.1:{first.port}"):
            async with EmbeddedBroker(port=first.port):
                pass


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_run_broker_forever_serves_until_signalled(signum: signal.Signals) -> None:
    port = free_port()
    code = ("from broker.embedded import run_broker_forever; "
            f"run_broker_forever('127.0.0.1', {port})")
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        line = await asyncio.wait_for(proc.stderr.readline(), CHILD_CONNECT_TIMEOUT_S)  # type: ignore[union-attr]
        assert f"edgebus embedded broker listening on 127.0.0.1:{port}" in line.decode()
        async with aiomqtt.Client("127.0.0.1", port, socket_options=SOCKET_OPTIONS) as c:
            await c.subscribe("t/alive", qos=1)
            await c.publish("t/alive", b"1", qos=1)
            assert (await next_message(c)).payload == b"1"
        proc.send_signal(signum)
        rc = await asyncio.wait_for(proc.wait(), DELIVERY_TIMEOUT_S)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    rest = (await proc.stderr.read()).decode()  # type: ignore[union-attr]
    assert rc == 0, rest
    assert "Traceback" not in rest
