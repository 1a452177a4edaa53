"""Routes over the stages' replica nodes, and failover when a node of a route goes.

A stage may have several replica nodes; each request runs down one route (one
node per stage) and stays there, because its KV caches live on those nodes.
When a node of its route dies (its Will, a clean offline, or no heartbeat for
liveness.timeout_s) or starts a new MQTT session (frames sent to it may be
lost), the request is marked lost, and the token loop replays it down a healthy
route under a new route epoch.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from edgebus.core import frames
from edgebus.core.errors import RequestError
from edgebus.core.messages import AgentStatus
from node_agent.coordinator.generation import Generation
from node_agent.engines import KvReservation
from node_agent.groups import Outbox
from node_agent.reporter import Reporter
from plant_config import Liveness, PipelineStage


@dataclass
class NodeHealth:
    """What the coordinator knows of one stage node, from its status messages."""

    alive: bool = False
    seen: float = 0.0  # time.monotonic() of its last sign of life
    session: tuple[str, int, int] | None = None  # (host, pid, bdseq) of its MQTT session
    held: int = 0  # KV bytes reserved by requests routed through it
    # What 1, 2, ... positions of one request cost it in one call against one position's,
    # as many as it verifies in one call (its engine's `exact_rows` and `row_cost_k`).
    row_costs: tuple[float, ...] = (1.0,)


class Routes:
    """The stage nodes' health and KV load, and the routes of the requests in flight."""

    def __init__(self, pipeline: list[PipelineStage], kv: dict[str, KvReservation],
                 liveness: Liveness, *, active: dict[int, Generation], outbox: Outbox,
                 ready: asyncio.Event, reporter: Reporter,
                 counters: dict[str, float]) -> None:
        """`kv`: every stage node's KV reservation; `active`: the requests in flight, by
        seq; `ready` is set while every stage has a live node."""
        self.pipeline = pipeline
        self.kv = kv
        self.liveness = liveness
        self.health = {node: NodeHealth() for node in kv}
        self._active = active
        self._outbox = outbox
        self._ready = ready
        self._changed = asyncio.Event()  # replaced on every change of `health`
        self._reporter = reporter
        self._counters = counters

    def check_fits(self, gen: Generation) -> None:
        """Refuse a request too long for the KV budget of every node of a stage."""
        for stage in self.pipeline:
            needs = [self.kv[n].need(gen.max_len) for n in stage.node_ids]
            if all(need > self.kv[n].budget for n, need in zip(stage.node_ids, needs,
                                                                strict=True)):
                raise RequestError("too_long", f"{gen.max_len} positions need "
                                   f"{min(needs) / 2**20:.1f} MiB of KV cache on stage "
                                   f"{stage.index}, more than its nodes' kv_budget_mb: lower "
                                   "max_tokens or the prompt")

    def claim(self, gen: Generation) -> bool:
        """Route `gen` now if its KV fits on live nodes, holding it; False while the
        requests in flight hold too much of it (it waits in the waiting room).

        A stage with no live node is no reason to wait there: `gen` starts, and its
        first step waits for a node (route) and says which is missing.
        """
        route = self._pick(gen)
        if isinstance(route, tuple):
            self._assign(gen, route)
            return True
        return not all(any(self.health[n].alive for n in stage.node_ids)
                       for stage in self.pipeline)

    def _pick(self, gen: Generation) -> tuple[int, ...] | str:
        """The least loaded live route with KV room for `gen`, or why there is none."""
        route: list[int] = []
        for stage in self.pipeline:
            live = [r for r, n in enumerate(stage.node_ids) if self.health[n].alive]
            if not live:
                return (f"stage {stage.index} (layers {list(stage.layers)}) has no live node: "
                        f"{', '.join(stage.node_ids)} offline. Start a node of it (`edgebus "
                        "node PLANT --id NODE`) or check its box")
            room = [r for r in live if self.health[node := stage.node_ids[r]].held
                    + self.kv[node].need(gen.max_len) <= self.kv[node].budget]
            if not room:
                return (f"the live nodes of stage {stage.index} have no KV budget left: "
                        "retry later, or raise their kv_budget_mb")
            route.append(min(room, key=lambda r: self.health[stage.node_ids[r]].held))
        return tuple(route)

    async def route(self, gen: Generation) -> None:
        """Put `gen` on a live route under a new epoch, waiting a bounded time for one."""
        replay = gen.lost
        self.unroute(gen)
        deadline = time.monotonic() + self.liveness.stage_wait_s
        while isinstance(route := self._pick(gen), str):
            changed = self._changed
            try:
                async with asyncio.timeout(deadline - time.monotonic()):
                    await changed.wait()
            except TimeoutError:
                raise RequestError("unavailable", f"waited {self.liveness.stage_wait_s:.0f} s: "
                                   f"{route}") from None
        self._assign(gen, route)
        if replay is not None:
            self._counters["failovers"] += 1
            self._reporter.report("warning", f"replaying {len(gen.history)} positions of "
                                  f"request {gen.request.id} on {', '.join(gen.nodes)} "
                                  f"({replay})", gen.request.id)

    def _assign(self, gen: Generation, route: tuple[int, ...]) -> None:
        """Put `gen` on `route` under a new epoch, its KV held on the route's nodes."""
        gen.route, gen.epoch, gen.synced, gen.lost = route, gen.epoch + 1, 0, None
        gen.nodes = [stage.nodes[r].node for stage, r in zip(self.pipeline, route, strict=True)]
        for node_id in gen.nodes:
            self.health[node_id].held += self.kv[node_id].need(gen.max_len)

    def row_costs(self, gen: Generation) -> tuple[float, ...]:
        """What 1, 2, ... positions of one request in one call cost against one position,
        as many as every node of `gen`'s route verifies in one call: at each count, the
        dearest node's (the step a frame waits for)."""
        costs = [self.health[node].row_costs for node in gen.nodes] or [(1.0,)]
        return tuple(max(c[k] for c in costs) for k in range(min(len(c) for c in costs)))

    def unroute(self, gen: Generation) -> None:
        """Give back `gen`'s KV reservations and let its route's nodes free the caches."""
        self._outbox.leave(gen.seq)
        if not gen.route:
            return
        release = frames.encode_release(gen.header())
        for node_id in gen.nodes:
            self.health[node_id].held -= self.kv[node_id].need(gen.max_len)
            self._outbox.send(node_id, release)
        gen.route, gen.nodes = (), []
        self._wake()

    # -- liveness ------------------------------------------------------------------

    def on_status(self, node_id: str, status: AgentStatus, *, retained: bool) -> None:
        """The status of stage node `node_id`, read and checked to be its own."""
        node = self.health[node_id]
        now = time.monotonic()
        # A retained status may be old: it is as fresh as its timestamp says.
        age = max(0.0, time.time() - status.ts) if retained else 0.0
        session = (status.host, status.pid, status.bdseq)
        if status.state == "offline":
            # A Will delivered late, after the node's next birth, is about a
            # session already replaced: bdseq only grows (Sparkplug's bdSeq).
            if node.session is None or status.bdseq >= node.session[2]:
                self._set_alive(node_id, False, "went offline")
            return
        if now - age > node.seen:
            node.seen = now - age
        if node.session is not None and session != node.session:
            # A new MQTT session: its subscription lapsed in between, so frames
            # sent to it meanwhile are gone; a new process has no caches at all.
            self._fail_over(node_id, "reconnected")
        node.session = session
        # What it says bounds only the frames sent to it: a stage verifies exactly whatever
        # it is sent (stage.py), so a status that says too much costs speed, never a token.
        node.row_costs = _row_costs(status.engine or {})
        self._set_alive(node_id, now - node.seen < self.liveness.timeout_s, "is stale")

    async def watch_heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.liveness.heartbeat_s / 2)
            now = time.monotonic()
            for node_id, node in self.health.items():
                if node.alive and now - node.seen > self.liveness.timeout_s:
                    self._set_alive(node_id, False, f"sent no heartbeat for "
                                                    f"{now - node.seen:.1f} s")

    def _set_alive(self, node_id: str, alive: bool, why: str) -> None:
        node = self.health[node_id]
        if node.alive == alive:
            return
        node.alive = alive
        self._reporter.report("join" if alive else "leave",
                              f"stage node {node_id} {'is online' if alive else why}")
        if not alive:
            self._fail_over(node_id, why)
        if all(any(self.health[n].alive for n in stage.node_ids) for stage in self.pipeline):
            self._ready.set()
        else:
            self._ready.clear()
        self._wake()

    def _wake(self) -> None:
        """Requests waiting for a route look again: a node came or went, or KV room freed."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _fail_over(self, node_id: str, why: str) -> None:
        """Replay every request whose route runs through `node_id`."""
        for gen in self._active.values():
            if node_id in gen.nodes:
                gen.lose(f"node {node_id} {why}")


def _row_costs(engine: dict[str, str | int | float]) -> tuple[float, ...]:
    """A stage's `row_costs` from its status's engine: 1 position, then `row_cost_k` for
    k = 2 to its `exact_rows` while they are numbers of at least the one before."""
    rows = engine.get("exact_rows", 1)
    costs = [1.0]
    for k in range(2, rows + 1 if isinstance(rows, int) else 2):
        cost = engine.get(f"row_cost_{k}")
        if not isinstance(cost, int | float) or cost < costs[-1]:
            break
        costs.append(float(cost))
    return tuple(costs)
