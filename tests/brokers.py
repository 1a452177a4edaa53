"""Real MQTT brokers for integration tests: amqtt in a thread, Mosquitto as a subprocess.

Both kinds hide behind `BrokerHandle` (host, port, kind, mqtt5, start, stop),
so a test parametrized over brokers does not care which one it talks to.
`stop()` then `start()` restarts a broker on the same port, as a plant's broker
restarts under its clients.
"""

from __future__ import annotations

import asyncio
import threading
from abc import ABC, abstractmethod
from typing import Any

from amqtt.mqtt.constants import QOS_1
from amqtt.mqtt.puback import PubackPacket
from amqtt.mqtt.publish import PublishPacket
from amqtt.plugins.base import BasePlugin
from amqtt.session import Session

from broker.embedded import EmbeddedBroker
from broker.mosquitto import INSTALL_HINT as MOSQUITTO_INSTALL_HINT
from broker.mosquitto import MosquittoProcess, mosquitto_binary
from edgebus.core.processes import LOOPBACK, free_port
from plant_config.broker_section import BrokerTls

# amqtt listens within ~25 ms here; the margin is for a loaded CI box.
_START_TIMEOUT_S = 10.0
# It stops in ~0.1 s; margin as above.
_STOP_TIMEOUT_S = 5.0

__all__ = ["MOSQUITTO_INSTALL_HINT", "AmqttBroker", "BrokerHandle", "MosquittoBroker",
           "PubackLedger", "free_port", "mosquitto_binary"]


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

    def __init__(self, plugins: dict[str, dict[str, object]] | None = None,
                 tls: BrokerTls | None = None) -> None:
        self.port = 0  # the first start picks a free port; restarts reuse it
        self.plugins = plugins  # as EmbeddedBroker takes them; None: admit everyone
        self.tls = tls  # as EmbeddedBroker takes it; None: plain MQTT
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._embedded: EmbeddedBroker | None = None

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
                async with EmbeddedBroker(self.host, self.port, self.plugins,
                                          self.tls) as broker:
                    self.port = broker.port
                    self._embedded = broker
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

    def plugin(self, name: str) -> Any:
        """The running broker's plugin of class `name` (one of `plugins`)."""
        assert self._embedded is not None and self._embedded._broker is not None, "not running"
        return self._embedded._broker.plugins_manager.get_plugin(name)

    def stop(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        assert self._loop is not None and self._stop_event is not None
        self._loop.call_soon_threadsafe(self._stop_event.set)
        thread.join(_STOP_TIMEOUT_S)
        if thread.is_alive():
            raise RuntimeError(f"amqtt did not shut down within {_STOP_TIMEOUT_S} s")


class PubackLedger(BasePlugin):  # type: ignore[misc]  # amqtt is untyped
    """amqtt plugin: the QoS 1 PUBLISHes the broker sent each client that it has not
    acknowledged yet. amqtt's own session forgets a delivery 5 s after sending it
    unacknowledged (its PUBACK timeout), so only the packets themselves can tell."""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self._lock = threading.Lock()  # the test reads from its own thread
        self._waiting: dict[str, set[int]] = {}  # client id: message ids

    async def on_mqtt_packet_sent(self, *, packet: Any, session: Session | None) -> None:
        if isinstance(packet, PublishPacket) and packet.qos == QOS_1 and session is not None:
            with self._lock:
                self._waiting.setdefault(session.client_id, set()).add(packet.packet_id)

    async def on_mqtt_packet_received(self, *, packet: Any, session: Session | None) -> None:
        if isinstance(packet, PubackPacket) and session is not None:
            with self._lock:
                self._waiting.get(session.client_id, set()).discard(packet.packet_id)

    async def on_broker_client_connected(self, *, client_id: str,
                                         client_session: Session) -> None:
        if client_session.clean_session:  # what the last connection held is gone with it
            with self._lock:
                self._waiting.pop(client_id, None)

    def unacknowledged(self, client_id: str) -> int:
        with self._lock:
            return len(self._waiting.get(client_id, ()))


class MosquittoBroker(MosquittoProcess, BrokerHandle):
    """`broker.mosquitto.MosquittoProcess` (what the bench uses) as a test's BrokerHandle."""

    kind = "mosquitto"

    @property
    def mqtt5(self) -> bool:
        return True
