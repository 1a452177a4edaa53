"""Tokens in, text out: prompt building and incremental detokenization with stop strings."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from edgebus.messages import GenerateRequest


def prompt_ids(tokenizer: PreTrainedTokenizerBase, request: GenerateRequest) -> list[int]:
    """`messages` go through the model's chat template; `prompt` is used verbatim."""
    if request.messages is not None:
        chat = [m.model_dump() for m in request.messages]
        encoded: Any = tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)
        return list(encoded["input_ids"])
    assert request.prompt is not None
    return list(tokenizer(request.prompt)["input_ids"])


def decode(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """Generated ids as text, special tokens (EOS, chat markers) left out."""
    return str(tokenizer.decode(ids, skip_special_tokens=True))


class TextStream:
    """Turns generated ids into text deltas and finds stop strings.

    Decoding the whole generation each step (not token by token) is what keeps
    multi-token characters and leading spaces right; a trailing U+FFFD means a
    character is still incomplete, so it is held back. Text that could be the
    start of a stop string is held back too, so a stream never shows a stop
    string that the final text does not contain.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: list[str]) -> None:
        self._tokenizer = tokenizer
        self._stop = stop
        self._ids: list[int] = []
        self.text = ""       # everything decoded so far, cut at a stop string
        self.emitted = 0     # characters of `text` already handed out as deltas
        self.stopped = False

    def add(self, token: int) -> str:
        """Append one id; return the new text safe to show (may be empty)."""
        self._ids.append(token)
        text = decode(self._tokenizer, self._ids)
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
