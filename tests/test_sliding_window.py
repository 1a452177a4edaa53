"""Mistral's sliding window: a query sees only its last `sliding_window` keys.

A tiny random Mistral with a window of 8 positions and prompts of 20 and more,
so every answer is computed beyond the window. The reference is transformers'
`generate`; the stage must give its tokens when it runs the whole model as
one request at a time (the unbatched path), in prompt chunks that start past
the window, and when two requests at different positions share each forward
pass (the batched path of `node_agent/ragged.py`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pipeline import stage_model, tokenizer
from tiny_models import SLIDING_WINDOW, build_tiny
from transformers import AutoModelForCausalLM

from node_agent.kv_cache import KVCache
from node_agent.ragged import causal_mask

PROMPTS = ["Shift report 3: press 4 ran at 83 strokes per minute; hydraulic pressure 193 bar.",
           "A PLC alarm says 'axis 2 following error'. What should the operator check first?"]
TOKENS = 16
LAYERS = 6


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    return build_tiny("mistral", tmp_path_factory.mktemp("mistral"), smollm2_dir)


def prompt(model_dir: Path, text: str) -> list[int]:
    ids = list(tokenizer(model_dir)(text)["input_ids"])
    assert len(ids) > 2 * SLIDING_WINDOW
    return ids


@torch.inference_mode()
def generated(model_dir: Path, ids: list[int], **config: object) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **config)
    out = model.generate(torch.tensor([ids]), max_new_tokens=TOKENS, do_sample=False,
                         attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         eos_token_id=None)
    return list(out[0, len(ids):].tolist())


def test_the_mask_keeps_each_query_within_its_window() -> None:
    mask = causal_mask(start=10, t=3, window=4)
    assert mask is not None
    # Keys from position 7 on (10 - 4 + 1); query 10 sees 7-10, 11 sees 8-11, 12 sees 9-12.
    assert mask[0, 0].tolist() == [[True, True, True, True, False, False],
                                   [False, True, True, True, True, False],
                                   [False, False, True, True, True, True]]
    assert causal_mask(start=10, t=1, window=4) is None  # one query: every key kept
    assert causal_mask(start=0, t=4, window=4) is None  # inside the window: plain causal
    assert causal_mask(start=3, t=2) is not None and causal_mask(start=3, t=2, window=None) \
        .shape == (1, 1, 2, 5)  # type: ignore[union-attr]


@pytest.mark.parametrize("chunk", [1000, 5], ids=["whole-prompt", "chunks-of-5"])
def test_one_request_at_a_time_is_token_exact_beyond_the_window(mistral_dir: Path,
                                                                chunk: int) -> None:
    model = stage_model(mistral_dir, 0, LAYERS)
    for text in PROMPTS:
        ids = prompt(mistral_dir, text)
        expected = generated(mistral_dir, ids)
        # The window changes the answer: a stage that ignored it would fail here.
        assert generated(mistral_dir, ids, sliding_window=None) != expected
        cache, out = KVCache(), list[int]()
        for start in range(0, len(ids), chunk):
            logits = model.step([torch.tensor([ids[start:start + chunk]])], [cache], [start])[0]
        while len(out) < TOKENS:
            assert logits is not None
            out.append(int(logits.argmax()))
            logits = model.step([torch.tensor([out[-1:]])], [cache], [len(ids) + len(out) - 1])[0]
        assert out == expected, text


def test_requests_at_different_positions_in_one_pass_are_token_exact(mistral_dir: Path) -> None:
    model = stage_model(mistral_dir, 0, LAYERS)
    prompts = [prompt(mistral_dir, text) for text in PROMPTS]
    assert len(prompts[0]) != len(prompts[1])
    caches = [KVCache() for _ in prompts]
    # Both prompts in one pass, then every decode step of both in one pass.
    logits = model.step([torch.tensor([ids]) for ids in prompts], caches, [0, 0])
    outs: list[list[int]] = [[], []]
    while len(outs[0]) < TOKENS:
        for out, row in zip(outs, logits, strict=True):
            assert row is not None
            out.append(int(row.argmax()))
        logits = model.step([torch.tensor([out[-1:]]) for out in outs], caches,
                            [len(ids) + len(out) - 1 for ids, out in zip(prompts, outs,
                                                                          strict=True)])
    for ids, out in zip(prompts, outs, strict=True):
        assert out == generated(mistral_dir, ids)
