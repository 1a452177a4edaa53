"""A thin layer over aiomqtt that every agent uses to talk to the broker.

What it adds, and why:
- TCP_NODELAY on the socket. Without it a QoS 1 round trip of a 1 KB frame on
  loopback costs 44-88 ms (Nagle waits for the delayed ACK); with it ~0.5 ms
  (measured with mosquitto 2.0.11). Every token crosses the broker S+1 times.
- `send` writes to the socket at once, on the loop's thread, instead of
  through aiomqtt's writer callback two loop turns later.
- A retained Last Will, so an agent that dies shows up offline in MQTT Explorer,
  and a retained "online" birth published on every (re)connect.
- Reconnect with capped exponential backoff, re-subscribing each time: a broker
  restart for an update must not need a person to restart every box.
- A clean close publishes "offline" itself, because a clean DISCONNECT makes the
  broker discard the Will.
- Optionally a persistent session (the coordinator's), so QoS 1 requests that
  arrive while the agent is down wait in the broker instead of vanishing.
- An unbounded incoming queue: aiomqtt drops messages it has already
  acknowledged when a bounded queue is full, which would lose QoS 1 requests
  silently. Agents bound their memory by answering (a "busy" error) instead.
- Every QoS 1 message received is acknowledged exactly once, in one place
  (`_dispatch`): when the handler returns, or, for a message the handler
  `take`s, when the task handling it ends, however it ends. A broker sends a
  client only INFLIGHT_WINDOW messages it has not acknowledged, so one that
  is never acknowledged narrows the window for good, and a full window leaves
  the agent deaf. How many a client holds is its `unacked` status metric.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import socket
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiomqtt
import paho.mqtt.client as paho
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode

from edgebus.core import tls
from edgebus.core.endpoint import BrokerEndpoint
from edgebus.core.errors import BusError
from edgebus.core.presence import Presence

log = logging.getLogger(__name__)

NODELAY = (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
# First retry after a drop comes quickly (a broker restart takes ~1 s), then
# backs off so twenty boxes don't hammer a broker that is down for longer.
RECONNECT_INITIAL_S = 0.25
RECONNECT_MAX_S = 10.0
# How long publish() waits for a lost connection to come back before failing.
PUBLISH_WAIT_S = 30.0
# How long a clean close waits for the broker to ack the "offline" status.
CLOSE_TIMEOUT_S = 2.0
# Messages `send` may hold while the connection is down. A stage sends a few
# per forward pass and the coordinator one per request step, so a broker
# restart of a few seconds leaves far fewer; past the bound the agents' replay
# after the reconnect recovers what they carried, so holding more buys nothing.
MAX_WAITING_SENDS = 1024
# Bytes of the messages `send` handed to paho while connected that the broker has
# not acknowledged yet (sent, or queued behind paho's in-flight window of 20). A
# healthy plant holds about one step's messages, a few MiB at most (a SmolLM2
# prefill chunk is a 288 KiB frame); a stage answering a flood of frames with
# ERROR messages of ~12 KiB (64 frames of 181 bytes) on a loaded 2-core box needed
# more than 512 of them (the flood test of tests/test_bounds.py: a 512-message
# bound refused 570 of its ~1500). More means a broker that stopped reading. Past
# the bound `send` refuses messages (counted in `unsent`, like MAX_WAITING_SENDS;
# a lost frame is replayed, a lost stream delta is in the final answer).
MAX_QUEUED_OUT_BYTES = 64 * 2**20
# What paho keeps per queued message beyond its payload (the message object, the
# topic), so that a stream of tiny messages is bounded too.
QUEUED_MESSAGE_BYTES = 256
# How long the broker keeps a persistent session (MQTT 5) after a disconnect:
# a day covers a coordinator box being down over a shift; requests queued
# longer than that are better re-sent by the gateway.
SESSION_EXPIRY_S = 24 * 3600
# QoS 1 messages a broker sends one client before that client's acknowledgements:
# Mosquitto's max_inflight_messages, 20 by default (measured on 2.0.11, for MQTT
# 3.1.1 and 5; under MQTT 5 a client may ask for fewer with Receive Maximum, which
# paho does not). A client holding that many unacknowledged receives nothing more.
INFLIGHT_WINDOW = 20
# Held unacknowledged from here on, a client warns (its log, its status): the
# coordinator holds a request only until it is journaled, milliseconds, so a
# healthy plant holds a few at most.
UNACKED_WARN_AT = INFLIGHT_WINDOW * 3 // 4
# The warning again at most this often while the count stays high.
UNACKED_WARN_EVERY_S = 10.0
# TLS connections in a row that the broker closes at or right after the handshake, before
# its CONNACK, until a client stops retrying and says why (a refused client certificate).
TLS_CLOSES_FATAL = 3
# CONNACK codes that no amount of retrying fixes (MQTT 3.1.1 and 5).
_FATAL_CONNACK = {1: "unacceptable protocol version", 2: "client id rejected",
                  4: "bad user name or password", 5: "not authorised",
                  0x84: "unsupported protocol version", 0x85: "client id rejected",
                  0x86: "bad user name or password", 0x87: "not authorised"}

MessageHandler = Callable[[aiomqtt.Message], None]


@dataclass
class BusClient:
    """One agent's connection to the broker. `run()` owns the connection loop."""

    endpoint: BrokerEndpoint
    client_id: str
    subscriptions: list[tuple[str, int]] = field(default_factory=list)
    presence: Presence | None = None
    # Keep subscriptions and queued QoS 1 messages across disconnects.
    persistent: bool = False
    # Called after every (re)connect, once subscribed: a reconnect may have lost
    # messages in flight (the broker restarted), so the agent may need to resend.
    on_connect: list[Callable[[], None]] = field(default_factory=list)
    # Acknowledge QoS 1 messages only once the agent is done with them (see `take`),
    # not as paho does, when they are read.
    manual_ack: bool = False
    # Reconnect after a lost connection. False: `run` returns when the first
    # connection ends (a coordinator draining a dead peer's session must not
    # take it back from the peer that reconnected).
    reconnect: bool = True
    # MQTT 5 session expiry for a persistent session.
    session_expiry_s: int = SESSION_EXPIRY_S
    unsent: int = field(default=0, init=False)  # messages refused at either bound
    queued_bytes: int = field(default=0, init=False)  # MAX_QUEUED_OUT_BYTES' count
    _queued: dict[int, int] = field(default_factory=dict, init=False)  # mid: bytes
    _client: aiomqtt.Client | None = field(default=None, init=False)
    # The connection whose online status may have reached the broker: set just before that
    # publish, where `_client` waits for its PUBACK. A stop in between must still say
    # offline, or the retained status says online for good: a clean DISCONNECT sends no Will
    # (`edgebus up` killed as its agents came online left one so, under load).
    _announced: aiomqtt.Client | None = field(default=None, init=False)
    _delivering: tuple[aiomqtt.Message, Ack] | None = field(default=None, init=False)
    _holding: set[Ack] = field(default_factory=set, init=False)  # taken, not yet acknowledged
    _warned: float = field(default=-UNACKED_WARN_EVERY_S, init=False)  # monotonic
    _connected: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    # Set when the current connection ends: a PUBACK awaited on it will never come.
    _lost: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _sending: set[asyncio.Task[None]] = field(default_factory=set, init=False)  # send()s waiting

    @property
    def mqtt5(self) -> bool:
        return self.endpoint.protocol == "5"

    @property
    def unacked(self) -> int:
        """QoS 1 messages received on this connection and not acknowledged yet."""
        return len(self._holding)

    def metrics(self) -> dict[str, float]:
        """This connection's counters for the agent's status."""
        return {"unsent": float(self.unsent), "unacked": float(self.unacked)}

    @property
    def connected(self) -> bool:
        """Whether the broker connection is up, subscribed and announced, right now."""
        return self._connected.is_set()

    def _make_client(self) -> aiomqtt.Client:
        ep = self.endpoint
        will = None
        if self.presence is not None:
            self.presence.next_session()
            will = aiomqtt.Will(self.presence.topic, self.presence.offline(), qos=1, retain=True)
        tls_context = tls.client_context(ep) if ep.tls else None
        session: dict[str, object] = {}
        if self.persistent and self.mqtt5:
            props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
            props.SessionExpiryInterval = self.session_expiry_s
            session = {"clean_start": False, "properties": props}
        elif self.persistent:
            session = {"clean_session": False}
        client = aiomqtt.Client(
            ep.host, ep.port, username=ep.username, password=ep.password,
            identifier=self.client_id, will=will, keepalive=ep.keepalive_s,
            protocol=aiomqtt.ProtocolVersion.V5 if self.mqtt5 else aiomqtt.ProtocolVersion.V311,
            tls_context=tls_context, socket_options=[NODELAY],
            max_queued_incoming_messages=0, **session)  # type: ignore[arg-type]
        if self.manual_ack:
            client._client.manual_ack_set(True)  # the paho client under aiomqtt
        # A new connection: what the last one queued is gone with it.
        self._queued.clear()
        self.queued_bytes = 0

        def on_publish(paho_client: paho.Client, userdata: Any, mid: int,
                       reason: ReasonCode, properties: Properties) -> None:
            self.queued_bytes -= self._queued.pop(mid, 0)
            # aiomqtt's own, for its publish() that awaits this; `send`'s messages, most of
            # them, are not its to wake (it would raise and suppress a KeyError for each).
            if mid in client._pending_publishes:
                client._on_publish(paho_client, userdata, mid, reason, properties)

        client._client.on_publish = on_publish
        register_write = client._client.on_socket_register_write  # aiomqtt's own
        assert register_write is not None

        def on_register_write(paho_client: paho.Client, userdata: Any, sock: Any) -> None:
            # paho asks for this whenever it queues bytes on a socket with none waiting: a
            # publish, a PUBACK. aiomqtt adds a writer for them (through
            # call_soon_threadsafe, since paho may call this from the thread that connects).
            # On the loop's own thread the bytes are written at the loop's next turn instead
            # (`send` writes its own at once, before that), and a writer is added only for
            # what the socket did not take (`_write_now`): adding and removing one around
            # every message cost two epoll_ctl calls and ~12 % of a stage's Python time.
            if _on_loop(client):
                client._loop.call_soon(_write_now, client)
            else:
                register_write(paho_client, userdata, sock)

        client._client.on_socket_register_write = on_register_write
        on_disconnect = client._client.on_disconnect  # aiomqtt's own
        if tls_context is not None and on_disconnect is not None:
            client._client.on_disconnect = functools.partial(
                _closed_before_connack, client, on_disconnect)
        return client

    async def run(self, handler: MessageHandler) -> None:
        """Connect, subscribe, announce, and feed messages to `handler` until cancelled.

        `handler` runs in the event loop for every message: it must only
        dispatch (enqueue, resolve a future, spawn a task), never compute.
        With `manual_ack`, a message is acknowledged when `handler` returns
        (or raises), unless it `take`s it.
        """
        delay = RECONNECT_INITIAL_S
        closes = 0  # TLS connections in a row the broker closed before its CONNACK
        while True:
            try:
                async with self._make_client() as client:
                    closes = 0
                    await self._on_connect(client)
                    delay = RECONNECT_INITIAL_S
                    try:
                        await self._dispatch(client, handler)
                    finally:
                        self._connected.clear()
                        self._lost.set()
                        self._client = self._announced = None
                        # Void with their connection: the broker delivers them again.
                        self._holding.clear()
                if not self.reconnect:
                    return
            except aiomqtt.MqttCodeError as exc:
                # MQTT 3.1.1 gives an int, MQTT 5 a paho ReasonCode (its number in .value).
                code = exc.rc if isinstance(exc.rc, int) else getattr(exc.rc, "value", None)
                reason = _FATAL_CONNACK.get(code) if isinstance(code, int) else None
                if reason is not None:
                    raise BusError(f"broker {self.endpoint.host}:{self.endpoint.port} refused "
                                   f"{self.client_id!r}: {reason}. Check the plant file's broker "
                                   "credentials and the broker's ACL.") from None
                log.warning("MQTT connection lost (%s); reconnecting in %.1f s", exc, delay)
            except aiomqtt.MqttError as exc:
                refused = _tls_refusal(exc, self.endpoint)
                if refused is not None:  # a certificate: retrying would not fix it
                    raise BusError(refused) from None
                if self.endpoint.tls and tls.closed_at_handshake(exc):
                    # Once may be a broker going down; again and again is a refusal.
                    closes += 1
                    if closes >= TLS_CLOSES_FATAL:
                        raise BusError(tls.closed_silently(self.endpoint)) from None
                log.warning("MQTT broker %s:%d unreachable (%s); retrying in %.1f s",
                            self.endpoint.host, self.endpoint.port, exc, delay)
            if not self.reconnect:
                return
            await asyncio.sleep(delay * random.uniform(0.8, 1.2))
            delay = min(delay * 2, RECONNECT_MAX_S)

    async def _dispatch(self, client: aiomqtt.Client, handler: MessageHandler) -> None:
        """Hand each message to `handler` as paho reads it, until the connection ends.

        paho reads in the loop's reader callback; aiomqtt's message iterator then
        queues each message and wakes its reader with a task and an asyncio.wait,
        two loop turns more per message (0.1-0.2 ms on a loaded 2-core box, on
        every hop of every token). Here the handler runs inside paho's on_message,
        on the loop's thread, in arrival order. An exception from the handler ends
        `run` with it, as it did when raised from the iterator's loop.

        With `manual_ack` this is the one place a message is acknowledged: when
        the handler is done with it, or when the task it `take`s it into ends.
        Without, paho acknowledges it once `on_message` returns.
        """
        failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def deliver(message: aiomqtt.Message) -> None:
            ack = Ack(self, client, message.mid, message.qos if self.manual_ack else 0)
            self._delivering = (message, ack)
            try:
                if self._subscribed(message):
                    handler(message)
            finally:
                # Even when the handler raised: a message that breaks it would break
                # it again on every redelivery.
                self._delivering = None
                if not ack.taken:
                    ack()

        def on_message(_client: paho.Client, _userdata: Any, message: paho.MQTTMessage) -> None:
            if failed.done():
                # The handler failed and the connection is ending: what comes now is
                # delivered again to the next connection of a persistent session.
                return
            try:
                deliver(aiomqtt.Message._from_paho_message(message))
            except Exception as exc:
                failed.set_exception(exc)

        while not client._queue.empty():  # what came before this connection was set up
            deliver(client._queue.get_nowait())
        client._client.on_message = on_message
        await asyncio.wait([client._disconnected, failed], return_when=asyncio.FIRST_COMPLETED)
        if failed.done():
            failed.result()
        raise aiomqtt.MqttError("Disconnected during message iteration") from (
            client._disconnected.exception())

    def take(self, message: aiomqtt.Message,
             handling: Callable[[Ack], Coroutine[Any, Any, None]]) -> asyncio.Task[None]:
        """Call from the handler: handle `message` in a task, `handling(ack)`, and return it.

        The message is acknowledged when the task ends, however it ends
        (returned, raised, cancelled), or earlier, when the task calls `ack`
        (the coordinator does once a request is journaled); once either way.
        Until then the broker keeps it in the session and delivers it again
        after a reconnect (the agent must then recognise it). An Ack called
        after its connection is gone does nothing: the new connection gets the
        message again instead.
        """
        delivering = self._delivering
        if not self.manual_ack or delivering is None or delivering[0] is not message:
            raise BusError(f"{self.client_id}: take() needs manual_ack=True and is for the "
                           "message the handler is called with, from the handler")
        ack = delivering[1]
        ack.taken = True
        if ack.qos > 0:
            self._holding.add(ack)
            self._check_window()
        task = asyncio.ensure_future(handling(ack))
        task.add_done_callback(functools.partial(_handled, ack, message.topic.value))
        return task

    def _check_window(self) -> None:
        """Warn, rate-limited, while held messages near the broker's in-flight window."""
        now = time.monotonic()
        if self.unacked >= UNACKED_WARN_AT and now - self._warned >= UNACKED_WARN_EVERY_S:
            self._warned = now
            log.warning("%s holds %d QoS 1 messages unacknowledged; at %d (the broker's "
                        "in-flight window) it receives nothing more until it acknowledges "
                        "some", self.client_id, self.unacked, INFLIGHT_WINDOW)

    def _subscribed(self, message: aiomqtt.Message) -> bool:
        # A broker may deliver what matches none of our filters (a stock
        # amqtt 0.12.1 sends a connecting client the retained messages of
        # *every* client's subscriptions); a stage must never take status
        # JSON for a frame, so drop what we never subscribed to. A topic equal to a
        # filter matches it: a string compare first, since aiomqtt's `matches` took
        # 30 us a message on a loaded 2-core box.
        name = message.topic.value
        return (any(name == topic for topic, _ in self.subscriptions)
                or any(message.topic.matches(topic) for topic, _ in self.subscriptions))

    async def _on_connect(self, client: aiomqtt.Client) -> None:
        for topic, qos in self.subscriptions:
            await client.subscribe(topic, qos)
        if self.presence is not None:
            self._announced = client
            await client.publish(self.presence.topic, self.presence.online(), qos=1, retain=True)
        self._client = client
        self._lost = asyncio.Event()
        self._connected.set()
        log.info("connected to %s:%d as %s", self.endpoint.host, self.endpoint.port,
                 self.client_id)
        for callback in self.on_connect:
            callback()

    async def wait_connected(self, timeout: float | None = None) -> None:
        async with asyncio.timeout(timeout):
            await self._connected.wait()

    async def publish(self, topic: str, payload: bytes | str, *, qos: int = 1,
                      retain: bool = False, properties: Properties | None = None) -> None:
        """Publish, waiting up to PUBLISH_WAIT_S for a dropped connection to return."""
        for _ in range(3):
            try:
                async with asyncio.timeout(PUBLISH_WAIT_S):
                    await self._connected.wait()
            except TimeoutError:
                break
            client = self._client
            if client is None:
                continue
            try:
                if await self._acked(client.publish(topic, payload, qos=qos, retain=retain,
                                                    properties=properties if self.mqtt5 else None)):
                    return
                log.warning("connection lost before the broker acknowledged a publish to %s; "
                            "sending it again once reconnected", topic)
            except aiomqtt.MqttError as exc:
                log.warning("publish to %s failed (%s); waiting for reconnect", topic, exc)
                await asyncio.sleep(RECONNECT_INITIAL_S)
        raise BusError(f"could not publish to {topic}: no broker connection for "
                       f"{PUBLISH_WAIT_S:.0f} s")

    async def _acked(self, publishing: Coroutine[Any, Any, None]) -> bool:
        """Await `publishing`; False as soon as its connection is lost. Each connection has
        a paho client of its own, so a PUBACK (or, at QoS 0, the write) awaited on a lost
        one never comes: aiomqtt would wait out its 10 s timeout after every broker restart."""
        lost = self._lost
        sent = asyncio.ensure_future(publishing)
        losing = asyncio.ensure_future(lost.wait())
        await asyncio.wait([sent, losing], return_when=asyncio.FIRST_COMPLETED)
        losing.cancel()
        if sent.done():
            sent.result()
            return True
        sent.cancel()
        # Its outcome no longer matters; retrieved so that asyncio does not report it.
        sent.add_done_callback(lambda task: task.cancelled() or task.exception())
        return False

    def send(self, topic: str, payload: bytes | str, *, qos: int = 1,
             properties: Properties | None = None) -> None:
        """Publish now, without waiting for the PUBACK; messages leave in call order.

        aiomqtt's `publish` hands the message to paho and then waits for the
        PUBACK, so two publishes awaited in two tasks may leave in either order,
        and a token loop that awaits each one pays a broker round trip per
        message. Handing the message to the paho client directly (what
        aiomqtt's own `publish` does first) keeps the order of the calls, and
        paho still retransmits a QoS 1 message the broker has not acknowledged.
        Without a connection, the message waits for one like `publish`.
        """
        client = self._client
        if client is not None and self._connected.is_set():
            size = len(payload) + QUEUED_MESSAGE_BYTES
            if self.queued_bytes + size > MAX_QUEUED_OUT_BYTES:
                self.unsent += 1
                # Once per doubling: a broker that stopped reading must not flood the log too.
                if self.unsent & (self.unsent - 1) == 0:
                    log.error("not sending to %s: %d bytes wait for the broker's "
                              "acknowledgement (%d messages refused so far); the broker is "
                              "not reading", topic, self.queued_bytes, self.unsent)
                return
            paho_client = client._client  # the paho client under aiomqtt
            info = paho_client.publish(topic, payload, qos, False,
                                       properties if self.mqtt5 else None)
            if info.rc == paho.MQTT_ERR_SUCCESS:
                if not info.is_published():  # QoS 0 is done at once, in publish itself
                    self._queued[info.mid] = size
                    self.queued_bytes += size
                # Onto the socket now rather than at the loop's next turn (two turns through
                # aiomqtt's writer: 0.2 ms a message on a loaded 2-core box), and before a
                # stage's next forward pass holds the loop. Never inside a paho callback:
                # paho's QoS 0 completion there would take a lock its caller holds.
                if _on_loop(client) and not paho_client._in_callback_mutex.locked():
                    _write_now(client)
                return
        if len(self._sending) >= MAX_WAITING_SENDS:
            self.unsent += 1
            log.error("not sending to %s: %d messages already wait for the broker connection "
                      "(%d refused so far); the agents replay what they carried once it is "
                      "back", topic, len(self._sending), self.unsent)
            return
        task = asyncio.ensure_future(self.publish(topic, payload, qos=qos, properties=properties))
        self._sending.add(task)
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._sending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("%s", task.exception())

    async def refresh_presence(self) -> None:
        """Republish the retained online status (fresh timestamp and metrics), if connected."""
        client = self._client
        if self.presence is None or client is None:
            return
        try:
            # Not held up by a connection that is gone: the next heartbeat goes on the new one.
            await self._acked(client.publish(self.presence.topic, self.presence.online(), qos=0,
                                             retain=True))
        except aiomqtt.MqttError as exc:
            log.debug("status refresh skipped (%s)", exc)

    async def announce_offline(self) -> None:
        """Publish the retained offline status; call before a clean exit."""
        client = self._client or self._announced
        if self.presence is None or client is None:
            return
        try:
            await client.publish(self.presence.topic, self.presence.offline(), qos=1,
                                 retain=True, timeout=CLOSE_TIMEOUT_S)
        except aiomqtt.MqttError as exc:
            log.warning("could not publish offline status (%s); the Will covers it", exc)


def _closed_before_connack(client: aiomqtt.Client, on_disconnect: Callable[..., None],
                           *args: Any) -> None:
    """A TLS connection the broker closes before its CONNACK ends the wait for the CONNACK.

    A broker that refuses a client's certificate under TLS 1.3 does so after the handshake;
    the embedded broker (asyncio's TLS) then closes the connection without an alert, and
    aiomqtt, ignoring a disconnect before the CONNACK, would wait out its whole timeout and
    say only that it timed out. `BusClient.run` counts such closes (TLS_CLOSES_FATAL)."""
    if not client._connected.done():
        client._connected.set_exception(aiomqtt.MqttError(tls.CLOSED_BEFORE_CONNACK))
    on_disconnect(*args)


def _tls_refusal(exc: BaseException, endpoint: BrokerEndpoint) -> str | None:
    """A TLS failure somewhere in `exc`'s chain (aiomqtt keeps only its text at connect, the
    exception itself when the broker's alert comes after the handshake), said in one line."""
    if not endpoint.tls:
        return None
    seen: BaseException | None = exc
    while seen is not None:
        said = tls.explain(seen, endpoint)
        if said is not None:
            return said
        seen = seen.__cause__ or seen.__context__
    return None


def _on_loop(client: aiomqtt.Client) -> bool:
    """Whether this runs on the event loop thread of `client`."""
    try:
        return asyncio.get_running_loop() is client._loop
    except RuntimeError:
        return False


def _write_or_disconnect(client: aiomqtt.Client) -> None:
    """Write what paho holds for the socket; a failed write ends the connection, as in
    aiomqtt's own writer."""
    try:
        client._client.loop_write()
    except Exception as exc:
        if not client._disconnected.done():
            client._disconnected.set_exception(exc)


def _write_now(client: aiomqtt.Client) -> None:
    """Write what paho holds for the socket; watch the socket for writability only while
    some of it is left (a full send buffer, or TLS wanting to read first). paho removes
    that writer once it has written the rest."""
    paho_client = client._client
    if not paho_client.want_write():
        return
    _write_or_disconnect(client)
    sock = paho_client.socket()
    if paho_client.want_write() and sock is not None:
        client._loop.add_writer(sock.fileno(), _write_or_disconnect, client)


def _handled(ack: Ack, topic: str, task: asyncio.Task[None]) -> None:
    """A taken message's task ended: acknowledge the message (if it was not already)."""
    if not task.cancelled() and (error := task.exception()) is not None:
        log.error("handling a message on %s failed", topic, exc_info=error)
    ack()


@dataclass(eq=False)
class Ack:
    """Acknowledges one received message, once, on the connection it came in on. Made by
    BusClient._dispatch for every message; a no-op (qos 0) for a QoS 0 message, and for
    every message of a client without manual_ack, which paho acknowledges itself."""

    bus: BusClient
    client: aiomqtt.Client
    mid: int
    qos: int
    taken: bool = False  # the handler took it into a task (BusClient.take)
    done: bool = False

    def __call__(self) -> None:
        if self.done or self.qos == 0:
            return
        self.done = True
        self.bus._holding.discard(self)
        # A message id is the connection's: another connection may use it for another message.
        if self.client is self.bus._client:
            self.client._client.ack(self.mid, self.qos)
