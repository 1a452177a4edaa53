"""Weight modes: what a bf16 or int8 stage stores and computes, against fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import build_tiny

from node_agent.engines.torch_engine import TorchEngine
from node_agent.engines.torch_weights import INT8_MAX, ConvertedExperts, Int8Linear, quantize
from node_agent.kv_cache import KVCache

PROMPT = torch.arange(100, 140).unsqueeze(0)                                           # [1,T]
# transformers' default standard deviation of random weights.
DEFAULT_INIT_RANGE = 0.02


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """Tiny Qwen2, whose LM head is tied to its embedding like SmolLM2's.

    With transformers' default initializer range: the error bounds below were
    set for it, and the quantization error is what is checked, not the history.
    """
    return build_tiny("qwen2", tmp_path_factory.mktemp("qwen2"), smollm2_dir,
                      initializer_range=DEFAULT_INIT_RANGE)


def _logits(model: TorchEngine) -> torch.Tensor:
    """[2, V]: after the prompt, and after one decode step of a fixed token."""
    cache = KVCache()
    first = model.prefill(PROMPT, cache, 0)
    return torch.cat([first, model.decode(torch.tensor([[300]]), [cache], [PROMPT.shape[1]])])


def test_int8_linear_computes_codes_times_scales() -> None:
    """The kernel path equals the dequantized matrix product, to bf16 activation rounding."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40, bias=True)
    holder = torch.nn.Sequential(linear)
    quantize(holder, "int8")
    q = holder[0]
    assert isinstance(q, Int8Linear)
    assert q.weight.dtype == torch.int8 and q.weight.abs().max() == INT8_MAX
    dequantized = q.weight.float() * q.scale.float().unsqueeze(1)                     # [N,K]
    # Rounding to a code moves a weight by at most half a scale step.
    assert (dequantized - linear.weight).abs().max() <= q.scale.float().max() / 2 + 1e-7
    x = torch.randn(3, 5, 96)
    expected = x @ dequantized.T + linear.bias
    torch.testing.assert_close(q(x), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("weights", "stored", "max_relative_error"),
                         [("bf16", torch.bfloat16, 0.02), ("int8", torch.int8, 0.05)])
def test_whole_tiny_model_in_each_mode_stays_close_to_fp32(
        qwen2_dir: Path, weights: str, stored: torch.dtype, max_relative_error: float) -> None:
    fp32 = TorchEngine(qwen2_dir, 0, 6)
    converted = TorchEngine(qwen2_dir, 0, 6, weights=weights)
    # The tied embedding and head are converted once and still share one tensor.
    assert converted.embed_tokens is not None and converted.lm_head is not None
    assert converted.embed_tokens.weight.dtype == stored
    assert converted.embed_tokens.weight is converted.lm_head.weight
    matrices = [m.weight for m in converted.modules() if hasattr(m, "weight")
                and m.weight.dim() == 2]
    assert matrices and all(w.dtype == stored for w in matrices)
    assert converted.param_bytes < (0.55 if weights == "bf16" else 0.3) * fp32.param_bytes

    reference, logits = _logits(fp32), _logits(converted)
    error = (logits - reference).norm(dim=-1) / reference.norm(dim=-1)
    assert error.max() < max_relative_error, error


def test_converted_experts_compute_what_transformers_experts_compute(
        deepseek_dir: Path) -> None:
    """Routing, gating and the weighted sum match transformers' own experts module
    given the dequantized matrices (bf16 activation rounding aside)."""
    stage = TorchEngine(deepseek_dir, 1, 2)
    original = stage.layers[0].mlp.experts
    experts = TorchEngine(deepseek_dir, 1, 2, weights="int8").layers[0].mlp.experts
    assert isinstance(experts, ConvertedExperts)
    for fused, per_expert in (("gate_up_proj", experts.gate_up), ("down_proj", experts.down)):
        dequantized = torch.stack([m.weight.float() * m.scale.float().unsqueeze(1)
                                   for m in per_expert])                               # [E,N,K]
        getattr(original, fused).data.copy_(dequantized)
    torch.manual_seed(0)
    hidden = torch.randn(6, stage.config.hidden_size)                                  # [S,H]
    index = torch.tensor([[0, 3], [3, 11], [1, 10], [5, 6], [7, 2], [9, 4]])          # [S,k]
    weights = torch.rand(6, 2)
    with torch.inference_mode():
        got, expected = experts(hidden, index, weights), original(hidden, index, weights)
    # Relative to the output's size: random init makes every element small.
    assert (got - expected).norm() < 0.01 * expected.norm()


def test_int8_deepseek_stage_decodes_batched_like_alone(deepseek_dir: Path) -> None:
    """MLA projections, experts and shared experts in int8; batched rows match single ones."""
    model = TorchEngine(deepseek_dir, 0, 6, weights="int8")
    assert model.layers[1].self_attn.kv_b_proj.weight.dtype == torch.int8
    assert model.layers[1].mlp.shared_experts.up_proj.weight.dtype == torch.int8
    assert model.layers[1].mlp.experts.gate_up[0].weight.dtype == torch.int8
    fp32 = TorchEngine(deepseek_dir, 0, 6)
    assert model.param_bytes < 0.3 * fp32.param_bytes

    def caches() -> list[KVCache]:
        made = [KVCache(), KVCache()]
        for cache, length in zip(made, (3, 11), strict=True):
            model.prefill(torch.arange(50, 50 + length).unsqueeze(0), cache, 0)
        return made

    batched = model.decode(torch.tensor([[7], [8]]), caches(), [3, 11])                # [2,V]
    alone = caches()
    for i, (token, position) in enumerate(((7, 3), (8, 11))):
        single = model.decode(torch.tensor([[token]]), [alone[i]], [position])[0]      # [V]
        assert (batched[i] - single).norm() < 1e-3 * single.norm()
    reference = _logits(fp32)
    assert ((_logits(model) - reference).norm(dim=-1) / reference.norm(dim=-1)).max() < 0.05


def test_int4_is_refused_with_the_engine_that_runs_it() -> None:
    with pytest.raises(ValueError, match="int4 runs on engine onnxruntime"):
        quantize(torch.nn.Linear(4, 4), "int4")
