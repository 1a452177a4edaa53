"""Events on `{root}/events`, at a bounded rate: a flood of bad input must not become a flood.

Every bad frame or request an agent drops is an event. Sent one by one, a
flood of hostile messages would turn into as many publishes (and, awaited, as
many tasks); so an agent publishes at most EVENT_BURST events at once and
EVENTS_PER_S after that. What is held back is counted, never dropped
silently: about a second later one summary event says how many
(`held_back`), and each is logged at DEBUG level.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Literal

from edgebus.core.client import BusClient
from edgebus.core.messages import Event
from edgebus.core.topics import Topics
from node_agent.status_payload import StatusPayload

log = logging.getLogger(__name__)

# Events an agent publishes per second once its burst is spent: a person
# reading the events (or MQTT Explorer) cannot follow more anyway.
EVENTS_PER_S = 10.0
# Events published back to back before the rate applies: a failover's handful
# of joins, leaves and replays goes out whole.
EVENT_BURST = 50

EventKind = Literal["join", "leave", "error", "warning"]


class Reporter:
    """Logs and publishes one agent's events, EVENTS_PER_S at most after a burst."""

    def __init__(self, bus: BusClient, topics: Topics, agent_id: str) -> None:
        self.bus = bus
        self.topics = topics
        self.agent_id = agent_id
        self.held_back = 0  # events counted but not published, since the last one published
        self._tokens = float(EVENT_BURST)
        self._refilled = time.monotonic()
        self._summary: asyncio.TimerHandle | None = None

    def report(self, kind: EventKind, message: str, request_id: str | None = None) -> None:
        """Publish an event now if the rate allows, else count it for the next one."""
        now = time.monotonic()
        self._tokens = min(EVENT_BURST, self._tokens + (now - self._refilled) * EVENTS_PER_S)
        self._refilled = now
        if kind == "error":
            self._remember_error(message)
        if self._tokens < 1:
            log.debug("%s %s (held back): %s", self.agent_id, kind, message)
            self.held_back += 1
            self._schedule_summary()
            return
        self._tokens -= 1
        self._publish(kind, message, request_id)

    def _publish(self, kind: EventKind, message: str, request_id: str | None,
                 held_back: int = 0) -> None:
        log.log(logging.ERROR if kind == "error" else logging.INFO, "%s %s: %s", self.agent_id,
                kind, message)
        event = Event(kind=kind, agent_id=self.agent_id, message=message, request_id=request_id,
                      held_back=held_back)
        self.bus.send(self.topics.events, event.model_dump_json(), qos=0)

    def _remember_error(self, message: str) -> None:
        payload = self.bus.presence.payload if self.bus.presence is not None else None
        if isinstance(payload, StatusPayload):
            payload.last_error = message
            payload.last_error_ts = time.time()

    def _schedule_summary(self) -> None:
        if self._summary is None:
            self._summary = asyncio.get_running_loop().call_later(
                1.0 / EVENTS_PER_S + 1.0, self._flush_summary)

    def _flush_summary(self) -> None:
        self._summary = None
        if self.held_back:
            count, self.held_back = self.held_back, 0
            self._publish("warning", f"{count} events held back by the rate limit "
                          f"({EVENTS_PER_S:.0f}/s); EDGEBUS_LOG=DEBUG logs each", None, count)
