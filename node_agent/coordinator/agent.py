"""The coordinator agent: its rooms wired to the plant's bus, and `edgebus coordinator PLANT`."""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiomqtt

from edgebus.core import frames
from edgebus.core.client import BusClient
from edgebus.core.errors import EdgebusError
from edgebus.core.statuses import Role, StatusReader
from edgebus.core.topics import check_level
from node_agent.coordinator.delivery import Delivery
from node_agent.coordinator.drafting import Drafting
from node_agent.coordinator.generation import Generation
from node_agent.coordinator.intake import Intake
from node_agent.coordinator.peers import Peers
from node_agent.coordinator.routing import Routes
from node_agent.coordinator.token_loop import TokenLoop
from node_agent.engines import kv_reservation
from node_agent.groups import Outbox
from node_agent.journal import Journal, JournalLock, default_directory
from node_agent.model_config import generation_eos, load_config
from node_agent.reporter import Reporter
from node_agent.runtime import presence, publish_plan, run_agent, serve_until, sparkplug_node
from node_agent.text import load_tokenizer
from plant_config import Plant
from plant_config.schema import resolve_engine

if TYPE_CHECKING:
    from node_agent.text import Tokenizer

# Environment variable naming this coordinator's instance when several run at once.
INSTANCE_ENV = "EDGEBUS_INSTANCE"


class Coordinator:
    """Serves gateway requests through the plant's stages."""

    def __init__(self, plant: Plant, tokenizer: Tokenizer | None = None, *,
                 batch_groups: int | None = None, instance: str | None = None,
                 journal_dir: Path | None = None) -> None:
        self.plant = plant
        self.spec = plant.coordinator
        self.topics = plant.topics
        pipeline = plant.pipeline
        self.agent_id = self.spec.id if not instance else check_level(
            f"{self.spec.id}.{instance}", "coordinator instance")
        mqtt5 = plant.endpoint_for(self.spec.id).protocol == "5"
        # Several coordinators (coordinator.instances) take requests from one
        # MQTT 5 shared subscription: the broker hands each request to one of them.
        shared = bool(self.spec.instances)
        if instance and instance not in self.spec.instances:
            raise EdgebusError(
                f"coordinator instance {instance!r} is not in the plant file's "
                f"coordinator.instances {self.spec.instances}: add it there, on every box")
        if shared and not mqtt5:
            raise EdgebusError(
                f"coordinator.instances {self.spec.instances}: several coordinators share the "
                "requests through an MQTT 5 shared subscription, and this plant's broker speaks "
                "MQTT 3.1.1 (the embedded amqtt broker does). Run one coordinator, or use "
                'Mosquitto with broker.protocol: "5"')
        # A lone coordinator keeps a plain subscription: Mosquitto 2.0 restores it
        # from its database after a restart, a shared one it does not (measured).
        request_filter = (f"$share/{plant.plant_id}-{self.spec.id}/"
                          f"{self.topics.request_filter}" if shared
                          else self.topics.request_filter)
        # A plant all on llama.cpp may run on boxes without transformers (docs/deploy.md).
        llamacpp_only = all(resolve_engine(spec.engine, spec.weights) == "llamacpp"
                            for spec in plant.stages)
        tokenizer = tokenizer or load_tokenizer(plant.model, transformers=not llamacpp_only)
        eos_ids = _eos_ids(plant, tokenizer)
        config = load_config(plant.model)
        limits = frames.coordinator_limits(vocab=config.vocab_size,
                                           max_in_flight=self.spec.max_in_flight,
                                           stages=len(pipeline))
        kv = {spec.node: kv_reservation(plant, spec.node, config) for spec in plant.stages}
        self._ready = asyncio.Event()  # every stage has a live node
        self._active: dict[int, Generation] = {}  # the requests in flight, by seq
        # Every task this agent starts: at most max_in_flight requests being served and
        # max_queue waiting for a slot, the broker's in-flight window of requests being
        # admitted (they are acknowledged only once journaled or answered), and a few of
        # its own.
        self._tasks: set[asyncio.Task[None]] = set()
        outbox = Outbox(batch_groups or len(pipeline), self._publish_frames,
                        self._stepping, max_frames=limits.max_frames)
        journal = Journal(journal_dir or default_directory(
            plant.plant_id, plant.topic_root, self.agent_id))
        self._journal_lock = JournalLock(journal.directory)
        self._journal_lock.acquire()  # released when serve() ends
        self._resume = journal.open()  # what a previous run left unanswered
        self.counters = {"tokens": 0.0, "requests_done": 0.0, "failovers": 0.0,
                         "recoveries": 0.0, "resumed": 0.0, "drained": 0.0, "cancelled": 0.0,
                         "drafts_proposed": 0.0, "drafts_accepted": 0.0,
                         "drafts_rejected": 0.0, "drafts_from_cache": 0.0,
                         "draft_runs": 0.0}
        self.bus = BusClient(
            plant.endpoint_for(self.spec.id), f"{plant.plant_id}.{self.agent_id}",
            # Cancels are not shared: every coordinator hears them, the one serving acts.
            subscriptions=[(request_filter, 1), (self.topics.status_filter, 1),
                           (self.topics.activations(self.spec.id), 1),
                           (self.topics.cancel_filter, 1)],
            presence=presence(self.topics, self.agent_id, "coordinator", metrics=lambda: {
                **self.counters, "in_flight": float(len(self._active)),
                # The waiting room (an alarm storm): requests waiting for a slot, and how
                # long the first of them has waited.
                "queue": float(len(self.intake.room)),
                "oldest_wait_s": round(self.intake.room.oldest_wait_s(), 1),
                "statuses_dropped": float(self._statuses.dropped),
                **self.bus.metrics()}),
            # Requests published while the coordinator is down wait in the broker,
            # and one is acknowledged only once it is journaled (or answered).
            persistent=True, manual_ack=True, on_connect=[self._on_connect])
        reporter = Reporter(self.bus, self.topics, self.agent_id)
        self._statuses = StatusReader(functools.partial(reporter.report, "warning"))
        delivery = Delivery(self.bus)
        self.routes = Routes(pipeline, kv, plant.liveness, active=self._active,
                             outbox=outbox, ready=self._ready, reporter=reporter,
                             counters=self.counters)
        drafting = Drafting(self.spec.speculation, active=self._active, outbox=outbox,
                            publish=self._publish_frames, counters=self.counters)
        self.tokens = TokenLoop(
            self.spec, tokenizer, eos_ids, limits,
            # See TokenLoop._feed_sizes: replays on llama.cpp group positions as first fed.
            replay_as_fed=any(resolve_engine(spec.engine, spec.weights) == "llamacpp"
                              for spec in plant.stages),
            active=self._active, outbox=outbox, routes=self.routes, drafting=drafting,
            delivery=delivery, reporter=reporter, counters=self.counters)
        self.intake = Intake(plant, tokenizer, config.vocab_size, journal=journal,
                             bus=self.bus, delivery=delivery, routes=self.routes,
                             tokens=self.tokens, drafting=drafting, active=self._active,
                             reporter=reporter, counters=self.counters, track=self._track)
        self.peers = Peers(plant, self.agent_id, request_filter,
                           on_request=self.intake.on_request, reporter=reporter,
                           counters=self.counters)

    async def serve(self, stop: asyncio.Event) -> None:
        # First, so redeliveries of these find them in flight.
        self.intake.resume(self._resume)
        self._resume = []
        try:
            await serve_until(stop, self.bus, self._on_message, self.routes.watch_heartbeats(),
                              *sparkplug_node(self.plant, self.agent_id, self.bus,
                                              identity=self.spec.id, health=self.routes.health),
                              heartbeat_s=self.plant.liveness.heartbeat_s)
        finally:
            for task in list(self._tasks):
                task.cancel()
            self.peers.stop()
            self.tokens.close()
            self.intake.close()
            self._journal_lock.release()

    # -- dispatch (event loop, must not block) -----------------------------------

    def _on_message(self, message: aiomqtt.Message) -> None:
        topic = message.topic.value
        payload = message.payload if isinstance(message.payload, bytes) else b""
        if topic == self.topics.activations(self.spec.id):
            self.tokens.on_result(payload)
        elif self.topics.client_of_request_topic(topic) is not None:
            self.intake.on_request(message, self.bus)
        elif (client := self.topics.client_of_cancel_topic(topic)) is not None:
            self.intake.on_cancel(client, payload)
        elif (agent := self.topics.agent_of_status_topic(topic)) is not None:
            self._on_status(agent, payload, retained=bool(message.retain))

    def _on_status(self, agent: str, payload: bytes, *, retained: bool) -> None:
        """The status of `agent`, the agent its topic names: one whose payload names another
        agent or role is dropped (edgebus/core/statuses.py), so an identity speaks only for
        itself."""
        role: Role
        if self.peers.is_coordinator(agent):
            role = "coordinator"
        elif agent in self.routes.health:
            role = "stage"
        else:
            return  # an agent of another plant file
        status = self._statuses.read(agent, payload, role)
        if status is None:
            return
        if role == "coordinator":
            self.peers.on_status(agent, status)
        else:
            self.routes.on_status(agent, status, retained=retained)

    def _on_connect(self) -> None:
        # Every connect, not only the first: a restarted broker may have lost
        # the retained plan.
        self._spawn(publish_plan(self.bus, self.plant))
        # Frames in flight when the connection dropped may be gone (a broker
        # restart loses them): replay every request.
        for gen in self._active.values():
            if gen.route:
                gen.lose("the coordinator reconnected to the broker")

    def _publish_frames(self, node_id: str, message: bytes) -> None:
        self.bus.send(self.topics.activations(node_id), message)

    def _stepping(self, seq: int) -> bool:
        gen = self._active.get(seq)
        return gen is not None and gen.result is not None and not gen.result.done()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        return self._track(asyncio.ensure_future(coro))

    def _track(self, task: asyncio.Task[None]) -> asyncio.Task[None]:
        """Keep `task` among this agent's, cancelled when it stops."""
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _eos_ids(plant: Plant, tokenizer: Tokenizer) -> set[int]:
    """The ids `generate` stops on: generation_config's eos, else the tokenizer's."""
    eos = generation_eos(plant.model)
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())


def run_coordinator(plant: Plant, batch_groups: int | None = None,
                    instance: str | None = None) -> None:
    """`edgebus coordinator PLANT`: serve requests until SIGTERM.

    `instance` (default: $EDGEBUS_INSTANCE) names this coordinator when several
    serve one plant at once: one of the plant file's coordinator.instances. The
    coordinator without one is the plant's first.
    """
    instance = instance or os.environ.get(INSTANCE_ENV) or None

    async def main(stop: asyncio.Event) -> None:
        await Coordinator(plant, batch_groups=batch_groups, instance=instance).serve(stop)

    run_agent(main)
