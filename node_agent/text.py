"""Tokens in, text out: prompt building and incremental detokenization with stop strings."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from edgebus.core.messages import GenerateRequest
from node_agent.model_config import is_gguf
from node_agent.tokenizer import FileTokenizer, TemplatedTokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    # transformers' own, or the same read without it (tokenizer.py, gguf_tokenizer.py).
    Tokenizer: TypeAlias = PreTrainedTokenizerBase | TemplatedTokenizer


def load_tokenizer(model: Path, *, transformers: bool) -> Tokenizer:
    """The tokenizer of `model`: of a GGUF file, llama.cpp's own (GgufTokenizer); of a model
    directory, transformers' (`transformers`), or FileTokenizer, which gives the same ids and
    text without it, for a box without transformers."""
    if is_gguf(model):
        from node_agent.gguf_tokenizer import GgufTokenizer  # loads llama.cpp

        return GgufTokenizer(model)
    if not transformers:
        return FileTokenizer(model)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def prompt_ids(tokenizer: Tokenizer, request: GenerateRequest) -> list[int]:
    """`messages` go through the model's chat template; `prompt` is used verbatim."""
    if request.messages is not None:
        chat = [m.model_dump() for m in request.messages]
        encoded: Any = tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)
        return list(encoded["input_ids"])
    assert request.prompt is not None
    return list(tokenizer(request.prompt)["input_ids"])


def decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    """Generated ids as text, special tokens (EOS, chat markers) left out."""
    return str(tokenizer.decode(ids, skip_special_tokens=True))


class TextStream:
    """Turns generated ids into text deltas and finds stop strings.

    Text is decoded incrementally: each step decodes only a window of the
    last few ids, never the whole generation, so a stream of n tokens costs
    O(n), not O(n^2). The window starts one id before the text not yet
    committed, so that a tokenizer which strips a leading space from the
    first id it decodes (SentencePiece) sees that id in context. A window
    whose text ends in U+FFFD holds an incomplete character: it is shown
    (like the whole text would be) but not committed, and is decoded again
    with the next id. Text that could be the start of a stop string is held
    back too, so a stream never shows a stop string that the final text does
    not contain. `text` and the deltas are what decoding the whole generation
    at every step would give.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._ids: list[int] = []
        # ids[_context:_committed] decode to the tail of `_committed_text`; the
        # window decoded each step is ids[_context:].
        self._context = 0
        self._committed = 0
        self._committed_text = ""
        self._context_text = ""  # decode(ids[_context:_committed])
        self.text = ""       # everything decoded so far, cut at a stop string
        self.emitted = 0     # characters of `text` already handed out as deltas
        self.stopped = False

    def add(self, token: int) -> str:
        """Append one id; return the new text safe to show (may be empty)."""
        self._ids.append(token)
        window = decode(self._tokenizer, self._ids[self._context:])
        text = self._committed_text + window[len(self._context_text):]
        if not text.endswith("\ufffd"):
            # A complete character: the next window starts at this one's last ids.
            self._committed_text = text
            self._context, self._committed = self._committed, len(self._ids)
            self._context_text = decode(self._tokenizer, self._ids[self._context:self._committed])
        if self._stop:
            search_from = max(0, len(self.text) - max(map(len, self._stop)))
            hits = [i for i in (text.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                text, self.stopped = text[: min(hits)], True
        self.text = text
        safe = len(text) if self.stopped else self._safe_length(text)
        delta = text[self.emitted:safe]
        self.emitted = max(self.emitted, safe)
        return delta

    def flush(self) -> str:
        """The held-back rest, once generation has ended."""
        delta = self.text[self.emitted:]
        self.emitted = len(self.text)
        return delta

    def _safe_length(self, text: str) -> int:
        end = len(text) - 1 if text.endswith("\ufffd") else len(text)
        for stop in self._stop:
            for n in range(min(len(stop) - 1, end), 0, -1):
                if text[end - n:end] == stop[:n]:
                    end -= n
                    break
        return max(end, self.emitted)
