"""Prompt building and streamed text: what the gateway sees must equal the final text."""

from __future__ import annotations

from pathlib import Path

import pytest
from pipeline import tokenizer

from edgebus.messages import ChatMessage, GenerateRequest
from node_agent.text import TextStream, prompt_ids


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path):  # type: ignore[no-untyped-def]
    return tokenizer(smollm2_dir)


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
