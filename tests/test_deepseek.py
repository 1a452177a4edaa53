"""DeepSeek-V3 layers (multi-head latent attention, MoE with a shared expert) through stages.

The tiny model has a dense layer 0 and MoE layers 1-5, so the splits below
put the dense/MoE boundary inside a stage and on a stage boundary. Its
checkpoint stores each expert as its own tensors, as DeepSeek's do, which the
stage must fuse the way `from_pretrained` does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from brokers import BrokerHandle
from pipeline import ask_all, plant_for, reference_tokens, running, stage_model

from edgebus.core.messages import ChatMessage, GenerateRequest
from node_agent.kv_cache import KVCache, kv_bytes_per_token

MAX_TOKENS = 16
# Over prefill_chunk (128) positions, so later chunks attend over cached latents.
LONG_PROMPT = " ".join(f"Press {n} hydraulic pressure {180 + n} bar, valve {n % 5} open."
                       for n in range(20))


def _requests() -> list[GenerateRequest]:
    prompts = ["The three most common causes of motor failure are", "Spindle speed",
               LONG_PROMPT]
    reqs = [GenerateRequest(id=f"p{i}", prompt=p, max_tokens=MAX_TOKENS, ignore_eos=True)
            for i, p in enumerate(prompts)]
    reqs.append(GenerateRequest(id="chat", max_tokens=MAX_TOKENS, ignore_eos=True,
                                messages=[ChatMessage(role="user", content="What is a PLC?")]))
    return reqs


SPLITS = {
    "2-stages-uneven": [(0, 4), (4, 6)],
    "3-stages": [(0, 2), (2, 4), (4, 6)],
    # The dense layer alone on stage 0.
    "3-stages-uneven": [(0, 1), (1, 5), (5, 6)],
}


@pytest.mark.parametrize("split", SPLITS.values(), ids=SPLITS.keys())
async def test_tiny_deepseek_v3_token_exact(deepseek_dir: Path, amqtt_broker: BrokerHandle,
                                            split: list[tuple[int, int]]) -> None:
    reqs = _requests()
    plant = plant_for(deepseek_dir, amqtt_broker, split)
    async with running(plant) as stages:
        responses = await ask_all(plant, reqs)
    for request, response in zip(reqs, responses, strict=True):
        assert response.error is None, response.error
        assert response.tokens == reference_tokens(deepseek_dir, request), request.id
        assert len(response.tokens) == MAX_TOKENS
    for stage in stages:  # more rows than forward passes: the batched decode path ran
        assert stage.metrics["rows"] > stage.metrics["steps"], stage.metrics


def test_batched_mla_decode_equals_each_request_alone(deepseek_dir: Path) -> None:
    """Requests at different positions decoded as one batch get the logits each gets alone:
    the ragged path expands every request's own cached latents."""
    model = stage_model(deepseek_dir, 0, 6)
    prompts = [[5, 6, 7], list(range(100, 140)), [20]]
    batch_caches = [KVCache() for _ in prompts]
    alone_caches = [KVCache() for _ in prompts]
    for ids, batched, alone in zip(prompts, batch_caches, alone_caches, strict=True):
        model.prefill(torch.tensor([ids]), batched, 0)
        model.prefill(torch.tensor([ids]), alone, 0)
    positions = [len(ids) for ids in prompts]
    for step in range(3):
        tokens = [[300 + step + i] for i in range(len(prompts))]
        batched_logits = model.decode(torch.tensor(tokens), batch_caches, positions)   # [B,V]
        for i, cache in enumerate(alone_caches):
            alone = model.decode(torch.tensor([tokens[i]]), [cache], [positions[i]])  # [1,V]
            # GEMM and GEMV sum in different orders: equal to ~1e-6, not bitwise.
            torch.testing.assert_close(batched_logits[i], alone[0], rtol=1e-4, atol=1e-5)
        positions = [p + 1 for p in positions]
    # MLA caches the compressed latent and the rotary key, not per-head keys/values,
    # and the coordinator's KV budget counts exactly that.
    config = model.config
    with torch.inference_mode():  # the caches were made in it; appending nothing reads them
        keys, values = batch_caches[1].update(torch.empty(1, 1, 0, config.kv_lora_rank),
                                              torch.empty(1, 1, 0, config.qk_rope_head_dim), 0)
    assert keys.shape == (1, 1, 40 + 3, config.kv_lora_rank)
    assert values.shape == (1, 1, 40 + 3, config.qk_rope_head_dim)
    assert batch_caches[1].nbytes == (40 + 3) * kv_bytes_per_token(config, (0, 6))
