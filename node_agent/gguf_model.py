"""A GGUF file named as a plant's model: its shape, end ids and tensor bytes, from its metadata.

A plant whose stages all run llama.cpp may set `model:` to a `.gguf` file
instead of an imported model directory (docs/plant-file.md). What the agents,
the plant checks, `edgebus init` and `edgebus plan` need of the model then
comes from the file's header, walked here with gguf-py's key names and type
codes (no torch, no transformers, no llama.cpp, nothing dequantized):

- `read_config`: the numbers config.json would hold, under transformers'
  names (`hidden_size`, `num_key_value_heads`, `kv_lora_rank`, ...), so
  `model_config.load_config` hands out the same object either way;
- `end_ids`: the ids generation stops on, what generation_config.json holds;
- `part_bytes`: the bytes of each layer's tensors, of the token embedding and
  of the final norm + LM head, as the file stores them.

What is read of a file is kept per path, size and mtime, since the plant
checks, the engine and the coordinator each ask.
"""

from __future__ import annotations

import collections
import functools
import math
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf

from edgebus.core.errors import CheckpointError

EMBEDDING, HEAD = "embedding", "head"
_BLOCK = re.compile(r"^blk\.(\d+)\.")
# The tensors outside the layers that belong to the embedding; every other one (the final
# norm, the LM head) is computed after the last layer.
_EMBEDDING_TENSORS = ("token_embd.", "token_embd_norm.")
_LM_HEAD = "output.weight"


def read_config(path: Path) -> SimpleNamespace:
    """The model's shape, under the names transformers' config.json gives it (see the
    module doc); the fields edgebus reads, and the few more a reader of config.json expects."""
    fields = _fields(path)
    if gguf.Keys.General.ARCHITECTURE not in fields:
        raise CheckpointError(f"{path} names no {gguf.Keys.General.ARCHITECTURE}: not a "
                              "model GGUF")
    arch = str(fields[gguf.Keys.General.ARCHITECTURE])

    def value(key: str, default: Any = None) -> Any:
        return fields.get(key.format(arch=arch), default)

    layers = value(gguf.Keys.LLM.BLOCK_COUNT)
    hidden = value(gguf.Keys.LLM.EMBEDDING_LENGTH)
    heads = _widest(value(gguf.Keys.Attention.HEAD_COUNT))
    if not isinstance(layers, int) or not isinstance(hidden, int) or not heads:
        raise CheckpointError(f"{path} names no {arch}.block_count, embedding_length and "
                              "attention.head_count: it is not a decoder-only model GGUF "
                              "llama.cpp runs")
    tokens = fields.get(gguf.Keys.Tokenizer.LIST)
    vocab = value(gguf.Keys.LLM.VOCAB_SIZE,
                  tokens.count if isinstance(tokens, _StringArray) else None)
    if not isinstance(vocab, int):
        raise CheckpointError(f"{path} holds no vocabulary ({arch}.vocab_size or "
                              f"{gguf.Keys.Tokenizer.LIST}): a plant's model needs its tokenizer")
    config: dict[str, Any] = {
        "model_type": arch,
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        # Per-layer counts (a list in some architectures): the widest layer, so what the
        # KV sizing books from it is never less than llama.cpp allocates.
        "num_key_value_heads": _widest(value(gguf.Keys.Attention.HEAD_COUNT_KV, heads)),
        "head_dim": value(gguf.Keys.Attention.KEY_LENGTH, hidden // heads),
        "intermediate_size": _widest(value(gguf.Keys.LLM.FEED_FORWARD_LENGTH)),
        "vocab_size": vocab,
        "max_position_embeddings": value(gguf.Keys.LLM.CONTEXT_LENGTH),
        "rms_norm_eps": value(gguf.Keys.Attention.LAYERNORM_RMS_EPS),
        "rope_theta": value(gguf.Keys.Rope.FREQ_BASE),
        "tie_word_embeddings": _LM_HEAD not in _tensor_bytes(path),
    }
    kv_lora_rank = value(gguf.Keys.Attention.KV_LORA_RANK)
    if kv_lora_rank:  # multi-head latent attention (DeepSeek-V2/V3: llama.cpp's deepseek2)
        rope = value(gguf.Keys.Rope.DIMENSION_COUNT)
        key = value(gguf.Keys.Attention.KEY_LENGTH_MLA, value(gguf.Keys.Attention.KEY_LENGTH))
        # A converter that writes the *_mla lengths stores attention llama.cpp's absorbed
        # way (one KV head of kv_lora_rank + rope); transformers' config names the per-head
        # shapes, with as many KV heads as query heads and head_dim the rotary part.
        config.update(kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope, head_dim=rope,
                      num_key_value_heads=heads,
                      q_lora_rank=value(gguf.Keys.Attention.Q_LORA_RANK) or None,
                      qk_nope_head_dim=key - rope, qk_head_dim=key,
                      v_head_dim=value(gguf.Keys.Attention.VALUE_LENGTH_MLA,
                                       value(gguf.Keys.Attention.VALUE_LENGTH)))
    experts = value(gguf.Keys.LLM.EXPERT_COUNT)
    if experts:
        config.update(n_routed_experts=experts,
                      num_experts_per_tok=value(gguf.Keys.LLM.EXPERT_USED_COUNT),
                      n_shared_experts=value(gguf.Keys.LLM.EXPERT_SHARED_COUNT),
                      moe_intermediate_size=value(gguf.Keys.LLM.EXPERT_FEED_FORWARD_LENGTH),
                      first_k_dense_replace=value(gguf.Keys.LLM.LEADING_DENSE_BLOCK_COUNT, 0))
    return SimpleNamespace(**config)


def end_ids(path: Path) -> int | list[int] | None:
    """The ids generation stops on, as generation_config.json's `eos_token_id` gives them:
    the GGUF's end-of-sequence id, and its end-of-turn and end-of-message ids where it names
    them (llama.cpp reads all three as end of generation)."""
    fields = _fields(path)
    ids = list(dict.fromkeys(
        value for key in (gguf.Keys.Tokenizer.EOS_ID, gguf.Keys.Tokenizer.EOT_ID,
                          gguf.Keys.Tokenizer.EOM_ID)
        if isinstance(value := fields.get(key), int)))
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def special_token_ids(path: Path) -> dict[str, int]:
    """The ids of the special tokens the GGUF names, under transformers' names for them
    (`bos_token`, `eos_token`, ...), which a chat template sees their texts by."""
    fields = _fields(path)
    return {name: value for name, key in _SPECIAL_TOKENS
            if isinstance(value := fields.get(key), int)}


def part_bytes(path: Path) -> dict[str | int, int]:
    """Bytes of each layer (by index), of EMBEDDING and of HEAD (final norm and LM head) in
    the GGUF at `path`, as shipped. A tied head is the embedding's matrix, so it counts
    there and in HEAD: the first and the last stage each hold it."""
    parts: dict[str | int, int] = collections.defaultdict(int)
    tensors = _tensor_bytes(path)
    for name, size in tensors.items():
        block = _BLOCK.match(name)
        part: str | int = (int(block.group(1)) if block
                           else EMBEDDING if name.startswith(_EMBEDDING_TENSORS) else HEAD)
        parts[part] += size
    if _LM_HEAD not in tensors:
        parts[HEAD] += tensors.get("token_embd.weight", 0)
    return dict(parts)


def _identity(path: Path) -> tuple[str, int, int]:
    """(path, size, mtime): what the caches below are keyed by, so a replaced file is read
    again."""
    try:
        stat = Path(path).stat()
    except OSError as exc:
        raise CheckpointError(f"cannot read the model's GGUF {path}: {exc}") from exc
    return str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns


# A plant names one model; tests and tools a few. Each entry holds the file's metadata
# (its vocabulary: a few MiB for a large one), so a handful is the bound.
_CACHED_FILES = 4


@functools.lru_cache(maxsize=_CACHED_FILES)
def _read(path: str, _size: int, _mtime_ns: int) -> tuple[dict[str, Any], dict[str, int]]:
    """(metadata values by key, bytes of each tensor by name), from the file's header.

    gguf-py's GGUFReader would do, but it builds an array per vocabulary entry
    and took 6-7 s for SmolLM2's header on this loaded 2-core box, which every
    `load_plant` would pay: this walks the header once, keeping the string
    arrays (the vocabulary, the merges) only as their lengths.
    """
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _Header(data, path).read()
    except (OSError, ValueError, struct.error) as exc:
        raise CheckpointError(f"cannot read {path} as a GGUF file ({exc}): is it a complete "
                              "GGUF model?") from exc


class _Header:
    """A walk through a GGUF header (GGUF v2/v3: docs/gguf.md of ggml)."""

    def __init__(self, data: mmap.mmap, path: str, *, strings: bool = False) -> None:
        self.data, self.offset, self.path, self.strings = data, 0, path, strings
        if data[:4] != _MAGIC:
            raise ValueError("no GGUF magic at its start")
        # A big-endian file's version reads as a huge number little-endian (as gguf-py tells).
        version = struct.unpack_from("<I", data, 4)[0]
        self.order = "<" if version & 0xFFFF else ">"
        version = struct.unpack_from(self.order + "I", data, 4)[0]
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version {version}, where llama.cpp reads versions "
                             f"{' and '.join(map(str, _VERSIONS))}")
        self.offset = 8

    def take(self, fmt: str) -> Any:
        values = struct.unpack_from(self.order + fmt, self.data, self.offset)
        self.offset += struct.calcsize(self.order + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.take("Q")
        text = bytes(self.data[self.offset:self.offset + length]).decode("utf-8", "replace")
        self.offset += length
        return text

    def skip_strings(self, count: int) -> None:
        """Step over `count` strings, each its 64-bit length and its bytes."""
        length = struct.Struct(self.order + "Q").unpack_from
        data, offset = self.data, self.offset
        for _ in range(count):
            offset += _LENGTH_BYTES + length(data, offset)[0]
        self.offset = offset

    def value(self, kind: int) -> Any:
        if kind == gguf.GGUFValueType.STRING:
            return self.string()
        if kind == gguf.GGUFValueType.ARRAY:
            item, count = self.take("I"), self.take("Q")
            if item == gguf.GGUFValueType.STRING:
                if self.strings:
                    return [self.string() for _ in range(count)]
                self.skip_strings(count)  # skipped, not decoded: see _read
                return _StringArray(count)
            if item == gguf.GGUFValueType.ARRAY:
                return [self.value(item) for _ in range(count)]
            # A vocabulary's scores and token types, in one unpack rather than one call an
            # entry: a walk of SmolLM2's header took 0.11 s of CPU at every stage's start.
            fmt = f"{self.order}{count}{SCALARS[gguf.GGUFValueType(item)]}"
            values = struct.unpack_from(fmt, self.data, self.offset)
            self.offset += struct.calcsize(fmt)
            return [bool(v) for v in values] if item == gguf.GGUFValueType.BOOL else list(values)
        value = self.take(SCALARS[gguf.GGUFValueType(kind)])
        return bool(value) if kind == gguf.GGUFValueType.BOOL else value

    def read(self) -> tuple[dict[str, Any], dict[str, int]]:
        layout = self.layout()
        fields = {entry.key: entry.value for entry in layout.entries}
        tensors = {}
        for info in layout.tensors:
            block, block_bytes = gguf.GGML_QUANT_SIZES[info.kind]
            tensors[info.name] = math.prod(info.dims) // block * block_bytes
        return fields, tensors

    def layout(self) -> Layout:
        tensor_count, kv_count = self.take("Q"), self.take("Q")
        entries = []
        for _ in range(kv_count):
            start = self.offset
            key = self.string()
            kind = self.take("I")
            value = self.value(kind)
            entries.append(Entry(key, gguf.GGUFValueType(kind), value, start, self.offset))
        tensors = []
        for _ in range(tensor_count):
            name = self.string()
            dims = tuple(self.take("Q") for _ in range(self.take("I")))
            kind = gguf.GGMLQuantizationType(self.take("I"))
            tensors.append(TensorInfo(name, dims, kind, self.take("Q")))
        alignment = next((int(e.value) for e in entries
                          if e.key == gguf.Keys.General.ALIGNMENT), gguf.GGUF_DEFAULT_ALIGNMENT)
        data_start = -self.offset % alignment + self.offset
        return Layout(self.order, entries, tensors, alignment, data_start)


@dataclass(frozen=True)
class Entry:
    """A key-value pair of a GGUF header, with where its bytes lie in the file."""

    key: str
    kind: gguf.GGUFValueType
    value: Any  # string arrays by their length only (_StringArray), unless walked with `strings`
    start: int
    end: int


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: the contiguous axis first
    kind: gguf.GGMLQuantizationType
    offset: int  # from the start of the data


@dataclass(frozen=True)
class Layout:
    """A GGUF file's header as written: byte order ("<" or ">"), key-value pairs, tensor infos,
    the data's alignment and where the data starts."""

    order: str
    entries: list[Entry]
    tensors: list[TensorInfo]
    alignment: int
    data_start: int


def layout(path: Path, *, strings: bool = False) -> Layout:
    """The header of the GGUF at `path`, walked without decoding its string arrays (a
    vocabulary of 100k tokens is read in a fraction of a second, where gguf-py's reader
    takes many); `strings`: decoded as lists of str (a tenth of a second for SmolLM2's)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _Header(data, str(path), strings=strings).layout()
    except (OSError, ValueError, struct.error) as exc:
        raise CheckpointError(f"cannot read {path} as a GGUF file ({exc}): is it a complete "
                              "GGUF model?") from exc


@dataclass(frozen=True)
class _StringArray:
    """A string array of the header, by its length only (see _read)."""

    count: int


_MAGIC = b"GGUF"
# A string's length before its bytes: a uint64 in GGUF v2 and v3.
_LENGTH_BYTES = 8
# Version 1 counted lengths in 32 bits; llama.cpp reads only these.
_VERSIONS = (2, 3)
# transformers' names of special tokens, and the GGUF keys of their ids.
_SPECIAL_TOKENS = (("bos_token", gguf.Keys.Tokenizer.BOS_ID),
                   ("eos_token", gguf.Keys.Tokenizer.EOS_ID),
                   ("unk_token", gguf.Keys.Tokenizer.UNK_ID),
                   ("sep_token", gguf.Keys.Tokenizer.SEP_ID),
                   ("pad_token", gguf.Keys.Tokenizer.PAD_ID),
                   ("mask_token", gguf.Keys.Tokenizer.MASK_ID))
SCALARS = {gguf.GGUFValueType.UINT8: "B", gguf.GGUFValueType.INT8: "b",
            gguf.GGUFValueType.UINT16: "H", gguf.GGUFValueType.INT16: "h",
            gguf.GGUFValueType.UINT32: "I", gguf.GGUFValueType.INT32: "i",
            gguf.GGUFValueType.FLOAT32: "f", gguf.GGUFValueType.BOOL: "?",
            gguf.GGUFValueType.UINT64: "Q", gguf.GGUFValueType.INT64: "q",
            gguf.GGUFValueType.FLOAT64: "d"}


def _fields(path: Path) -> dict[str, Any]:
    return _read(*_identity(path))[0]


def _tensor_bytes(path: Path) -> dict[str, int]:
    return _read(*_identity(path))[1]


def _widest(value: Any) -> Any:
    return max(value) if isinstance(value, list) and value else value
