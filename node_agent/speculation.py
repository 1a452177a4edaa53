"""Pipelined speculation: drafts that keep a lone request's idle stages busy.

With one request in flight, a token crosses the stages in turn and each box
waits for the others. So the coordinator guesses the next tokens and sends
each guess down the pipeline as a decode frame of its own, right behind the
request's token (the PipeInfer idea, SC'24, on our bus):

    coordinator ─ x_n (step s) ─ d_n+1 (s+1) ─ d_n+2 (s+2) ─> stage 0 ─> stage 1 ─> ...

While stage 1 computes position n, stage 0 computes the draft at n+1. When
the result for position n comes back, the coordinator samples x_n+1 as it
always does. If it equals the draft d_n+1, that draft's frame is already on
its way and its result is the next one to wait for: a token gained. If not,
the drafts after position n are wrong. The coordinator sends x_n+1 with the
*rollback* flag (edgebus/core/frames.py). Each stage drops what it holds from
position n+1 on and computes the new frame. A draft still queued at a stage
when its rollback arrives there is never computed (stage.py, `_superseded`).

Exactness: every position, draft or not, is a one-position decode call of
its request's sequence, as without speculation. A rolled-back position is
computed again over the same cache as the first time (`truncate` in the
engines). The logits of every accepted position are therefore bitwise the ones
plain decoding computes. The coordinator samples them with the same random
draws in the same order, so greedy and seeded output is the same with
speculation on or off. That also holds the target distribution: a drafted
token is taken exactly when sampling picks it. (For a draft that is one
token, not a distribution, this is the standard rejection rule.) Batched
verification of k positions in one call would be cheaper on one box, but it
is not exact: its logits differ from one-position calls at near-ties
(docs/architecture.md#pipelined-speculation).

Drafts come from prompt lookup: the last n tokens of the request's text are
looked up in its own earlier text, and what followed them there is the
guess. No draft model: it pays where answers quote their input (alarm
summaries, code edits). How many drafts ride ahead (`window`) adapts to how
often they are taken; after a run of misses a request stops drafting for a
while, so free text costs no more than a few probes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from edgebus.core.frames import Frame
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
    """A drafted token in flight: the frame step it went as, and the token."""

    step: int
    token: int


@dataclass
class Drafts:
    """One request's drafting: the lookup over its text, the drafts in flight, counts."""

    settings: Settings
    window: int = 1
    ahead: list[Draft] = field(default_factory=list)  # in position order, after the token
    arrived: dict[int, Frame] = field(default_factory=dict)  # results of drafts, by step
    proposed: int = 0
    accepted: int = 0
    rejected: int = 0
    runs: int = 0  # tokens sent as fresh frames while drafting: each starts a run
    _indexed: int = 0  # tokens of the text the index covers
    _index: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> next position
    _recent: list[bool] = field(default_factory=list)  # taken or not, last JUDGE_DRAFTS
    _paused_until: int = 0  # text length at which drafting may start again

    def __post_init__(self) -> None:
        self.window = min(self.settings.drafts, MAX_WINDOW)

    def settle(self, token: int) -> int | None:
        """The request's next token is `token`. Returns the step of the draft frame that
        already carries it, or None: it must be sent, and if drafts were in flight, with
        the rollback flag (`rolling_back` tells, before this call)."""
        if self.ahead and self.ahead[0].token == token:
            draft = self.ahead.pop(0)
            self.accepted += 1
            self._judge(True)
            self.window = min(self.window + 1, self.settings.drafts, MAX_WINDOW)
            return draft.step
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

    def propose(self, text: Sequence[int], room: int) -> list[int]:
        """Tokens to draft after `text` (the request's tokens, then the drafts in flight),
        to keep `window` in flight, at most `room`."""
        want = min(self.window - len(self.ahead), room)
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
        return []

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
