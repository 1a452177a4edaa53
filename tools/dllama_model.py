"""Random-weight models in distributed-llama's own format, written directly.

distributed-llama (b4rtaz/distributed-llama) reads a `.m` model file and a `.t`
tokenizer file. Its converter builds them from a Hugging Face checkpoint,
which for the shapes the bench compares on would mean a random fp32
checkpoint of 30-120 GB first. This writes the same files straight from a
named shape, the weights as random Q40 blocks, in seconds to minutes.

The layout follows distributed-llama's converter/writer.py, convert-hf.py and
tokenizer-writer.py, and the order in which src/llm.cpp (`loadLlmNetWeight`)
and src/tokenizer.cpp read them:

    .m: int magic 0xA00ABCD, int header size, (key, value) int pairs, then the
        token embedding (F32), per layer q, k, v, wo, [moe gate (F32), per
        expert w1 (gate), w2 (down), w3 (up)] or w1, w2, w3, [q-norm, k-norm
        (Qwen3)], attention norm, ffn norm (F32); final norm (F32), logits.
    .t: int magic 0x567124, int header size, (key, value) int pairs, the EOS
        ids, then per token: float score, uint length, bytes.

Usage: python tools/dllama_model.py SHAPE DEST_DIR   (SHAPE: llama3-8b, qwen3-30b-a3b, tiny)
"""

from __future__ import annotations

import argparse
import itertools
import string
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

MODEL_MAGIC = 0xA00ABCD
TOKENIZER_MAGIC = 0x567124
TOKENIZER_VERSION = 1
# distributed-llama's header keys (converter/writer.py, writeHeader).
MODEL_KEYS = {
    "version": 0, "arch_type": 1, "dim": 2, "hidden_dim": 3, "n_layers": 4, "n_heads": 5,
    "n_kv_heads": 6, "n_experts": 7, "n_active_experts": 8, "vocab_size": 9,
    "max_seq_len": 10, "hidden_act": 11, "rope_theta": 12, "weights_float_type": 13,
    "head_dim": 19, "norm_epsilon": 20, "moe_hidden_dim": 21,
}
# converter/tokenizer-writer.py's keys.
TOKENIZER_KEYS = {"version": 0, "vocab_size": 1, "max_token_length": 2, "bos_id": 3,
                  "n_eos_tokens": 9, "add_bos": 10}
ARCH_LLAMA = 0xABCD00
ARCH_QWEN3_MOE = 0xABCD02
HIDDEN_ACT_SILU = 1
FLOAT_Q40 = 2
# convert-hf.py stores the norm epsilon as its negative exponent: 5 is 1e-5.
EPSILON_1E5 = 5
EPSILON_1E6 = 6
# A Q40 block: an f16 scale and 32 4-bit values.
Q40_BLOCK = 32
Q40_BLOCK_BYTES = 18
# Weights are d * (q - 8) with q uniform in 0..15: a standard deviation of ~4.6 d.
# d = 0.0035 keeps a 4096-wide dot product of unit inputs near 1, so random
# activations neither vanish nor overflow through the layers.
Q40_SCALE = 0.0035
EMBEDDING_STD = 0.02
# Rows of a matrix generated at once: bounds this writer's memory whatever the shape.
CHUNK_VALUES = 1 << 26


@dataclass(frozen=True)
class Shape:
    """A model shape as distributed-llama's header describes it."""

    arch: int
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    bos_id: int
    eos_ids: tuple[int, ...]
    add_bos: bool
    max_seq_len: int
    rope_theta: int
    norm_epsilon: int
    head_dim: int | None = None
    n_experts: int = 0
    n_active_experts: int = 0
    moe_hidden_dim: int = 0

    @property
    def q_dim(self) -> int:
        return self.n_heads * (self.head_dim or self.dim // self.n_heads)

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * (self.head_dim or self.dim // self.n_heads)

    def header(self) -> dict[str, int]:
        values = {"version": 0, "arch_type": self.arch, "dim": self.dim,
                  "hidden_dim": self.hidden_dim, "n_layers": self.n_layers,
                  "n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads,
                  "n_experts": self.n_experts, "n_active_experts": self.n_active_experts,
                  "vocab_size": self.vocab, "max_seq_len": self.max_seq_len,
                  "hidden_act": HIDDEN_ACT_SILU, "rope_theta": self.rope_theta,
                  "weights_float_type": FLOAT_Q40, "norm_epsilon": self.norm_epsilon}
        if self.head_dim is not None:
            values["head_dim"] = self.head_dim
        if self.n_experts:
            values["moe_hidden_dim"] = self.moe_hidden_dim
        return values


# Hyperparameters from each family's config.json on the Hugging Face Hub.
SHAPES = {
    "llama3-8b": Shape(arch=ARCH_LLAMA, dim=4096, hidden_dim=14336, n_layers=32, n_heads=32,
                       n_kv_heads=8, vocab=128256, bos_id=128000, eos_ids=(128001, 128009),
                       add_bos=True, max_seq_len=8192, rope_theta=500000,
                       norm_epsilon=EPSILON_1E5),
    "qwen3-30b-a3b": Shape(arch=ARCH_QWEN3_MOE, dim=2048, hidden_dim=6144, n_layers=48,
                           n_heads=32, n_kv_heads=4, head_dim=128, vocab=151936,
                           bos_id=151643, eos_ids=(151645,), add_bos=False,
                           max_seq_len=40960, rope_theta=1000000, norm_epsilon=EPSILON_1E6,
                           n_experts=128, n_active_experts=8, moe_hidden_dim=768),
    # For checking the writer against distributed-llama in seconds.
    "tiny": Shape(arch=ARCH_LLAMA, dim=256, hidden_dim=512, n_layers=2, n_heads=8,
                  n_kv_heads=4, vocab=32000, bos_id=31900, eos_ids=(31901,), add_bos=True,
                  max_seq_len=1024, rope_theta=10000, norm_epsilon=EPSILON_1E5),
}


def tensor_plan(shape: Shape) -> list[tuple[str, int, bool]]:
    """(name, values, quantized) of every tensor, in the order llm.cpp reads them."""
    ff = shape.moe_hidden_dim if shape.n_experts else shape.hidden_dim
    plan = [("embedding", shape.vocab * shape.dim, False)]
    for layer in range(shape.n_layers):
        plan += [(f"{layer}.q", shape.dim * shape.q_dim, True),
                 (f"{layer}.k", shape.dim * shape.kv_dim, True),
                 (f"{layer}.v", shape.dim * shape.kv_dim, True),
                 (f"{layer}.wo", shape.q_dim * shape.dim, True)]
        experts = [f"{layer}.expert{e}." for e in range(shape.n_experts)] or [f"{layer}."]
        if shape.n_experts:
            plan.append((f"{layer}.moe_gate", shape.dim * shape.n_experts, False))
        for prefix in experts:
            plan += [(prefix + name, shape.dim * ff, True) for name in ("w1", "w2", "w3")]
        if shape.arch == ARCH_QWEN3_MOE:
            head_dim = shape.head_dim or shape.dim // shape.n_heads
            plan += [(f"{layer}.q_norm", head_dim, False), (f"{layer}.k_norm", head_dim, False)]
        plan += [(f"{layer}.norm0", shape.dim, False), (f"{layer}.norm1", shape.dim, False)]
    return [*plan, ("final_norm", shape.dim, False), ("logits", shape.vocab * shape.dim, True)]


def model_bytes(shape: Shape) -> int:
    body = sum(values // Q40_BLOCK * Q40_BLOCK_BYTES if quantized else values * 4
               for _, values, quantized in tensor_plan(shape))
    return 8 + 8 * len(shape.header()) + body


def _header(magic: int, pairs: list[tuple[int, int]]) -> bytes:
    # The size counts magic and size themselves (writer.py: len(header) * 2 + len(data)).
    data = b"".join(struct.pack("ii", key, value) for key, value in pairs)
    return struct.pack("ii", magic, 8 + len(data)) + data


def _write_q40(out: BinaryIO, values: int, rng: np.random.Generator) -> None:
    scale = np.array([Q40_SCALE], np.float16).view(np.uint8)
    for start in range(0, values, CHUNK_VALUES):
        blocks = rng.integers(0, 256, (min(CHUNK_VALUES, values - start) // Q40_BLOCK,
                                       Q40_BLOCK_BYTES), dtype=np.uint8)
        blocks[:, 0:2] = scale
        out.write(blocks.tobytes())


def _write_f32(out: BinaryIO, name: str, values: int, rng: np.random.Generator) -> None:
    if "norm" in name:  # RMS norm weights: ones, as a fresh model's
        out.write(np.ones(values, np.float32).tobytes())
        return
    for start in range(0, values, CHUNK_VALUES):
        count = min(CHUNK_VALUES, values - start)
        out.write((rng.standard_normal(count, np.float32) * EMBEDDING_STD).tobytes())


def write_model(shape: Shape, path: Path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    plan = tensor_plan(shape)
    if any(quantized and values % Q40_BLOCK for _, values, quantized in plan):
        raise ValueError("every quantized tensor must hold whole Q40 blocks")
    with path.open("wb") as out:
        out.write(_header(MODEL_MAGIC, [(MODEL_KEYS[k], v) for k, v in shape.header().items()]))
        for name, values, quantized in plan:
            if quantized:
                _write_q40(out, values, rng)
            else:
                _write_f32(out, name, values, rng)
    if path.stat().st_size != model_bytes(shape):
        raise AssertionError(f"{path} holds {path.stat().st_size} bytes, not "
                             f"{model_bytes(shape)}")


def vocabulary(shape: Shape) -> list[bytes]:
    """Regular tokens below bos_id (every byte, printable pairs and lowercase triples, then
    filler words), special tokens from bos_id on: a prompt splits and merges as in a BPE
    vocabulary, into a realistic number of tokens."""
    printable = [c.encode() for c in string.printable[:95]]
    lower = [c.encode() for c in string.ascii_lowercase]
    regular: list[bytes] = [bytes([b]) for b in range(1, 256)]
    regular += [a + b for a, b in itertools.product(printable, repeat=2)]
    regular += [a + b + c for a, b, c in itertools.product(lower, repeat=3)]
    seen = set(regular)
    regular = list(dict.fromkeys(regular))
    filler = (f"<w{index}>".encode() for index in itertools.count())
    while len(regular) < shape.bos_id:
        word = next(filler)
        if word not in seen:
            regular.append(word)
    special = [f"<|special_{index}|>".encode() for index in range(shape.vocab - shape.bos_id)]
    return regular[:shape.bos_id] + special


def write_tokenizer(shape: Shape, path: Path) -> None:
    tokens = vocabulary(shape)
    pairs = [("bos_id", shape.bos_id), ("version", TOKENIZER_VERSION),
             ("vocab_size", len(tokens)), ("max_token_length", max(map(len, tokens))),
             ("n_eos_tokens", len(shape.eos_ids)), ("add_bos", int(shape.add_bos))]
    with path.open("wb") as out:
        out.write(_header(TOKENIZER_MAGIC, [(TOKENIZER_KEYS[k], v) for k, v in pairs]))
        out.write(struct.pack(f"{len(shape.eos_ids)}i", *shape.eos_ids))
        for token in tokens:
            # Longer tokens merge first, as a BPE vocabulary's scores order them.
            out.write(struct.pack("fI", float(len(token)), len(token)) + token)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("dest", type=Path, help="directory for model.m and tokenizer.t")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    args.dest.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    write_tokenizer(shape, args.dest / "tokenizer.t")
    print(f"writing {args.dest / 'model.m'}: {model_bytes(shape) / 2**30:.2f} GiB", flush=True)
    write_model(shape, args.dest / "model.m", args.seed)
    print(f"done in {time.monotonic() - started:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
