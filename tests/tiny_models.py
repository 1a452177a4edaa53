"""Tiny random-weight checkpoints of the families the pipeline must handle.

Weights come from a fixed seed, so a test's reference (`generate` in one
process) and the pipeline read the very same checkpoint from disk. The
SmolLM2 tokenizer is copied in because the coordinator needs one; the vocab
size follows it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig, Qwen2Config

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")
VOCAB = 49152  # SmolLM2's tokenizer


def _small(**extra: object) -> dict[str, object]:
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                bos_token_id=1, eos_token_id=2, pad_token_id=2, **extra)


CONFIGS: dict[str, PretrainedConfig] = {
    "llama": LlamaConfig(**_small(tie_word_embeddings=False)),
    "qwen2": Qwen2Config(**_small(tie_word_embeddings=True)),
}


def build_tiny(family: str, dest: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """Write a random `family` checkpoint with the given tokenizer into `dest`."""
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(CONFIGS[family]).save_pretrained(dest)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, dest / name)
    return dest
