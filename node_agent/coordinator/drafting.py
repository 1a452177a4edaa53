"""Speculation: drafts sent down a request's route behind its token, while stages idle.

What a draft is and how its result is judged is node_agent/speculation.py's;
here the drafts of a request leave with its decode steps, and what drafting did
is counted when the request ends. The plant's recent texts, which every
request drafts from where its own text has no match, live here: one cache per
coordinator (node_agent/ngram_cache.py), fed with each request as it ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from edgebus.core import frames
from edgebus.core.frames import Kind
from edgebus.core.messages import SpeculationUsage
from node_agent.coordinator.generation import Generation
from node_agent.groups import Outbox
from node_agent.ngram_cache import NgramCache
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
        self.cache = (NgramCache(settings.answer_cache, min_ngram=settings.min_ngram,
                                 max_ngram=settings.max_ngram)
                      if settings.answer_cache else None)

    def start(self) -> Drafts:
        """The drafting of a new request: over its own text, then the plant's recent ones."""
        return Drafts(self.settings, cache=self.cache)

    def may_draft(self) -> bool:
        """Whether drafts would fill idle stages: few enough requests are in flight."""
        return len(self._active) <= self.settings.max_in_flight

    def feed(self, gen: Generation, drafts: Drafts, first: str, candidates: int, *,
             row_costs: Sequence[float]) -> None:
        """The decode step of a request that drafts: its token, unless a draft already
        carries it, with drafts behind it in its frame, then frames of drafts to keep
        `drafts.window` in flight. `row_costs`: what 1, 2, ... positions in one call cost
        the route's stages, as many as every one of them verifies in one call.

        Each frame leaves as a message of its own, at once, outside the groups: a stage
        computes a message's rows as one batch, and the frames must follow their token in
        order (node_agent/speculation.py).
        """
        token, position = gen.history[-1], len(gen.history) - 1
        rolling_back = drafts.rolling_back
        carried = drafts.settle(token)
        per_frame = drafts.positions_per_frame(len(gen.nodes), row_costs)
        may_draft = self.may_draft()
        # The last position a frame of this request may need: its KV reservation's end.
        room = gen.max_len - 1
        if carried is not None:
            gen.step, gen.row = carried.step, carried.row
        else:
            self._outbox.leave(gen.seq)  # its frames now leave in order, outside a group
            gen.step, gen.row = gen.new_step(), 0
            drafts.runs += 1
            behind = (drafts.propose(gen.history, room - len(gen.history), per_frame - 1)
                      if may_draft else [])
            self._send(gen, drafts, first, candidates, [token, *behind], position, gen.step,
                       drafted_from=1, rollback=rolling_back)
        if not may_draft:
            return
        text = [*gen.history, *(d.token for d in drafts.ahead)]
        # Whole frames only: refilled a draft at a time as drafts are taken, the window
        # would leave in frames of one position, each a step at every stage.
        while (drafts.window - len(drafts.ahead) >= per_frame
               and (proposal := drafts.propose(text, room - len(text), per_frame))):
            self._send(gen, drafts, first, candidates, proposal, len(text), gen.new_step(),
                       drafted_from=0)
            text += proposal

    def _send(self, gen: Generation, drafts: Drafts, first: str, candidates: int,
              tokens: list[int], start: int, step: int, *, drafted_from: int,
              rollback: bool = False) -> None:
        """One frame of `tokens` from position `start`, as `step`; those from row
        `drafted_from` on are drafts, in flight until their tokens are sampled."""
        drafts.ahead += [Draft(step, token, row) for row, token in enumerate(tokens)
                         if row >= drafted_from]
        self._publish(first, frames.encode(Kind.TOKENS, np.array([tokens]), gen.header(step),
                                           start=start, candidates=candidates,
                                           rollback=rollback))

    def done(self, gen: Generation, tokens: Sequence[int]) -> SpeculationUsage | None:
        """Count what drafting did for a request that ended with `tokens` generated, and
        keep its prompt and answer for later requests to draft from; drafts still in
        flight were never reached, and count as rejected."""
        drafts = gen.drafts
        if drafts is None:
            return None
        drafts.forget()
        if self.cache is not None:  # on the event loop: ~3 us a token, once a request
            self.cache.add([*gen.history[:gen.prompt_len], *tokens])
        usage = SpeculationUsage(proposed=drafts.proposed, accepted=drafts.accepted,
                                 rejected=drafts.rejected, runs=drafts.runs,
                                 from_cache=drafts.from_cache)
        for name in ("proposed", "accepted", "rejected", "from_cache"):
            self._counters[f"drafts_{name}"] += getattr(usage, name)
        self._counters["draft_runs"] += usage.runs
        return usage
