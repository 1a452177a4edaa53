"""Prompt building and streamed text: what the gateway sees must equal the final text."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pipeline import tokenizer

from edgebus.core.messages import ChatMessage, GenerateRequest
from node_agent.text import TextStream, decode, load_tokenizer, prompt_ids
from node_agent.tokenizer import FileTokenizer

# A maintenance log of well over a thousand tokens, multi-byte characters included.
LONG_TEXT = " ".join(f"Schicht {n}: Presse {n % 4} lief mit {80 + n} Hüben/min, "
                     f"温度 {20 + n % 9} °C." for n in range(80))
# Each step decodes its window (the ids since the last commit and the ones
# before them) and the next window's context: about 3 ids per id of ordinary text.
DECODES_PER_ID = 4


@pytest.fixture(scope="module", params=["transformers", "files"])
def tok(smollm2_dir: Path, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """transformers' tokenizer, and the same files read without it (a llama.cpp box's)."""
    if request.param == "files":
        return load_tokenizer(smollm2_dir, transformers=False)
    return tokenizer(smollm2_dir)


def _requests() -> list[GenerateRequest]:
    chats = [[ChatMessage(role="user", content="Hi")],
             [ChatMessage(role="system", content="Answer in one line."),
              ChatMessage(role="user", content="Press 4 stops with E-17 <|im_end|>: why?"),
              ChatMessage(role="assistant", content="Its guard switch."),
              ChatMessage(role="user", content="Und die Hydraulik? 温度 80 °C 🙂")]]
    return [*(GenerateRequest(id=f"c{i}", messages=m) for i, m in enumerate(chats)),
            *(GenerateRequest(id=f"p{i}", prompt=p) for i, p in enumerate(
                ["The most common fault of press 3 is", "  two spaces\n\nand lines\t",
                 "<|im_start|>user", LONG_TEXT]))]


def test_the_files_tokenizer_gives_transformers_ids_and_text(smollm2_dir: Path) -> None:
    """The coordinator of a llama.cpp plant tokenizes without transformers: the same chat
    template rendering, the same prompt ids, the same eos, the same decoded text."""
    files, reference = FileTokenizer(smollm2_dir), tokenizer(smollm2_dir)
    assert files.eos_token_id == reference.eos_token_id
    for request in _requests():
        if request.messages is not None:
            chat = [m.model_dump() for m in request.messages]
            assert files.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) \
                == reference.apply_chat_template(chat, add_generation_prompt=True,
                                                 tokenize=False), request.id
        ids = prompt_ids(files, request)
        assert ids == prompt_ids(reference, request), request.id
        generated = [*ids[-40:], reference.eos_token_id]
        assert decode(files, generated) == decode(reference, generated), request.id


def test_messages_use_the_chat_template_and_prompt_is_verbatim(tok) -> None:  # type: ignore[no-untyped-def]
    chat = GenerateRequest(id="a", messages=[ChatMessage(role="user", content="Hi")])
    text = tok.decode(prompt_ids(tok, chat))
    assert "<|im_start|>user\nHi<|im_end|>" in text
    assert text.rstrip().endswith("<|im_start|>assistant")
    raw = GenerateRequest(id="b", prompt="<|im_start|>user")
    assert prompt_ids(tok, raw) == tok("<|im_start|>user")["input_ids"]


def _stream(tok, text: str, stop: list[str]) -> tuple[str, str, bool]:  # type: ignore[no-untyped-def]
    stream = TextStream(tok, stop)
    shown = ""
    for token in tok(text)["input_ids"]:
        shown += stream.add(token)
        if stream.stopped:
            break
    shown += stream.flush()
    return shown, stream.text, stream.stopped


def test_deltas_add_up_to_the_text(tok) -> None:  # type: ignore[no-untyped-def]
    text = "Pressure 190 bar — Ventil geöffnet, 温度 normal. Done."
    shown, final, stopped = _stream(tok, text, [])
    assert shown == final == text
    assert not stopped


def test_stop_string_cuts_text_and_stream_never_shows_it(tok) -> None:  # type: ignore[no-untyped-def]
    shown, final, stopped = _stream(tok, "Step one. Observation: the valve leaks.", ["Observation"])
    assert stopped
    assert final == shown == "Step one. "


class WholeTextStream:
    """The specification of TextStream: decode the whole generation at every step.

    This was TextStream itself before it became incremental; the incremental
    one must give the same deltas, text and stop decision, id by id.
    """

    def __init__(self, tok, stop: list[str]) -> None:  # type: ignore[no-untyped-def]
        self._tok, self._stop = tok, stop
        self._ids: list[int] = []
        self.text, self.emitted, self.stopped = "", 0, False

    def add(self, token: int) -> str:
        self._ids.append(token)
        text = decode(self._tok, self._ids)
        if self._stop:
            search_from = max(0, len(self.text) - max(map(len, self._stop)))
            hits = [i for i in (text.find(s, search_from) for s in self._stop) if i >= 0]
            if hits:
                text, self.stopped = text[: min(hits)], True
        self.text = text
        end = len(text) if self.stopped else len(text) - 1 if text.endswith("\ufffd") \
            else len(text)
        if not self.stopped:
            for stop in self._stop:
                for n in range(min(len(stop) - 1, end), 0, -1):
                    if text[end - n:end] == stop[:n]:
                        end -= n
                        break
            end = max(end, self.emitted)
        delta = text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return delta

    def flush(self) -> str:
        delta, self.emitted = self.text[self.emitted:], len(self.text)
        return delta


def _deltas(stream: TextStream | WholeTextStream, ids: list[int]) -> list[str]:
    out = []
    for token in ids:
        out.append(stream.add(token))
        if stream.stopped:
            break
    out.append(stream.flush())
    return out


@pytest.fixture(scope="module")
def vocab_size(smollm2_dir: Path) -> int:
    return int(tokenizer(smollm2_dir).vocab_size)


@pytest.fixture(scope="module")
def byte_ids(tok, vocab_size: int) -> list[int]:  # type: ignore[no-untyped-def]
    """Ids of the byte tokens that are no character alone: pieces of multi-byte UTF-8."""
    return [i for i in range(vocab_size) if tok.decode([i]) == "\ufffd"]


# Random ids: half of them bytes of multi-byte characters (which must be held
# back until complete, or show as U+FFFD when they never complete), and stop
# strings cut from the text itself, so that they do occur.
@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_incremental_deltas_equal_decoding_the_whole_text_each_step(  # type: ignore[no-untyped-def]
        tok, byte_ids: list[int], vocab_size: int, data: st.DataObject) -> None:
    token = st.one_of(st.sampled_from(byte_ids), st.integers(0, vocab_size - 1))
    ids = data.draw(st.lists(token, max_size=30))
    whole = decode(tok, ids)
    cut = st.tuples(st.integers(0, max(0, len(whole) - 1)), st.integers(1, 4)).map(
        lambda at: whole[at[0]:at[0] + at[1]])
    stop = data.draw(st.lists(st.one_of(cut, st.text(min_size=1, max_size=3)), max_size=3)
                     .map(lambda stops: [s for s in stops if s]))
    expected, got = WholeTextStream(tok, stop), TextStream(tok, stop)
    assert _deltas(got, ids) == _deltas(expected, ids)
    assert (got.text, got.stopped) == (expected.text, expected.stopped)


class CountingTokenizer:
    """The real tokenizer, counting the ids it is asked to decode."""

    def __init__(self, tok) -> None:  # type: ignore[no-untyped-def]
        self.tok, self.decoded = tok, 0

    def decode(self, ids: list[int], **kwargs: object) -> str:
        self.decoded += len(ids)
        return str(self.tok.decode(ids, **kwargs))


def test_streaming_decodes_each_id_a_bounded_number_of_times(tok) -> None:  # type: ignore[no-untyped-def]
    ids = tok(LONG_TEXT)["input_ids"]
    assert len(ids) > 1000
    counting = CountingTokenizer(tok)
    shown = "".join(_deltas(TextStream(counting, []), ids))  # type: ignore[arg-type]
    assert shown == tok.decode(ids)
    # Decoding the whole text each step would be len(ids)**2 / 2 ids (over 500k).
    assert counting.decoded <= DECODES_PER_ID * len(ids)
