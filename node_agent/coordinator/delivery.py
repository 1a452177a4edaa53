"""Where a request's answers go, and how they leave the coordinator.

Deltas, and answers the gateway may ask for again, are sent without waiting
for PUBACKs: a request's deltas and response leave in order, and the token loop
goes on at once (the next token of every request in a batch leaves in one
message, see node_agent/groups.py). A final answer is waited for until the
broker has it: only then may its request leave the journal.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edgebus.core.client import BusClient
from edgebus.core.errors import BusError
from edgebus.core.messages import GenerateResponse, StreamDelta

log = logging.getLogger(__name__)


@dataclass
class ReplyRoute:
    """Where a request's response goes, and what MQTT 5 correlation data to echo."""

    topic: str
    correlation: bytes | None = None

    @property
    def stream_topic(self) -> str:
        return f"{self.topic}/stream"


class Delivery:
    """Sends requests' deltas and answers on the coordinator's bus."""

    def __init__(self, bus: BusClient) -> None:
        self.bus = bus

    def stream(self, reply: ReplyRoute, request_id: str, index: int, delta: str) -> None:
        msg = StreamDelta(id=request_id, index=index, delta=delta)
        self.bus.send(reply.stream_topic, msg.model_dump_json(),
                      properties=_correlation(reply))

    def respond(self, reply: ReplyRoute, response: GenerateResponse) -> None:
        self.bus.send(reply.topic, response.model_dump_json(), properties=_correlation(reply))

    async def deliver(self, reply: ReplyRoute, response: GenerateResponse) -> None:
        """Publish a final answer and wait for the broker's acknowledgement, across outages:
        the request leaves the journal only after this."""
        while True:
            try:
                await self.bus.publish(reply.topic, response.model_dump_json(),
                                       properties=_correlation(reply))
                return
            except BusError as exc:
                log.warning("answer to %s not delivered yet (%s); waiting for the broker",
                            reply.topic, exc)
                await self.bus.wait_connected()


def _correlation(route: ReplyRoute) -> Properties | None:
    if route.correlation is None:
        return None
    props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    props.CorrelationData = route.correlation
    return props
