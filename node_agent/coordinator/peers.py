"""The plant's other coordinators (`coordinator.instances`, MQTT 5), and serving a dead one's
requests.

Several coordinators share the request subscription (`$share/...`); when one
goes offline another serves the requests the broker keeps in the dead one's
session until it is back (docs/failover.md).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass

import aiomqtt

from edgebus.core.client import BusClient
from edgebus.core.messages import AgentStatus
from node_agent.reporter import Reporter
from plant_config import Plant


@dataclass
class Peer:
    """Another coordinator of this plant (MQTT 5 shared subscription), from its status."""

    online: bool
    bdseq: int
    drain: asyncio.Task[None] | None = None  # serving its session while it is offline


class Peers:
    """Tracks the plant's other coordinators; serves a dead one's session until it is back."""

    def __init__(self, plant: Plant, agent_id: str, request_filter: str, *,
                 on_request: Callable[[aiomqtt.Message, BusClient], None],
                 reporter: Reporter, counters: dict[str, float]) -> None:
        """`agent_id`: this coordinator's; `request_filter`: the subscription requests come
        on; `on_request(message, bus)` serves a request that came on `bus`."""
        self.plant = plant
        self.spec = plant.coordinator
        self.topics = plant.topics
        self.agent_id = agent_id
        self.request_filter = request_filter
        self._on_request = on_request
        self._reporter = reporter
        self._counters = counters
        self._peers: dict[str, Peer] = {}

    def stop(self) -> None:
        for peer in self._peers.values():
            if peer.drain is not None:
                peer.drain.cancel()

    def is_coordinator(self, agent: str) -> bool:
        """Whether `agent` is this plant's coordinator or one of its declared instances."""
        instance = agent.removeprefix(f"{self.spec.id}.")
        return agent == self.spec.id or (instance != agent and instance in self.spec.instances)

    def on_status(self, peer_id: str, status: AgentStatus) -> None:
        """The status of coordinator `peer_id`, read and checked to be its own.

        With a shared subscription the broker hands requests to every member's
        session, a dead member's too (Mosquitto 2.0 does: measured), and there
        they would wait for its restart. So when one goes offline (its Will, or
        its clean exit) another takes its session over: it connects with that
        coordinator's client id and serves what the broker holds there. The
        coordinator coming back takes its session back (the broker ends ours).
        """
        if not self.spec.instances or peer_id == self.agent_id:
            return
        peer = self._peers.setdefault(peer_id, Peer(online=False, bdseq=0))
        if status.bdseq < peer.bdseq:
            return  # the late Will of a session already replaced
        peer.bdseq = status.bdseq
        peer.online = status.state == "online"
        if peer.online and peer.drain is not None:
            peer.drain.cancel()
            peer.drain = None
        elif not peer.online and peer.drain is None:
            peer.drain = asyncio.ensure_future(self._drain(peer_id, peer))

    async def _drain(self, peer_id: str, peer: Peer) -> None:
        """Serve the requests the broker holds in `peer_id`'s session while it is offline."""
        while not peer.online:
            self._reporter.report("warning", f"coordinator {peer_id} is offline: "
                                  f"{self.agent_id} serves the requests the broker holds for it")
            drain = BusClient(self.plant.endpoint_for(self.spec.id),
                              f"{self.plant.plant_id}.{peer_id}",
                              subscriptions=[(self.request_filter, 1)], persistent=True,
                              manual_ack=True, reconnect=False)
            await drain.run(functools.partial(self._on_drained, drain=drain))
            # The connection ended: the peer took its session back (its status
            # follows at once), or the broker went away. Look again after a while.
            await asyncio.sleep(self.plant.liveness.timeout_s)
        peer.drain = None

    def _on_drained(self, message: aiomqtt.Message, *, drain: BusClient) -> None:
        if self.topics.client_of_request_topic(message.topic.value) is not None:
            self._counters["drained"] += 1
            self._on_request(message, drain)
