"""Routes over the stages' replica nodes, and failover when a node of a route goes.

A stage may have several replica nodes; each request runs down one route (one
node per stage) and stays there, because its KV caches live on those nodes.
When a node of its route dies (its Will, a clean offline, or no heartbeat for
liveness.timeout_s) or starts a new MQTT session (frames sent to it may be
lost), the request is marked lost, and the token loop replays it down a healthy
route under a new route epoch.

A route runs only through nodes that speak this coordinator's frame version, as
their statuses say: while a plant is upgraded box by box, a node of a release
whose frames the others would refuse is left out, and a request that has no
such route waits for one, then is answered `unavailable` naming both releases
(docs/upgrades.md).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from edgebus.core import frames, versions
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
    # Positions of one request it verifies in one call (its engine's, in its status).
    exact_rows: int = 1
    release: str = "?"  # its edgebus release, and the frame version it speaks
    frame_version: int = versions.UNSAID_FRAME_VERSION

    @property
    def speaks(self) -> str:
        return f"edgebus {self.release}, frame version {self.frame_version}"


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

        A stage with no live node that speaks this coordinator's frames is no reason to
        wait there: `gen` starts, and its first step waits for a node (route) and says
        which is missing.
        """
        picked = self._pick(gen)
        if isinstance(picked, tuple):
            self._assign(gen, picked)
            return True
        return not all(any(self._usable(n) for n in stage.node_ids) for stage in self.pipeline)

    def _usable(self, node_id: str) -> bool:
        """Whether a route may run through `node_id`: alive, and speaking our frames."""
        node = self.health[node_id]
        return node.alive and node.frame_version == frames.VERSION

    def _pick(self, gen: Generation) -> tuple[tuple[int, ...], str | None] | str:
        """The least loaded live route with KV room for `gen`, and the one edgebus release
        its nodes run (None: they run several, no release having a node with room at every
        stage), or why there is no route.

        Releases may compute differently (0.2.0's llama.cpp stages use flash attention,
        0.1.0's did not), so a route that mixes them answers what no plant of one release
        does. Preferred: the release the request ran on before (a replay), then this
        coordinator's, then the newest; old nodes then drain as their requests end.
        """
        room: list[list[int]] = []
        for stage in self.pipeline:
            alive = [r for r, n in enumerate(stage.node_ids) if self.health[n].alive]
            if not alive:
                return (f"stage {stage.index} (layers {list(stage.layers)}) has no live node: "
                        f"{', '.join(stage.node_ids)} offline. Start a node of it "
                        "(`systemctl start edgebus-node@NODE` on its box, or `edgebus node "
                        "PLANT --id NODE`) or check its box (`journalctl -u 'edgebus-*'`)")
            live = [r for r in alive if self._usable(stage.node_ids[r])]
            if not live:
                return self._no_common_version(stage, alive)
            fits = [r for r in live if self.health[node := stage.node_ids[r]].held
                    + self.kv[node].need(gen.max_len) <= self.kv[node].budget]
            if not fits:
                return (f"the live nodes of stage {stage.index} have no KV budget left: "
                        "retry later, or raise their kv_budget_mb")
            room.append(fits)
        releases = {self.health[stage.node_ids[r]].release
                    for stage, fits in zip(self.pipeline, room, strict=True) for r in fits}
        preferred = [gen.release, versions.EDGEBUS,
                     *sorted(releases, key=versions.release_key, reverse=True)]
        for release in dict.fromkeys(r for r in preferred if r in releases):
            chain = [[r for r in fits if self.health[stage.node_ids[r]].release == release]
                     for stage, fits in zip(self.pipeline, room, strict=True)]
            if all(chain):
                return self._least_held(chain), release
        return self._least_held(room), None

    def _least_held(self, choices: list[list[int]]) -> tuple[int, ...]:
        """Of each stage's `choices`, the node with the least KV reserved."""
        route = []
        for stage, fits in zip(self.pipeline, choices, strict=True):
            held = {r: self.health[stage.node_ids[r]].held for r in fits}
            route.append(min(fits, key=held.__getitem__))
        return tuple(route)

    def _no_common_version(self, stage: PipelineStage, alive: list[int]) -> str:
        """Why no live node of `stage` can be on a route: they all speak other frames."""
        nodes = ", ".join(f"{stage.node_ids[r]} runs {self.health[stage.node_ids[r]].speaks}"
                          for r in alive)
        return (f"no live node of stage {stage.index} speaks this coordinator's frames: "
                f"{nodes}; the coordinator runs edgebus {versions.EDGEBUS}, frame version "
                f"{frames.VERSION}. Upgrade in the order docs/upgrades.md gives (standbys, "
                "then the coordinator, then the rest), or roll this box back")

    async def route(self, gen: Generation) -> None:
        """Put `gen` on a live route under a new epoch, waiting a bounded time for one."""
        replay = gen.lost
        self.unroute(gen)
        deadline = time.monotonic() + self.liveness.stage_wait_s
        while isinstance(picked := self._pick(gen), str):
            changed = self._changed
            try:
                async with asyncio.timeout(deadline - time.monotonic()):
                    await changed.wait()
            except TimeoutError:
                raise RequestError("unavailable", f"waited {self.liveness.stage_wait_s:.0f} s: "
                                   f"{picked}") from None
        self._assign(gen, picked)
        if replay is not None:
            self._counters["failovers"] += 1
            self._reporter.report("warning", f"replaying {len(gen.history)} positions of "
                                  f"request {gen.request.id} on {', '.join(gen.nodes)} "
                                  f"({replay})", gen.request.id)

    def _assign(self, gen: Generation, picked: tuple[tuple[int, ...], str | None]) -> None:
        """Put `gen` on the route `_pick` chose under a new epoch, its KV held on the route's
        nodes; say so where the route mixes releases or moves `gen` to another."""
        route, release = picked
        gen.route, gen.epoch, gen.synced, gen.lost = route, gen.epoch + 1, 0, None
        gen.nodes = [stage.nodes[r].node for stage, r in zip(self.pipeline, route, strict=True)]
        for node_id in gen.nodes:
            self.health[node_id].held += self.kv[node_id].need(gen.max_len)
        if release is None:
            self._counters["mixed_routes"] += 1
            runs = ", ".join(f"{n} ({self.health[n].release})" for n in gen.nodes)
            self._reporter.report("warning", f"request {gen.request.id} runs on {runs}:"
                                  " no edgebus release has a node with room at every stage, and "
                                  "releases may compute differently, so its answer may differ "
                                  "token for token from one release's. Finish the upgrade "
                                  "(docs/upgrades.md)", gen.request.id)
        elif gen.release is not None and release != gen.release:
            self._switch_release(gen, release)
        gen.release = release

    def _switch_release(self, gen: Generation, release: str) -> None:
        """`gen` ran on one release and is replayed on `release`, which may compute
        differently: it starts again from its prompt, so its answer is wholly that
        release's, unless it streamed, whose tokens the gateway has already."""
        before = f"request {gen.request.id} ran on edgebus {gen.release}"
        if gen.request.stream:
            self._reporter.report("warning", f"{before} and is replayed on {release}, which "
                                  "may compute differently: it streams, so its tokens from "
                                  "here on are that release's", gen.request.id)
            return
        del gen.history[gen.prompt_len:]
        gen.restarts += 1
        self._counters["restarts"] += 1
        self._reporter.report("warning", f"{before} and starts again from its prompt on "
                              f"{release}, which may compute differently", gen.request.id)

    def exact_rows(self, gen: Generation) -> int:
        """Positions of one request every node of `gen`'s route verifies in one call."""
        return min((self.health[node].exact_rows for node in gen.nodes), default=1)

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
        rows = (status.engine or {}).get("exact_rows", 1)
        node.exact_rows = rows if isinstance(rows, int) and rows >= 1 else 1
        node.release = status.version
        speaks = (versions.UNSAID_FRAME_VERSION if status.frame_version is None
                  else status.frame_version)
        if speaks != node.frame_version:
            node.frame_version = speaks
            self._wake()  # requests waiting for a route of this coordinator's version look
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

