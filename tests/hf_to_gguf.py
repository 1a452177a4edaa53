"""A tiny random checkpoint (tiny_models.py) written as GGUF (F16) in the test process, as
llama.cpp's convert_hf_to_gguf.py writes it.

The converter lives in llama-cpp-python's sdist (a download on a fresh machine) and runs in
a child that imports torch and transformers again. This writes the same file with the
installed gguf-py, following the converter's code paths for the three families the tests
convert (LlamaModel, Qwen2Model, DeepseekV2Model in its conversion/ package) as far as their
tiny configs take them: the same keys and values in the same order, the same tensors
(names, order, types, bytes). For the four tiny models of conftest.converted_ggufs the files
were byte-identical to the converter's of llama-cpp-python 0.3.36, compared field by field
and tensor by tensor; a new family or config key, or another llama-cpp-python, is when to
compare again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# The llama.cpp architecture of each Hugging Face architecture the tests convert.
ARCHITECTURES = {"LlamaForCausalLM": gguf.MODEL_ARCH.LLAMA,
                 "Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2,
                 "DeepseekV3ForCausalLM": gguf.MODEL_ARCH.DEEPSEEK2}

# The converter's fallback for a vocabulary of SmolLM2's size in a Llama (meant for IBM's
# Granite small models): it says the tokenizer adds no BOS token.
GRANITE_SMALL_VOCAB = 49152


def write_gguf(model_dir: Path, dest: Path, pre_tokenizer: str) -> Path:
    """The checkpoint `model_dir` (config.json, model.safetensors, tokenizer) written to
    `dest` as an F16 GGUF; `pre_tokenizer` is the tokenizer.ggml.pre the converter is told
    (it knows a tokenizer by the hash of its Hub copy, which an import changes)."""
    config = json.loads((model_dir / "config.json").read_text())
    arch = ARCHITECTURES[config["architectures"][0]]
    writer = gguf.GGUFWriter(None, gguf.MODEL_ARCH_NAMES[arch])
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    for hf_name, data in _tensors(model_dir, config, arch):
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"gguf-py maps no GGUF name to {hf_name}"
        qtype = _qtype(name, data)
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.add_type(gguf.GGUFType.MODEL)
    _add_model_card(writer, model_dir)
    _add_hyperparameters(writer, config, arch)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_vocabulary(writer, model_dir, config, arch, pre_tokenizer)
    writer.write_header_to_file(path=dest)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


def _tensors(model_dir: Path, config: dict[str, Any],
             arch: gguf.MODEL_ARCH) -> Iterator[tuple[str, np.ndarray]]:
    """The checkpoint's tensors in the file's order, under the Hugging Face names gguf-py maps,
    reshaped as the converter does: the Llama's query and key rows permuted from Hugging
    Face's rotary halves back to llama.cpp's interleaved pairs; DeepSeek's experts stacked
    (once a layer's last one is read) and its kv_b_proj split into the key and value halves
    that MLA's absorption multiplies by."""
    experts: dict[str, np.ndarray] = {}
    # gguf-py's reading, as the converter's: by name, and no safetensors package (conftest
    # imports this module on a base install too).
    with gguf.utility.SafetensorsLocal(model_dir / "model.safetensors") as checkpoint:
        for name, tensor in checkpoint.items():
            assert tensor.dtype == "F32", f"{name} is {tensor.dtype}: tiny_models saves fp32"
            data = tensor.mmap_bytes().view(np.float32).reshape(tensor.shape)
            if arch == gguf.MODEL_ARCH.LLAMA and name.endswith("q_proj.weight"):
                data = _unrotate(data, config["num_attention_heads"])
            elif arch == gguf.MODEL_ARCH.LLAMA and name.endswith("k_proj.weight"):
                data = _unrotate(data, config["num_key_value_heads"])
            if arch != gguf.MODEL_ARCH.DEEPSEEK2:
                yield name, data
            elif ".mlp.experts." in name:
                experts[name] = data
                if len(experts) == config["n_routed_experts"] * len(EXPERT_PROJECTIONS):
                    yield from _stacked(experts, config["n_routed_experts"])
                    experts.clear()
            elif name.endswith("kv_b_proj.weight"):
                yield from _split_kv_b(name, data, config)
            else:
                yield name.replace("e_score_correction_bias", "e_score_correction.bias"), data
    assert not experts, f"experts of no complete layer: {sorted(experts)}"


def _unrotate(weights: np.ndarray, n_head: int) -> np.ndarray:
    """`weights`' rows, each head's two rotary halves interleaved (the converter's
    LlamaModel.permute)."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


# Each DeepSeek expert's projections, in the order the converter stacks them.
EXPERT_PROJECTIONS = ("down_proj", "gate_proj", "up_proj")


def _stacked(experts: dict[str, np.ndarray], n_experts: int) -> Iterator[tuple[str, np.ndarray]]:
    """One layer's `experts` as one tensor a projection, expert 0 first."""
    prefix = next(iter(experts)).split(".mlp.experts.")[0]
    for projection in EXPERT_PROJECTIONS:
        yield (f"{prefix}.mlp.experts.{projection}.weight",
               np.stack([experts[f"{prefix}.mlp.experts.{i}.{projection}.weight"]
                         for i in range(n_experts)]))


def _split_kv_b(name: str, data: np.ndarray,
                config: dict[str, Any]) -> Iterator[tuple[str, np.ndarray]]:
    """kv_b_proj's rows, head by head a key part then a value part, as k_b (transposed)
    and v_b, one matrix a head."""
    nope, v_head = config["qk_nope_head_dim"], config["v_head_dim"]
    kv_b = data.reshape(config["num_key_value_heads"], nope + v_head, data.shape[-1])
    yield name.replace("kv_b_proj", "k_b_proj"), kv_b[:, :nope].transpose(0, 2, 1)
    yield name.replace("kv_b_proj", "v_b_proj"), kv_b[:, nope:]


def _qtype(name: str, data: np.ndarray) -> gguf.GGMLQuantizationType:
    """The converter's type for an F16 file: F32 for vectors, norms, biases and the MoE
    router; F16 for the other matrices."""
    router = name.endswith(".ffn_gate_inp.weight")
    if data.ndim <= 1 or name.endswith("_norm.weight") or router or not name.endswith(".weight"):
        return gguf.GGMLQuantizationType.F32
    return gguf.GGMLQuantizationType.F16


def _add_model_card(writer: gguf.GGUFWriter, model_dir: Path) -> None:
    """general.name (from the directory's name) and general.size_label, as the converter
    writes them: labels llama.cpp shows, never reads."""
    total_params, shared_params, expert_params, expert_count = writer.get_total_parameter_count()
    metadata = gguf.Metadata.load(None, model_dir, None, total_params)
    metadata.name = metadata.name or model_dir.name
    metadata.size_label = gguf.size_label(total_params, shared_params, expert_params,
                                          expert_count)
    metadata.set_gguf_meta_model(writer)


def _add_hyperparameters(writer: gguf.GGUFWriter, config: dict[str, Any],
                         arch: gguf.MODEL_ARCH) -> None:
    """The converter's keys for these configs, in its order (TextModel's, then the
    family's)."""
    deepseek = arch == gguf.MODEL_ARCH.DEEPSEEK2
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    # MLA runs as one key-value head of the latent, decompressed per head.
    writer.add_head_count_kv(1 if deepseek else config["num_key_value_heads"])
    # The converter writes scaling keys for the other rope types, which these configs lack.
    assert config["rope_parameters"]["rope_type"] == "default", config["rope_parameters"]
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if deepseek:
        writer.add_expert_count(config["n_routed_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_group_count(config["n_group"])
        writer.add_expert_group_used_count(config["topk_group"])
        # The latent is MQA's key and value; the rotary part rides along with the key.
        writer.add_key_length(config["kv_lora_rank"] + config["qk_rope_head_dim"])
        writer.add_value_length(config["kv_lora_rank"])
    elif "head_dim" in config:
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if arch == gguf.MODEL_ARCH.LLAMA:
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(config["head_dim"])
    elif deepseek:
        writer.add_leading_dense_block_count(config["first_k_dense_replace"])
        writer.add_vocab_size(config["vocab_size"])
        writer.add_q_lora_rank(config["q_lora_rank"])
        writer.add_kv_lora_rank(config["kv_lora_rank"])
        writer.add_key_length_mla(config["qk_nope_head_dim"] + config["qk_rope_head_dim"])
        writer.add_value_length_mla(config["v_head_dim"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_count(config["n_shared_experts"])
        writer.add_expert_weights_scale(config["routed_scaling_factor"])
        if config["norm_topk_prob"]:
            writer.add_expert_weights_norm(True)
        writer.add_rope_dimension_count(config["qk_rope_head_dim"])


def _add_vocabulary(writer: gguf.GGUFWriter, model_dir: Path, config: dict[str, Any],
                    arch: gguf.MODEL_ARCH, pre_tokenizer: str) -> None:
    """The converter's GPT-2 (byte-level BPE) vocabulary of the checkpoint's tokenizer."""
    tokens, token_types = _tokens(model_dir, config["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    gguf.SpecialVocab(model_dir, load_merges=True).add_to_gguf(writer, quiet=True)
    if arch == gguf.MODEL_ARCH.LLAMA and config["vocab_size"] == GRANITE_SMALL_VOCAB:
        writer.add_add_bos_token(False)


# The files transformers reads a tokenizer from.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json")
# Each tokenizer's token list (_tokens) by its files' digest and the vocabulary's size: the
# tiny models share SmolLM2's tokenizer, which transformers takes 0.3 CPU-seconds to load.
_TOKENS: dict[tuple[str, int], tuple[list[str], list[int]]] = {}


def _tokens(model_dir: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """Each token id's text and type as the converter lists them (its get_vocab_base):
    added tokens that are special, or look it, are control tokens."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            digest.update(name.encode() + b"\0" + (model_dir / name).read_bytes())
    key = (digest.hexdigest(), vocab_size)
    if key not in _TOKENS:
        _TOKENS[key] = _read_tokens(model_dir, vocab_size)
    return _TOKENS[key]


def _read_tokens(model_dir: Path, vocab_size: int) -> tuple[list[str], list[int]]:
    """_tokens, from the tokenizer itself."""
    from transformers import AutoTokenizer

    tokenizer: Any = AutoTokenizer.from_pretrained(model_dir)
    by_id = {id_: token for token, id_ in tokenizer.vocab.items()}
    added = tokenizer.get_added_vocab()
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        token = by_id.get(i)
        if token is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        if token in added:
            decoder = tokenizer.added_tokens_decoder[i]
            if not decoder.normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if decoder.special or _looks_special(token):
                types.append(gguf.TokenType.CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types


def _looks_special(token: str) -> bool:
    """Whether an added token not marked special is a control token all the same (the
    converter's does_token_look_special: command-r, deepseek-coder and gemma mark some so)."""
    return (token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
            or (token.startswith("<|") and token.endswith("|>"))
            or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
            or (token.startswith("<unused") and token.endswith(">")))
