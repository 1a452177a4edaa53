"""Which weight matrices the llamacpp engine has llama.cpp repack, so that rows stay exact
(node_agent/engines/llamacpp/placement.py), and what a stage then measures at load."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import pytest

from node_agent.engines import ContextShape, load_engine
from node_agent.engines.llamacpp import library, placement
from node_agent.gguf_model import TensorInfo

Q = gguf.GGMLQuantizationType
# llama.cpp's system info for the aarch64 check's build (tools/aarch64_check.sh: the Pi 5's
# armv8.2-a+dotprod+fp16, without llamafile), as it prints it on the Cortex-A76.
A76_BUILD = "CPU : NEON = 1 | ARM_FMA = 1 | FP16_VA = 1 | DOTPROD = 1 | OPENMP = 1 | REPACK = 1 |"
# llama-quantize's Q4_K_M mix, two layers of it: Q4_K matrices, some attn_v and ffn_down in
# Q6_K, a Q6_K head; F32 norms; the embedding in Q4_K, which only a row lookup reads.
Q4_K_M = [
    TensorInfo("token_embd.weight", (512, 16384), Q.Q4_K, 0),
    TensorInfo("blk.0.attn_norm.weight", (512,), Q.F32, 0),
    TensorInfo("blk.0.attn_q.weight", (512, 512), Q.Q4_K, 0),
    TensorInfo("blk.0.attn_v.weight", (512, 256), Q.Q6_K, 0),
    TensorInfo("blk.0.ffn_down.weight", (1536, 512), Q.Q6_K, 0),
    TensorInfo("blk.1.attn_q.weight", (512, 512), Q.Q4_K, 0),
    TensorInfo("blk.1.attn_v.weight", (512, 256), Q.Q4_K, 0),
    TensorInfo("blk.1.ffn_down.weight", (1536, 512), Q.Q4_K, 0),
    # Rows that do not split into the repacked layout's groups of 8: ggml leaves it plain.
    TensorInfo("blk.1.ffn_up.weight", (512, 1532), Q.Q4_K, 0),
    TensorInfo("output.weight", (512, 16384), Q.Q6_K, 0),
]


def repacked(chosen: placement.Placement, tensors: list[TensorInfo]) -> list[str]:
    """The tensors llama.cpp sends to the repacked buffer, read as it reads the overrides."""
    return [t.name for t in tensors
            if any(re.search(pattern, t.name) for pattern in chosen.patterns)]


def test_on_the_a76_only_the_matrices_whose_repacked_kernels_stay_exact_are_repacked() -> None:
    chosen = placement.choose(placement.features(A76_BUILD), Q4_K_M)
    assert chosen is not None
    assert repacked(chosen, Q4_K_M) == ["blk.0.attn_q.weight", "blk.1.attn_q.weight",
                                        "blk.1.attn_v.weight", "blk.1.ffn_down.weight"]
    assert chosen.repacked == ("Q4_K",) and chosen.plain == ("Q4_K", "Q6_K")


def test_a_q4_0_head_is_repacked_and_a_q8_0_one_is_not() -> None:
    for kind, kept in ((Q.Q4_0, ["output.weight"]), (Q.Q8_0, [])):
        tensors = [TensorInfo("output.weight", (576, 49152), kind, 0)]
        chosen = placement.choose(placement.features(A76_BUILD), tensors)
        assert chosen is not None and repacked(chosen, tensors) == kept, kind


@pytest.mark.parametrize("build", [
    A76_BUILD.replace("REPACK", "LLAMAFILE = 1 | REPACK"),  # tinyBLAS takes plain Q8_0
    A76_BUILD.replace("DOTPROD", "MATMUL_INT8 = 1 | DOTPROD"),  # other kernels, not measured
    "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | LLAMAFILE = 1 | REPACK = 1 |",
], ids=["with-llamafile", "i8mm", "x86"])
def test_elsewhere_llama_cpp_places_the_weights_itself(build: str) -> None:
    assert placement.choose(placement.features(build), Q4_K_M) is None


def test_smollm2s_stages_batch_8_requests_and_verify_4_positions_exactly(
        smollm2_gguf: Path) -> None:
    """Issue 42's target for the bundled model (Q4_1, a tied Q8_0 head): on the CPU this
    runs on, as the engine places the weights, every stage of three measures at least 8
    decode rows of as many requests and 4 positions of one request exact in one call."""
    shape = ContextShape(kv_budget_bytes=256 * 2**20, positions=64, batch_positions=64)
    measured = []
    for first, end in ((0, 10), (10, 20), (20, 30)):
        engine = load_engine(smollm2_gguf, first, end, weights="gguf", threads=1, shape=shape)
        measured.append((engine.exact_batch, engine.exact_rows))
        engine.close()
    print(library.system_info(), measured)
    assert all(batch >= 8 and rows >= 4 for batch, rows in measured), measured
