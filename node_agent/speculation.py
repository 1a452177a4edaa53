"""Pipelined speculation: drafts that keep a lone request's idle stages busy.

With one request in flight, a token crosses the stages in turn and each box
waits for the others. So the coordinator guesses the next tokens and sends them
down the pipeline right behind the request's token: in the token's own frame,
and in frames of drafts behind it (the PipeInfer idea, SC'24, on our bus):

    coordinator ─ [x_n d_n+1] (step s) ─ [d_n+2 d_n+3] (s+1) ─> stage 0 ─> stage 1 ─> ...

A frame of several positions is *verified* at each stage: computed in one call
where the stage's rows stay exact (its engine's `exact_rows`, measured at load),
else one call a position. The last stage returns candidates for every position.
While stage 1 computes frame s, stage 0 computes frame s+1. When the result for
position n comes back, the coordinator samples x_n+1 as it always does. If it
equals the draft d_n+1, that position is computed already and its row is the
next one to sample from: a token gained. If not, the drafts after position n are
wrong. The coordinator sends x_n+1 with the *rollback* flag
(edgebus/core/frames.py). Each stage drops what it holds from position n+1 on
and computes the new frame. A draft still queued at a stage when its rollback
arrives there is never computed (stage.py, `_superseded`).

Exactness: every position, draft or not, is computed bitwise as a one-position
decode call of its request's sequence computes it, as without speculation: one
call of several positions only where the stage measured that this is so. A
rolled-back position is computed again over the same cache as the first time
(`truncate` in the engines). The logits of every accepted position are
therefore bitwise the ones plain decoding computes. The coordinator samples
them with the same random draws in the same order, so greedy and seeded output
is the same with speculation on or off. That also holds the target
distribution: a drafted token is taken exactly when sampling picks it. (For a
draft that is one token, not a distribution, this is the standard rejection
rule.)

Drafts come from prompt lookup: the last n tokens of the request's text are
looked up in its own earlier text, and what followed them there is the
guess; where they never came before, in the plant's recent prompts and
answers (node_agent/ngram_cache.py). No draft model: it pays where answers
quote their input (alarm summaries, code edits) or repeat earlier answers.
How many drafts ride ahead (`window`) adapts to how often they are taken;
after a run of misses a request stops drafting for a while, so free text
costs no more than a few probes. How many positions a frame
carries (`positions_per_frame`) spreads the window over as many frames as the
route has stages, so that every stage has a frame to compute, never past what
every stage of the route verifies in one call, and only as far as the drafts'
recent acceptance pays for what the stages measured k positions in one call to
cost (their `row_costs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from edgebus.core.frames import MAX_DECODE_POSITIONS, Frame
from node_agent.ngram_cache import NgramCache
from plant_config.schema import Speculation as Settings

# Drafts a request keeps in flight at most, whatever the plant file asks: a stage
# holds a request's drafts in its inbox, and a rollback throws them all away.
MAX_WINDOW = 16
# Drafts looked at to judge whether drafting pays for a request: enough that one
# lucky or unlucky token does not decide, few enough to switch off within a line.
JUDGE_DRAFTS = 16
# Share of draft checks (a token sampled while drafts were in flight) that must find
# the draft taken for drafting to go on. A rejected run costs stage steps that idle
# anyway on a plant of separate boxes, but not where stages share cores.
MIN_ACCEPTANCE = 0.25
# Tokens a request waits, after drafting stopped paying, before it tries again:
# text changes character (a quote begins) but not every token.
PAUSE_TOKENS = 32


@dataclass
class Draft:
    """A drafted token in flight: the frame step it went in, the token, and its row of that
    frame (and so of the frame's result)."""

    step: int
    token: int
    row: int = 0


@dataclass
class Drafts:
    """One request's drafting: the lookup over its text, then over the plant's recent texts
    (`cache`, shared by the coordinator's requests), the drafts in flight, counts."""

    settings: Settings
    cache: NgramCache | None = None
    window: int = 1
    ahead: list[Draft] = field(default_factory=list)  # in position order, after the token
    # Results of frames that carry drafts still in flight, by step: back before their
    # token was sampled, or holding rows of drafts after the one being sampled.
    arrived: dict[int, Frame] = field(default_factory=dict)
    proposed: int = 0
    accepted: int = 0
    rejected: int = 0
    runs: int = 0  # tokens sent as fresh frames while drafting: each starts a run
    from_cache: int = 0  # of `proposed`, drafts from `cache`
    _indexed: int = 0  # tokens of the text the index covers
    _index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> next position
    _recent: list[bool] = field(default_factory=list)  # taken or not, last JUDGE_DRAFTS
    _paused_until: int = 0  # text length at which drafting may start again

    def __post_init__(self) -> None:
        self.window = min(self.settings.drafts, MAX_WINDOW)

    def settle(self, token: int) -> Draft | None:
        """The request's next token is `token`. Returns the draft that already carries it
        (its frame's step and row), or None: it must be sent, and if drafts were in flight,
        with the rollback flag (`rolling_back` tells, before this call)."""
        if self.ahead and self.ahead[0].token == token:
            draft = self.ahead.pop(0)
            self.accepted += 1
            self._judge(True)
            self.window = min(self.window + 1, self.settings.drafts, MAX_WINDOW)
            live = {draft.step, *(d.step for d in self.ahead)}
            for step in [s for s in self.arrived if s not in live]:
                del self.arrived[step]
            return draft
        if self.ahead:
            self._judge(False)
            self.window = max(1, self.window // 2)
            self.forget()
        return None

    @property
    def rolling_back(self) -> bool:
        return bool(self.ahead)

    def forget(self) -> None:
        """Drop every draft in flight: rejected, never reached (the request ended), or
        their route is gone (a replay)."""
        self.rejected += len(self.ahead)
        self.ahead.clear()
        self.arrived.clear()

    def positions_per_frame(self, stages: int, row_costs: Sequence[float]) -> int:
        """Positions a frame carries: the window spread over a frame per stage, so that
        every stage computes one, and at most what every stage of the route verifies in one
        call (`row_costs`' length). Within that, the count that brings the most tokens for
        its cost: a frame of k positions is worth 1 + p + ... + p^(k-1) tokens, p the share
        of drafts taken lately, and costs `row_costs[k - 1]` steps of one position. Where
        k positions cost k steps, as on a CPU without a batched kernel for the weights, a
        frame carries one position and the drafts ride in frames of their own. The plant
        file's `speculation.positions_per_frame` sets the count instead."""
        most = max(1, min(-(-self.window // stages), len(row_costs), MAX_DECODE_POSITIONS))
        if self.settings.positions_per_frame is not None:
            return min(most, self.settings.positions_per_frame)
        taken = self.acceptance()
        worth = [sum(taken ** j for j in range(k)) / row_costs[k - 1] for k in range(1, most + 1)]
        return 1 + worth.index(max(worth))

    def acceptance(self) -> float:
        """The share of drafts taken among the last JUDGE_DRAFTS checked, counting one
        taken and one not before any (so a new request starts at 1/2)."""
        return (sum(self._recent) + 1) / (len(self._recent) + 2)

    def propose(self, text: Sequence[int], room: int, most: int = MAX_WINDOW) -> list[int]:
        """Tokens to draft after `text` (the request's tokens, then the drafts in flight),
        to keep `window` in flight, at most `room` and `most`: what followed its last
        tokens earlier in its own text, else in the plant's recent texts."""
        want = min(self.window - len(self.ahead), room, most)
        if want <= 0 or len(text) < self._paused_until:
            return []
        self._index_up_to(len(text) - len(self.ahead), text)
        for n in range(self.settings.max_ngram, self.settings.min_ngram - 1, -1):
            if len(text) <= n:
                continue
            follows = self._index.get(tuple(text[-n:]))
            if follows is not None:
                drafted = list(text[follows:follows + want])
                self.proposed += len(drafted)
                return drafted
        if self.cache is None:
            return []
        drafted = self.cache.lookup(text, want)
        self.proposed += len(drafted)
        self.from_cache += len(drafted)
        return drafted

    def _index_up_to(self, length: int, text: Sequence[int]) -> None:
        """Index every n-gram of text[:length] that some token follows, by where that token
        is: the latest occurrence wins, since nearby text is the likelier quote."""
        low, high = self.settings.min_ngram, self.settings.max_ngram
        for end in range(max(self._indexed, 1), length):
            for n in range(low, min(high, end) + 1):
                self._index[tuple(text[end - n:end])] = end
        self._indexed = max(self._indexed, length)

    def _judge(self, taken: bool) -> None:
        self._recent.append(taken)
        del self._recent[:-JUDGE_DRAFTS]
        if (len(self._recent) == JUDGE_DRAFTS
                and sum(self._recent) < MIN_ACCEPTANCE * JUDGE_DRAFTS):
            self._paused_until = self._indexed + PAUSE_TOKENS
            self._recent.clear()
