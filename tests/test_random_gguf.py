"""tools/random_gguf.py: random-weight GGUFs of real models' shapes that llama.cpp runs.

Each family is written tiny (gguf_models.TINY_SHAPES) and run by llama.cpp
itself; the real shapes are written by the bench and by hand (docs/benchmarks.md).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_models import TINY_SHAPES, random_gguf_tool, tiny_random_gguf
from llama_cpp import Llama

from node_agent import gguf_model
from node_agent.engines.llamacpp import library

Q = gguf.GGMLQuantizationType
PROMPT = b"def parse_alarm_log(path):"


@pytest.mark.parametrize(("family", "file_type"), [
    ("llama", "Q4_0"), ("llama", "Q4_1"), ("llama", "Q5_K"), ("llama", "Q6_K"),
    ("deepseek2", "Q4_K"), ("qwen3moe", "Q8_0")])
def test_each_family_loads_in_llama_cpp_and_decodes_finite_logits(
        family: str, file_type: str, tmp_path: Path) -> None:
    path = tiny_random_gguf(family, file_type, tmp_path / "model.gguf")
    shape = random_gguf_tool().SHAPES[TINY_SHAPES[family][0]]
    # As a stage places its weights: llama.cpp's own placement dies of SIGSEGV on a CPU that
    # advertises AMX and faults in it (the Intel Xeon VM), when this file runs alone.
    with library.placed_as_stages(path):
        llm = Llama(model_path=str(path), n_ctx=64, n_threads=1, logits_all=True,
                    verbose=False)
    try:
        assert llm.n_vocab() == TINY_SHAPES[family][1]["vocab"]
        ids = llm.tokenize(PROMPT)
        tokens = []
        for token in llm.generate(ids, top_k=1, temp=0.0):
            tokens.append(token)
            if len(tokens) == 2:
                break
        logits = np.array(llm.eval_logits[-1])
        # Weights ~N(0, 0.02) give logits of a few tenths; NaN, inf or all-equal would show.
        assert np.isfinite(logits).all() and 0.01 < logits.std() < 10
    finally:
        llm.close()
    # The header as node_agent reads it, which skips over the vocabulary's strings: gguf-py's
    # reader decodes the tiny Llama's 49k of them in 3 s.
    header = gguf_model.layout(path)
    assert {e.key: e.value for e in header.entries}["general.architecture"] == shape.family
    types = {t.name: t.kind for t in header.tensors}
    asked = random_gguf_tool().FILE_TYPES[file_type][0]
    assert types["blk.1.attn_norm.weight"] == Q.F32
    assert types["output.weight"] == (Q.Q6_K if asked != Q.Q8_0 else Q.Q8_0)
    if family == "deepseek2":  # experts from layer 1 on; 32-wide k_b rows: Q4_K's fallback
        assert types["blk.0.ffn_down.weight"] == Q.Q4_K and "blk.0.ffn_up_exps.weight" not in types
        assert types["blk.1.ffn_up_exps.weight"] == Q.Q4_K
        assert types["blk.1.attn_k_b.weight"] == Q.Q5_0


def test_a_vocabulary_is_cut_or_grown_with_its_merges() -> None:
    tool = random_gguf_tool()
    small, large = tool.vocabulary(2000), tool.vocabulary(60000)
    assert len(small.tokens) == len(small.types) == 2000
    assert len(large.tokens) == len(set(large.tokens)) == len(large.types) == 60000
    for vocab in (small, large):
        known = set(vocab.tokens)
        assert all(left in known and right in known and left + right in known
                   for left, right in (merge.split(" ", 1) for merge in vocab.merges))
    assert large.tokens[:2000] == small.tokens


def test_the_shapes_are_the_models_configs() -> None:
    shapes = random_gguf_tool().SHAPES
    lite = shapes["deepseek-v2-lite"]
    assert (lite.hidden, lite.layers, lite.heads, lite.vocab) == (2048, 27, 16, 102400)
    assert (lite.kv_lora_rank, lite.q_lora_rank, lite.qk_nope, lite.qk_rope, lite.v_head) == (
        512, None, 128, 64, 128)
    assert (lite.experts, lite.experts_used, lite.shared_experts, lite.dense_lead) == (
        64, 6, 2, 1)
    assert (lite.moe_intermediate, lite.intermediate) == (1408, 10944)
    llama = shapes["llama-3-8b"]
    assert (llama.hidden, llama.layers, llama.heads, llama.kv_heads) == (4096, 32, 32, 8)
    assert (llama.intermediate, llama.vocab, llama.rope_theta) == (14336, 128256, 500000.0)
    qwen = shapes["qwen3-30b-a3b"]
    assert (qwen.hidden, qwen.layers, qwen.heads, qwen.kv_heads, qwen.dim) == (
        2048, 48, 32, 4, 128)
    assert (qwen.experts, qwen.experts_used, qwen.moe_intermediate, qwen.vocab) == (
        128, 8, 768, 151936)
    seed = shapes["deepseek-coder-1.3b"]
    assert (seed.hidden, seed.layers, seed.intermediate, seed.heads, seed.vocab) == (
        2048, 24, 5504, 16, 32256)


def test_an_unknown_type_is_refused(tmp_path: Path) -> None:
    tool = random_gguf_tool()
    with pytest.raises(ValueError, match="Q4_0, Q4_1, Q8_0, Q4_K"):
        tool.write(tool.SHAPES["llama-3-8b"], "Q3_K", tmp_path / "x.gguf")
    assert not list(tmp_path.iterdir())
