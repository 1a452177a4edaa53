"""Speculation: drafts sent down a request's route behind its token, while stages idle.

What a draft is and how its result is judged is node_agent/speculation.py's;
here the drafts of a request leave with its decode steps, and what drafting did
is counted when the request ends.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from edgebus.core import frames
from edgebus.core.frames import Kind
from edgebus.core.messages import SpeculationUsage
from node_agent.coordinator.generation import Generation
from node_agent.groups import Outbox
from node_agent.speculation import Draft, Drafts
from plant_config.schema import Speculation


class Drafting:
    """Feeds the decode steps of requests that draft."""

    def __init__(self, settings: Speculation, *, active: dict[int, Generation], outbox: Outbox,
                 publish: Callable[[str, bytes], None], counters: dict[str, float]) -> None:
        """`active`: the requests in flight, by seq; `publish(node, message)` sends a
        message of frames to a stage node at once."""
        self.settings = settings
        self._active = active
        self._outbox = outbox
        self._publish = publish
        self._counters = counters

    def may_draft(self) -> bool:
        """Whether drafts would fill idle stages: few enough requests are in flight."""
        return len(self._active) <= self.settings.max_in_flight

    def feed(self, gen: Generation, drafts: Drafts, first: str, candidates: int) -> None:
        """The decode step of a request that drafts: its token, unless a draft already
        carries it, then new drafts to keep `drafts.window` in flight.

        Each frame leaves as a message of its own, at once, outside the groups: a stage
        computes a message's rows as one batch, and the drafts must follow their
        token one position at a time, in order (node_agent/speculation.py).
        """
        token, position = gen.history[-1], len(gen.history) - 1
        rolling_back = drafts.rolling_back
        carried = drafts.settle(token)
        if carried is not None:
            gen.step = carried
        else:
            self._outbox.leave(gen.seq)  # its frames now leave in order, outside a group
            gen.step = gen.new_step()
            drafts.runs += 1
            self._publish(first, frames.encode(
                Kind.TOKENS, np.array([[token]]), gen.header(), start=position,
                candidates=candidates, rollback=rolling_back))
        if not self.may_draft():
            return
        text = [*gen.history, *(d.token for d in drafts.ahead)]
        # The last position a frame of this request may need: its KV reservation's end.
        room = gen.max_len - 1 - len(text)
        for token in drafts.propose(text, room):
            step = gen.new_step()
            drafts.ahead.append(Draft(step, token))
            self._publish(first, frames.encode(
                Kind.TOKENS, np.array([[token]]), gen.header(step), start=len(text),
                candidates=candidates))
            text.append(token)

    def done(self, gen: Generation) -> SpeculationUsage | None:
        """Count what drafting did for a request that ended; drafts still in flight were
        never reached, and count as rejected."""
        drafts = gen.drafts
        if drafts is None:
            return None
        drafts.forget()
        usage = SpeculationUsage(proposed=drafts.proposed, accepted=drafts.accepted,
                                 rejected=drafts.rejected, runs=drafts.runs)
        for name in ("proposed", "accepted", "rejected"):
            self._counters[f"drafts_{name}"] += getattr(usage, name)
        self._counters["draft_runs"] += usage.runs
        return usage
