"""An MQTT 3.1.1 broker inside a Python process, built on amqtt.

For a bench, a demo or a small cell that has no Mosquitto: `run_broker_forever`
is the blocking entry point a command or a systemd unit calls, and
`EmbeddedBroker` is the same broker as an async context manager, which tests
and single-box setups start in-process. A plant with a Mosquitto keeps using
it: amqtt speaks MQTT 3.1.1 only and keeps nothing across a restart.

Every client is admitted, without credentials, unless the plant has a
`security:` section: then `broker.amqtt_security` admits only its identities,
each confined to its topics. Admitting everyone, it listens on the loopback
only (`broker.exposure`). With the plant's `security.tls` (what `edgebus init`
writes) it serves TLS only, with the broker certificate of the plant's CA, and
with `require_certificate` it admits only clients presenting a certificate of
that CA (amqtt 0.12.1 alone would let a client without one in).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import ssl
from collections import deque
from types import TracebackType
from typing import Any

from amqtt.adapters import ReaderAdapter, WriterAdapter
from amqtt.broker import Broker
from amqtt.contexts import Action, BrokerConfig, ListenerConfig, ListenerType
from amqtt.errors import AMQTTError, BrokerError, MQTTError
from amqtt.mqtt.connack import NOT_AUTHORIZED, ConnackPacket
from amqtt.mqtt.constants import QOS_1, QOS_2
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.plugins.base import BaseAuthPlugin
from amqtt.session import (
    OUTGOING,
    IncomingApplicationMessage,
    OutgoingApplicationMessage,
    Session,
)
from amqtt.utils import gen_client_id

from broker.exposure import refuse_open_listener
from edgebus.core import sd_notify
from edgebus.core.errors import BusError
from plant_config.broker_section import BrokerTls
from plant_config.certificates import WARN_DAYS, certificate_info

logger = logging.getLogger(__name__)

# amqtt logs every connection at INFO, and `transitions` (its state-machine
# library) logs every session state change at INFO: several lines per client
# connect. An edge box running for months wants warnings only.
_NOISY_LOGGERS = ("amqtt", "transitions")
_NOISY_DEFAULT_LEVEL = logging.WARNING

# amqtt requires its first listener to carry this name; other listeners inherit from it.
_LISTENER_NAME = "default"
# How often a TLS broker looks whether its certificate was renewed (`edgebus certs renew`),
# and loads it for new connections: a plant is renewed without a restart.
CERTIFICATE_POLL_S = 5.0


class AllowAllAuthPlugin(BaseAuthPlugin):  # type: ignore[misc]  # amqtt is untyped: Any to mypy
    """Admits every client, with or without credentials.

    Unlike amqtt's AnonymousAuthPlugin it does not flag sessions anonymous:
    amqtt neither queues QoS 1/2 messages for an offline persistent session
    (clean_session=False) nor keeps that session once the client is gone when
    the flag is set. Without it, a reconnecting agent gets what it missed,
    as with Mosquitto.
    """

    async def authenticate(self, *, session: Session) -> bool:
        return True


# Passing `plugins` explicitly replaces amqtt's defaults, which include the
# $SYS plugin (a status publish every 20 s) and two debug loggers we do not want.
_PLUGINS: dict[str, dict[str, object]] = {f"{__name__}.{AllowAllAuthPlugin.__name__}": {}}


# Used only when the caller has not configured logging: timestamps, because
# the output usually ends up in a journal read days later.
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Handler(BrokerProtocolHandler):  # type: ignore[misc]  # amqtt is untyped: Any to mypy
    """amqtt's connection handler, keeping what a client left unacknowledged for its return
    and re-sending it without holding up that client's next packets.

    A persistent session gets again the QoS 1 messages its client left holding
    unacknowledged (MQTT 3.1.1 section 4.4), as Mosquitto does. amqtt 0.12.1:
    - dropped such a message when the client disconnected (its PUBACK wait cancelled),
      so it was never sent again;
    - awaited the re-sent messages' PUBACKs in `start`, before the broker read the client's
      SUBSCRIBE, and an edgebus client acknowledges a message only once it has subscribed
      to everything (`BusClient.run`): each waited for the other until amqtt's 5 s PUBACK
      timeout. A coordinator that stopped holding a stage's answer came back 5 s late (seen
      in the suite: one plant's coordinator after another's, on one broker).
    """

    async def _handle_qos1_message_flow(
            self, app_message: OutgoingApplicationMessage | IncomingApplicationMessage) -> None:
        try:
            await super()._handle_qos1_message_flow(app_message)
        except asyncio.CancelledError:
            # `stop` cancels the PUBACK wait when the client goes; amqtt's own code has just
            # forgotten the message. A clean session's is deleted with it.
            if app_message.direction == OUTGOING and not self.session.clean_session:
                self.session.inflight_out[app_message.packet_id] = app_message
            raise

    async def _retry_deliveries(self) -> None:
        # Held here, or the task could be collected half-sent.
        self.redelivering = asyncio.ensure_future(super()._retry_deliveries())


class _Broker(Broker):  # type: ignore[misc]  # amqtt is untyped: Any to mypy
    """amqtt's Broker with fixes to how it treats clients (amqtt 0.12.1).

    - A Last Will must be one its client may publish: amqtt publishes Wills
      without the topic ACL it applies to every other publish, so any identity
      could forge an answer, a request, a status or the plan by setting its
      Will there and dropping its connection. Such a Will is dropped at
      CONNECT, with a warning, as Mosquitto 2.0 drops it; the client is still
      admitted, since its Will is no part of what it may do.
    - A CONNECT is authenticated before it touches the session of its client
      id. amqtt deletes that session (a clean session) or hands it the
      newcomer's user name and Will (a persistent one) first, and takes over
      a connected one even when it then refuses the newcomer: any client,
      with a wrong password too, could deafen or drop the coordinator by
      connecting with its client id. A refused client now gets its CONNACK
      "not authorized" and leaves the session table as it was.
    - A message is delivered to every subscriber that held a matching
      subscription when its broadcast began. amqtt walks its subscription
      table while awaiting each receiver's ACL check: a client subscribing or
      leaving meanwhile raised "dictionary changed size during iteration" (12
      `edgebus ask` beside `edgebus status`, security on) and the message was
      lost for every subscriber not yet reached. The walk now runs over a copy
      taken without awaiting, as the CONNECT fix below does.
    - It closes every client socket when its connection handler ends, and
      can close them all at once before a shutdown (see `close_connections`).
    - On CONNECT, amqtt 0.12.1 walks *every* client's subscription filters
      and sends the new client the retained messages matching them, awaiting
      inside the walk: clients get retained messages they never asked for,
      and a client subscribing meanwhile kills the connect with "dictionary
      changed size during iteration" (seen with four agents starting at once;
      the victim waited out aiomqtt's 10 s CONNACK timeout). Retained messages
      now go only to a session that holds the filter, and for the others the
      walk returns without awaiting, so nothing can change under it.
    - Retained messages for a new subscription are sent without holding up the
      client's next packets. amqtt 0.12.1 awaited their QoS 1 PUBACKs before it read
      the client's next SUBSCRIBE, and an edgebus client acknowledges a message only
      once it has subscribed to everything (`BusClient.run`): each waited for the
      other until amqtt's 5 s PUBACK timeout, so every plant on this broker started
      5 s late (its coordinator subscribing to the stages' retained statuses).
      The same for what a persistent session kept while its client was away: amqtt
      awaited those PUBACKs before it read the returning client's SUBSCRIBE, so a
      restarted coordinator came back online 5 s late (the stages' answers to its
      previous process wait in its session). And what its previous process left
      unacknowledged is re-sent alike (`_Handler`).
    """

    async def _publish_session_retained_messages(self, session: Session) -> None:
        # amqtt 0.12.1's sends, not awaited: each PUBLISH leaves in its task, all queued here,
        # in order, ahead of anything broadcast after this CONNECT. Its RETAIN flag is 0, not
        # amqtt's 1: these matched an established subscription while the client was away, and
        # MQTT (3.1.1 section 3.3.1.3) sets RETAIN only for what a new subscription is sent.
        # With amqtt's 1, a request sent while the coordinator was down reached the restarted
        # coordinator as retained, and it refused it ("retained").
        handler = self._get_handler(session)
        while handler is not None and not session.retained_messages.empty():
            held = session.retained_messages.get_nowait()
            sending = asyncio.ensure_future(
                handler.mqtt_publish(held.topic, held.data, held.qos, retain=False))
            self._retained_sends.add(sending)
            sending.add_done_callback(self._retained_sent)

    async def _publish_retained_messages_for_subscription(
            self, subscription: tuple[str, int], session: Session) -> None:
        holders = self._subscriptions.get(subscription[0], ())
        if any(holder is session for holder, _ in holders):
            # The PUBLISHes leave in task order, ahead of later broadcasts' (also tasks).
            sending = asyncio.ensure_future(
                super()._publish_retained_messages_for_subscription(subscription, session))
            self._retained_sends.add(sending)
            sending.add_done_callback(self._retained_sent)

    def _retained_sent(self, sending: asyncio.Future[None]) -> None:
        self._retained_sends.discard(sending)
        if not sending.cancelled() and sending.exception() is not None:
            # A client gone meanwhile: amqtt's own delivery to it would have failed alike.
            logger.warning("a retained message was not delivered: %r", sending.exception())

    async def _authenticate(self, session: Session, listener: ListenerConfig) -> bool:
        admitted: bool = await super()._authenticate(session, listener)
        if admitted and session.will_flag and not await self._topic_filtering(
                session, session.will_topic, Action.PUBLISH):
            logger.warning("dropped the Last Will of client %r (user %r): it may not publish "
                           "to %r", session.client_id, session.username, session.will_topic)
            session.will_flag = False
            session.will_retain = False
            session.will_topic = session.will_message = None
        return admitted

    async def _initialize_client_session(
            self, reader: ReaderAdapter, writer: WriterAdapter, remote_address: str,
            remote_port: int) -> tuple[BrokerProtocolHandler, Session]:
        """amqtt 0.12.1's `_initialize_client_session`, refusing before the session table."""
        try:
            handler, session = await _Handler.init_from_connect(
                reader, writer, self.plugins_manager)
        except MQTTError:
            await writer.close()
            raise
        # amqtt 0.12.1's `_authenticate` ignores the listener, and this broker has one.
        # `_handle_client_session` authenticates again, as amqtt does: the same
        # credentials and client id, so the same answer.
        if not await self._authenticate(session, self.listeners_config[_LISTENER_NAME]):
            await ConnackPacket.build(0, NOT_AUTHORIZED).to_stream(writer)
            await writer.close()
            raise AMQTTError(f"refused client {session.client_id!r} (user {session.username!r}) "
                             f"from {remote_address}:{remote_port}")
        if session.clean_session:
            if session.client_id:
                await self._delete_session(session.client_id)
            else:
                session.client_id = gen_client_id()
            session.parent = 0
        elif session.client_id in self._sessions:
            # The persistent session, with what the new CONNECT brings.
            existing, _ = self._sessions[session.client_id]
            for attribute in ("will_flag", "will_message", "will_topic", "will_qos",
                              "will_retain", "keep_alive", "username", "password"):
                setattr(existing, attribute, getattr(session, attribute))
            session = existing
            session.parent = 1
        else:
            session.parent = 0
        delay = self.config.get("timeout-disconnect-delay", 0)
        if session.keep_alive > 0 and isinstance(delay, int):
            session.keep_alive += delay
        return handler, session

    async def _run_broadcast(self, running_tasks: deque[asyncio.Task[Any]]) -> None:
        """amqtt 0.12.1's `_run_broadcast`, delivering to a copy of the matching subscriptions."""
        broadcast = await self._broadcast_queue.get()
        topic = broadcast["topic"]
        targets = [target for a_filter, subscriptions in self._subscriptions.items()
                   if self._matches(topic, a_filter) for target in subscriptions]
        for session, sub_qos in targets:
            qos = broadcast.get("qos", sub_qos)
            if not await self._topic_filtering(session, topic=topic, action=Action.RECEIVE):
                continue
            connected = session.transitions.state == "connected"
            # As amqtt: a persistent session that is offline keeps QoS 1 and 2
            # messages for its return [MQTT 3.1.2.4]; a connected one gets it now.
            if (not connected and not session.clean_session and qos in (QOS_1, QOS_2)
                    and not session.is_anonymous):
                await self._retain_broadcast_message(broadcast, qos, session)
            elif connected and (handler := self._get_handler(session)):
                running_tasks.append(asyncio.ensure_future(
                    handler.mqtt_publish(topic, broadcast["data"], qos, retain=False)))

    def __init__(self, *args: Any, require_certificate: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.require_certificate = require_certificate
        self.ssl_context: ssl.SSLContext | None = None  # the TLS listener's, once started
        self._writers: set[asyncio.StreamWriter] = set()
        # Retained deliveries in flight: held so that they are not collected half-sent.
        self._retained_sends: set[asyncio.Future[None]] = set()

    def _create_ssl_context(self, listener: ListenerConfig) -> ssl.SSLContext:
        # amqtt 0.12.1 verifies a client certificate only if one is offered (CERT_OPTIONAL):
        # with mutual TLS, a client without one must not get past the handshake.
        context: ssl.SSLContext = Broker._create_ssl_context(listener)
        if self.require_certificate:
            context.verify_mode = ssl.CERT_REQUIRED
        self.ssl_context = context
        return context

    def close_connections(self) -> None:
        """Drop every client connection, as a broker that stops does.

        amqtt 0.12.1's shutdown can wait forever on a connection handler whose
        cancel Python 3.11's `wait_for` swallowed (seen with a persistent
        session connected); with its socket closed, every handler ends on EOF.
        """
        for writer in list(self._writers):
            writer.close()

    async def stream_connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                               listener_name: str) -> None:
        self._writers.add(writer)
        try:
            await super().stream_connected(reader, writer, listener_name=listener_name)
        except Exception as exc:
            # Left to asyncio, this would surface as "Task exception was never
            # retrieved" with a traceback; the broker itself is unaffected.
            logger.warning("MQTT client connection ended with an error: %r", exc)
        finally:
            # amqtt leaves the socket of a failed handshake (a TCP health
            # probe, a truncated CONNECT) open until garbage collection.
            writer.close()
            self._writers.discard(writer)


def _warn_if_expiring(tls: BrokerTls) -> None:
    """Say at start that the broker's certificate has expired, or soon will: every client
    would refuse it (edgebus.core.tls)."""
    days = certificate_info(tls.certfile).days_left()
    if days < 0:
        logger.error("the broker's certificate %s has expired: every client refuses it. "
                     "`edgebus certs renew PLANT` issues a new one from the plant's CA",
                     tls.certfile)
    elif days < WARN_DAYS:
        logger.warning("the broker's certificate %s expires in %d days: `edgebus certs renew "
                       "PLANT` issues a new one from the plant's CA", tls.certfile, days)


def _quiet_amqtt() -> None:
    """Cap amqtt's logging at WARNING unless someone set its loggers' levels on purpose."""
    for name in _NOISY_LOGGERS:
        noisy = logging.getLogger(name)
        if noisy.level == logging.NOTSET:
            noisy.setLevel(_NOISY_DEFAULT_LEVEL)


class EmbeddedBroker:
    """An amqtt broker bound to `host:port` for the duration of an `async with` block.

    `port=0` picks a free port; `.port` holds the bound one once entered.
    Retained messages, Last Will and persistent sessions (QoS 1 messages
    queued for an offline clean_session=False client) work, in memory only.
    Unlike Mosquitto, amqtt delivers at the subscription's QoS even when the
    publisher used a lower one.

    Clients that vanish without a DISCONNECT (killed process, pulled cable,
    a TCP port probe) make amqtt log a warning or an error line; its
    per-connection code catches the failure, so the broker keeps serving.
    Server-side sockets get TCP_NODELAY from asyncio itself (its selector
    transport sets it on every TCP socket, accepted ones included): no Nagle
    delay on small QoS 1 acks, unlike a Mosquitto without `set_tcp_nodelay true`.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 1883,
                 plugins: dict[str, dict[str, object]] | None = None,
                 tls: BrokerTls | None = None) -> None:
        self.host = host
        self.port = port
        self.tls = tls  # None: plain MQTT
        self._watcher: asyncio.Task[None] | None = None
        # None: admit everyone; `broker.amqtt_security.plugins_for(plant)` secures it.
        self.secured = plugins is not None
        self.plugins = _PLUGINS if plugins is None else plugins
        self._broker: Broker | None = None

    async def __aenter__(self) -> EmbeddedBroker:
        refuse_open_listener(self.host, self.port, secured=self.secured,
                             what="the embedded MQTT broker")
        _quiet_amqtt()
        tls = self.tls
        listener = ListenerConfig(type=ListenerType.TCP, bind=f"{self.host}:{self.port}")
        if tls is not None:
            for path in (tls.cafile, tls.certfile, tls.keyfile):
                if not path.is_file():
                    raise BusError(f"the embedded MQTT broker's TLS file {path} is missing "
                                   "(security.tls): `edgebus certs renew PLANT` issues the "
                                   "broker's certificate again from the plant's CA")
            listener = ListenerConfig(type=ListenerType.TCP, bind=f"{self.host}:{self.port}",
                                      ssl=True, cafile=tls.cafile, certfile=tls.certfile,
                                      keyfile=tls.keyfile)
            _warn_if_expiring(tls)
        config = BrokerConfig(listeners={_LISTENER_NAME: listener}, plugins=self.plugins)
        broker = _Broker(config, require_certificate=tls is not None and tls.require_certificate)
        try:
            await broker.start()
        except BrokerError as exc:
            raise BusError(
                f"the embedded MQTT broker cannot listen on {self.host}:{self.port} ({exc}); "
                "another broker (Mosquitto?) may hold the port: stop it or choose another port"
            ) from exc
        self._broker = broker
        self.port = self._bound_port(broker)
        if tls is not None and broker.ssl_context is not None:
            self._watcher = asyncio.create_task(self._reload_renewed(broker.ssl_context, tls))
        return self

    async def _reload_renewed(self, context: ssl.SSLContext, tls: BrokerTls) -> None:
        """Load the certificate into the listener's context, for the connections to come,
        whenever `edgebus certs renew` has replaced it (its file's mtime changed)."""
        def stamp() -> tuple[float, float]:
            return tls.certfile.stat().st_mtime, tls.keyfile.stat().st_mtime

        seen = stamp()
        while True:
            await asyncio.sleep(CERTIFICATE_POLL_S)
            try:
                now = stamp()
                if now != seen:
                    context.load_cert_chain(tls.certfile, tls.keyfile)
                    seen = now
                    logger.info("loaded the renewed certificate %s for new connections",
                                tls.certfile)
            except (OSError, ssl.SSLError) as exc:
                # Half-renewed (the key replaced, the certificate not yet): next time.
                logger.warning("could not load the renewed certificate %s yet: %s",
                               tls.certfile, exc)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        broker, self._broker = self._broker, None
        if self._watcher is not None:
            self._watcher.cancel()
            self._watcher = None
        if broker is not None:
            broker.close_connections()
            await broker.shutdown()

    @staticmethod
    def _bound_port(broker: Broker) -> int:
        # amqtt has no public accessor for the listening socket; `_servers` is
        # its own listener bookkeeping. With port 0 and a host name resolving to
        # several addresses, each socket gets a port of its own: we report the first.
        server = broker._servers[_LISTENER_NAME].instance
        port: int = server.sockets[0].getsockname()[1]
        return port


async def _serve_until_signalled(host: str, port: int,
                                 plugins: dict[str, dict[str, object]] | None,
                                 tls: BrokerTls | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with EmbeddedBroker(host, port, plugins, tls) as broker:
        over = "TLS" + (" (mutual)" if tls.require_certificate else "") if tls else "plain MQTT"
        logger.info("edgebus embedded broker listening on %s:%d (%s)", broker.host, broker.port,
                    over)
        sd_notify.notify("READY=1", f"STATUS=listening on {broker.host}:{broker.port}")
        # The pings prove the event loop, which serves every client, still turns.
        pinger = asyncio.create_task(sd_notify.watchdog(lambda: True))
        await stop.wait()
        pinger.cancel()
        sd_notify.notify("STOPPING=1")
        logger.info("edgebus embedded broker stopping")


def run_broker_forever(host: str, port: int,
                       plugins: dict[str, dict[str, object]] | None = None,
                       tls: BrokerTls | None = None) -> None:
    """Serve MQTT on `host:port` until SIGINT or SIGTERM, then shut down and return.

    `plugins`, `tls`: as `EmbeddedBroker` takes them.
    """
    # A no-op when the caller configured logging already; otherwise the
    # "listening" line would be swallowed by logging's WARNING-only last resort.
    logging.basicConfig(level=logging.INFO, format=_LOG_FORMAT)
    asyncio.run(_serve_until_signalled(host, port, plugins, tls))
