"""Tiny random-weight checkpoints of the families the pipeline must handle.

Weights come from a fixed seed, so a test's reference (`generate` in one
process) and the pipeline read the very same checkpoint from disk. The
SmolLM2 tokenizer is copied in because the coordinator needs one; the vocab
size follows it.
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optional

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# torch and transformers are imported by the functions that build or run a model, after
# optional.require_torch(): modules that import this one also hold tests that need neither.

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")
VOCAB = 49152  # SmolLM2's tokenizer
# Weights of the dense families drawn with this standard deviation (transformers'
# default, which DeepSeek keeps, is 0.02).
# At 0.02 attention is nearly uniform: the tiny Qwen2 repeated one token under
# greedy decoding, whatever its history, so a lost or misplaced KV cache went
# unnoticed. At 0.2 every request's next token already depends on its history
# at the first decode step (`historyless_tokens` is how the tests check it).
INIT_RANGE = 0.2
# Mistral's sliding window, far below the tests' prompts so that they reach past it.
SLIDING_WINDOW = 8


def _small(**extra: Any) -> dict[str, Any]:
    """A small config's arguments; `extra` adds to or overrides them."""
    return {**dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                   bos_token_id=1, eos_token_id=2, pad_token_id=2), **extra}


@functools.cache
def configs() -> dict[str, PretrainedConfig]:
    """Each family's small config, by name."""
    optional.require_torch()
    from transformers import DeepseekV3Config, LlamaConfig, MistralConfig, Qwen2Config

    return {
        "llama": LlamaConfig(**_small(tie_word_embeddings=False, initializer_range=INIT_RANGE)),
        "qwen2": Qwen2Config(**_small(tie_word_embeddings=True, initializer_range=INIT_RANGE)),
        "mistral": MistralConfig(**_small(tie_word_embeddings=False, sliding_window=SLIDING_WINDOW,
                                          initializer_range=INIT_RANGE)),
        # Multi-head latent attention with a low-rank query (q_lora_rank), and values
        # narrower than keys (v_head_dim 16 vs qk 16 + 8) so a layout mix-up shows;
        # layer 0 dense, MoE with one shared expert after it. 12 experts (more than 10,
        # so stacking them in "1, 10, 11, 2" order would show) in 2 groups of 6 (the
        # router scores a group by its top 2), 2 chosen per token.
        "deepseek_v3": DeepseekV3Config(**_small(
            tie_word_embeddings=False, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
            moe_intermediate_size=32, n_routed_experts=12, n_shared_experts=1,
            num_experts_per_tok=2, n_group=2, topk_group=1)),
    }


def build_tiny(family: str, dest: Path, tokenizer_dir: Path, seed: int = 0,
               initializer_range: float | None = None) -> Path:
    """Write a random `family` checkpoint with the given tokenizer into `dest`.

    `initializer_range` replaces the family's (INIT_RANGE for the dense ones).
    """
    optional.require_torch()
    import torch
    from transformers import AutoModelForCausalLM

    config = configs()[family]
    if initializer_range is not None:
        config = type(config)(**{**config.to_dict(), "initializer_range": initializer_range})
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(dest)  # type: ignore[no-untyped-call]
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, dest / name)
    return dest


def historyless_tokens(model_dir: Path, ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy tokens when every decode step forgets the KV history: the step sees its own
    token at its own position and nothing before it.

    A model whose greedy output this does not change would answer the same with
    a broken KV cache, so a token-exact test on it proves little.
    """
    return list(_historyless_tokens(model_dir, tuple(ids), max_new_tokens))


# Once per model, prompt and length: a test of each split of a model asks for the same ones,
# and each asking loaded the checkpoint again.
@functools.cache
def _historyless_tokens(model_dir: Path, ids: tuple[int, ...],
                        max_new_tokens: int) -> tuple[int, ...]:
    optional.require_torch()
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1]
        out: list[int] = []
        while True:
            out.append(int(logits.argmax()))
            if len(out) == max_new_tokens:
                return tuple(out)
            position = torch.tensor([[len(ids) + len(out) - 1]])
            logits = model(torch.tensor([out[-1:]]), position_ids=position).logits[0, -1]
