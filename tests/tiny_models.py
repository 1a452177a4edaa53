"""Tiny random-weight checkpoints of the families the pipeline must handle.

Weights come from a fixed seed, so a test's reference (`generate` in one
process) and the pipeline read the very same checkpoint from disk. The
SmolLM2 tokenizer is copied in because the coordinator needs one; the vocab
size follows it.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    LlamaConfig,
    PretrainedConfig,
    Qwen2Config,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")
VOCAB = 49152  # SmolLM2's tokenizer


def _small(**extra: Any) -> dict[str, Any]:
    """A small config's arguments; `extra` adds to or overrides them."""
    return {**dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                   bos_token_id=1, eos_token_id=2, pad_token_id=2), **extra}


CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**_small(tie_word_embeddings=False)),
    "qwen2": Qwen2Config(**_small(tie_word_embeddings=True)),
    # Multi-head latent attention with a low-rank query (q_lora_rank), and values
    # narrower than keys (v_head_dim 16 vs qk 16 + 8) so a layout mix-up shows;
    # layer 0 dense, MoE with one shared expert after it. 12 experts (more than 10,
    # so stacking them in "1, 10, 11, 2" order would show) in 2 groups of 6 (the
    # router scores a group by its top 2), 2 chosen per token.
    "deepseek_v3": DeepseekV3Config(**_small(
        tie_word_embeddings=False, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
        moe_intermediate_size=32, n_routed_experts=12, n_shared_experts=1, num_experts_per_tok=2,
        n_group=2, topk_group=1)),
}


def build_tiny(family: str, dest: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write a random `family` checkpoint with the given tokenizer into `dest`."""
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(CONFIGS[family]).save_pretrained(dest)  # type: ignore[no-untyped-call]
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, dest / name)
    return dest
