"""What a GGUF file's header says a llama.cpp node holds: the bytes of each part (layers,
embedding, head) and the shape that sizes its KV and buffers.

Read by the stage's fit check at every start (node_agent/fit.py) and by the profile
(node_agent/gguf_profile.py); apart from the profile, whose timing and message cost bring
in Mosquitto and the embedded broker's amqtt, which a stage never runs.
"""

from __future__ import annotations

from pathlib import Path

from node_agent.gguf_model import EMBEDDING, HEAD, part_bytes, read_config
from node_agent.measured import Sizes
from node_agent.model_config import LLAMACPP_KV_ITEM_BYTES, kv_bytes_per_token
from plant_config.planner import PartBytes
from plant_config.stage_memory import LlamaCppShape


def llamacpp_shape(path: Path) -> LlamaCppShape:
    """What sizes a llama.cpp node's KV and buffers, from the GGUF's metadata."""
    config = read_config(path)
    # An MoE layer's widest activations are its chosen experts' rows, side by side.
    ffn = max(config.intermediate_size or 0,
              (getattr(config, "moe_intermediate_size", None) or 0)
              * (getattr(config, "num_experts_per_tok", None) or 0))
    return LlamaCppShape(
        kv_bytes=tuple(kv_bytes_per_token(config, (layer, layer + 1), LLAMACPP_KV_ITEM_BYTES)
                       for layer in range(config.num_hidden_layers)),
        heads=config.num_attention_heads, hidden=config.hidden_size, ffn=ffn,
        vocab=config.vocab_size)


def weight_sizes(path: Path) -> Sizes:
    """Bytes per layer, of the embedding and of the head as the file holds them; whether
    the head is the embedding's matrix."""
    parts = part_bytes(path)
    config = read_config(path)

    def sizes(part: str | int) -> PartBytes:
        return PartBytes(fp32=0, bf16=0, int8=0, int4=0, gguf=parts.get(part, 0))

    return (tuple(sizes(layer) for layer in range(config.num_hidden_layers)),
            sizes(EMBEDDING), sizes(HEAD), bool(config.tie_word_embeddings))
