"""One request in flight: what it has generated, and the route its KV caches live on."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass, field

from edgebus.core.frames import Frame, Header
from edgebus.core.messages import GenerateRequest
from node_agent.coordinator.delivery import ReplyRoute
from node_agent.speculation import Drafts


class Lost(Exception):
    """The request's route lost a node: replay it down another."""


@dataclass
class Generation:
    """One request in flight, and where its KV caches live."""

    request: GenerateRequest
    reply: ReplyRoute
    history: list[int]  # prompt ids, then every sampled token
    max_len: int  # positions it may reach: what its KV reservation is for
    prompt_len: int  # positions of `history` that are the prompt
    seq: int = field(default_factory=lambda: secrets.randbits(63))
    step: int = 0  # of the frame whose result is awaited
    row: int = 0  # the awaited position's row of that result (a frame of drafts has several)
    steps: int = 0  # steps taken: every frame sent gets a new one (see frames.py)
    epoch: int = 0
    route: tuple[int, ...] = ()  # replica index per stage; () before the first routing
    nodes: list[str] = field(default_factory=list)  # the route's node ids
    release: str | None = None  # the edgebus release its route's nodes run; None: several
    # Times it started again from its prompt, replayed onto nodes of another release
    # (node_agent/coordinator/routing.py): the token loop then drops what it generated.
    restarts: int = 0
    synced: int = 0  # positions of `history` the route's caches hold
    lost: str | None = None  # why the route must be replaced, once the current step ends
    result: asyncio.Future[Frame] | None = None
    recoveries: int = 0  # replays for frames lost or bad (token_loop.MAX_RECOVERIES)
    refusals: int = 0  # replays for frames refused by a full stage, since the last step
    refused_since: float | None = None  # time.monotonic() of the first of those
    # By the gateway: ends before the next step. Not mid-step: frames of the step
    # would still be on their way to stages that have already freed the request.
    cancelled: bool = False
    drafts: Drafts | None = None  # where the plant drafts (node_agent/speculation.py)

    def header(self, step: int | None = None) -> Header:
        return Header(self.seq, self.epoch, self.step if step is None else step, self.route)

    def new_step(self) -> int:
        self.steps += 1
        return self.steps - 1

    @property
    def generated(self) -> int:
        return len(self.history) - self.prompt_len

    def lose(self, why: str) -> None:
        """Replace this request's route once its current step ends: at once, if it waits
        for a result that will not come."""
        self.lost = why
        if self.result is not None and not self.result.done():
            self.result.set_exception(Lost(why))
