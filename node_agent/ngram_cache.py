"""The plant's recent answers as drafts: an n-gram cache shared by a coordinator's requests.

Prompt lookup (node_agent/speculation.py) finds what a request quotes of its own
text. Plant texts also repeat across requests: the same alarm summarised again,
a completion in the same file. So the coordinator keeps, over every finished
request's prompt and answer, what followed each n-gram the last time it was
seen, and a request whose own text has no match for its last tokens drafts
from here. That is llama.cpp's lookup decoding's dynamic cache
(common/ngram-cache.h: `common_ngram_cache_update` over the text generated so
far), with two differences. It keeps the latest continuation, not a count per
next token: a plant repeats its texts verbatim, and the latest is the likelier
quote, as in prompt lookup. And it is bounded: llama.cpp's maps grow with every
text fed, which a coordinator that runs for months cannot afford.

Drafts never change a token (the coordinator takes a draft only when sampling
picks it), so whatever this cache holds, stale or from another client, costs at
most a rolled-back stage step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from edgebus.core.frames import MAX_DECODE_POSITIONS

# Tokens kept of what followed an n-gram: a frame's worth, the most one lookup drafts
# (Drafting.feed asks again, from the n-gram the drafts end with, for the next frame).
CONTINUATION = MAX_DECODE_POSITIONS


class NgramCache:
    """N-grams of recent texts, each to the tokens that followed it the last time it was
    seen, at most `entries` of them.

    At the bound, recording an n-gram that is not held drops the least recently used
    one: recorded or drafted from longest ago. So the cache holds at most `entries`
    n-grams of at most `max_ngram` tokens, each with at most CONTINUATION tokens, however
    many texts it was fed; a text longer than the bound keeps its last n-grams.
    """

    def __init__(self, entries: int, *, min_ngram: int, max_ngram: int) -> None:
        if entries < 1:
            raise ValueError(f"an n-gram cache holds at least 1 entry, not {entries}")
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram lengths {min_ngram}..{max_ngram} are not in order")
        self.entries = entries
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self._map: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()  # LRU first

    def __len__(self) -> int:
        return len(self._map)

    def add(self, text: Sequence[int]) -> None:
        """Record every n-gram of `text` that some token follows, with up to CONTINUATION
        tokens that follow it; later occurrences replace earlier ones."""
        for end in range(1, len(text)):
            follows = tuple(text[end:end + CONTINUATION])
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                key = tuple(text[end - n:end])
                self._map[key] = follows
                self._map.move_to_end(key)
                if len(self._map) > self.entries:
                    self._map.popitem(last=False)

    def lookup(self, text: Sequence[int], most: int) -> list[int]:
        """At most `most` tokens that followed the longest n-gram `text` ends with, or []
        where none of its last n-grams is held."""
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(text) < n:
                continue
            key = tuple(text[-n:])
            follows = self._map.get(key)
            if follows is not None:
                self._map.move_to_end(key)
                return list(follows[:most])
        return []
