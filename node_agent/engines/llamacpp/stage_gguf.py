"""A stage's GGUF: layers [first, end) of the model's GGUF, as a model llama.cpp loads by itself.

The blocks are copied as shipped (Q4_0, Q4_K, Q8_0, F16, ... whatever the file
holds; nothing is dequantized), renumbered from 0, with `{arch}.block_count`
set to end - first. What else a stage keeps depends on where it sits:

| stage  | keeps |
| ---    | ---   |
| first  | the token embedding and the tokenizer; no LM head (`output.weight`) |
| middle | no tokenizer, and the embedding and LM head cut to VOCAB_KEEP rows |
| last   | the final norm, the LM head and the tokenizer |
| whole  | the model's own file, not a copy |

llama.cpp insists on a token embedding and a vocabulary in every model, so
a middle stage keeps VOCAB_KEEP rows of each: a few KiB instead of the
vocabulary's tens of MiB, and no logits buffer worth the name.

Stage files are cut once and cached in `$EDGEBUS_HOME/stages/` (CACHE_DIR),
named by the source file's digest, the range, the role and llama-cpp-python's
version (whose llama.cpp reads them). Not beside the source: a plant may name
a GGUF in a directory the agents cannot write (a package's, or one the
systemd units keep read-only), and the digest in the name keeps the files of
different models apart. A file is written under a temporary name and renamed
into place, so a crash never leaves a half-cut file that looks usable.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

import gguf

from edgebus.errors import EngineError
from edgebus.model_import import edgebus_home
from node_agent import gguf_model

CACHE_DIR = "stages"  # under $EDGEBUS_HOME
# Rows of the embedding and LM head a middle stage keeps: llama.cpp wants both
# tensors and a vocabulary, and 32 rows are enough for it to load.
VOCAB_KEEP = 32
# Bump when the files cut here change meaning, so cached ones are cut again.
CUT_FORMAT = 1
# Metadata key recording which layers of the source a stage file holds.
RANGE_KEY = "edgebus.layer_range"
# Read 8 MiB at a time while hashing a source GGUF: past a few MiB a larger
# read is no faster, and a 1.3B model is hashed in about a second.
_HASH_CHUNK = 8 * 2**20
_BLOCK = re.compile(r"^blk\.(\d+)\.(.*)$")


def stage_file(source: Path, first: int, end: int, *, library_version: str,
               cache: Path | None = None) -> Path:
    """The GGUF of layers [first, end) of `source`, cut now or found in `cache` (default
    `$EDGEBUS_HOME/stages`)."""
    layers = gguf_model.read_config(source).num_hidden_layers
    if not 0 <= first < end <= layers:
        raise EngineError(f"layers [{first}, {end}) are not within the {layers} "
                          f"layers of {source}: fix `layers:` in the plant file")
    role = _role(first, end, layers)
    if role == "whole":
        return source
    cache = edgebus_home() / CACHE_DIR if cache is None else cache
    name = (f"{_digest(source, cache)[:16]}.{first}-{end}.{role}.llama-cpp-{library_version}"
            f".v{CUT_FORMAT}.gguf")
    target = cache / name
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    staging = cache / f".{name}.{uuid.uuid4().hex}.tmp"
    try:
        _cut(source, staging, first, end, role)
        os.replace(staging, target)
    finally:
        staging.unlink(missing_ok=True)
    return target


def _role(first: int, end: int, layers: int) -> str:
    if first == 0:
        return "whole" if end == layers else "first"
    return "last" if end == layers else "middle"


def _reader(path: Path) -> gguf.GGUFReader:
    try:
        return gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise EngineError(f"cannot read {path} as a GGUF file ({exc}): is it a complete "
                          "GGUF model?") from exc


def _digest(path: Path, cache: Path) -> str:
    """sha256 of the file, remembered in `cache` for as long as its path, size and mtime
    hold."""
    stat = path.stat()
    where = str(path.resolve())
    memo = cache / f"{hashlib.sha256(where.encode()).hexdigest()[:16]}.sha256.json"
    key = {"path": where, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    try:
        known = json.loads(memo.read_text())
        if known["file"] == key:
            return str(known["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    memo.parent.mkdir(parents=True, exist_ok=True)
    # Renamed into place: a stage hashing the same file at once never reads half of it.
    staging = memo.with_name(f".{memo.name}.{uuid.uuid4().hex}.tmp")
    try:
        staging.write_text(json.dumps({"file": key, "sha256": digest.hexdigest()}))
        os.replace(staging, memo)
    finally:
        staging.unlink(missing_ok=True)
    return digest.hexdigest()


def _stage_value(value: Any, name: str, arch: str, first: int, end: int, layers: int) -> Any:
    """A metadata value as the stage file must say it: counted in the stage's own layers."""
    if name == f"{arch}.block_count":
        return end - first
    if name == f"{arch}.leading_dense_block_count":  # DeepSeek: dense layers before the MoE ones
        return min(max(int(value) - first, 0), end - first)
    # Per-layer values (head counts, sliding-window patterns, ...) of the model's own keys.
    if name.startswith(f"{arch}.") and isinstance(value, list) and len(value) == layers:
        return value[first:end]
    return value


def _cut(source: Path, dest: Path, first: int, end: int, role: str) -> None:
    reader = _reader(source)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    middle = role == "middle"
    layers = int(reader.fields[f"{arch}.block_count"].contents())
    writer = gguf.GGUFWriter(str(dest), arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        name = field.name
        if name == gguf.Keys.General.ARCHITECTURE or name.startswith("GGUF."):
            continue  # the writer adds these itself
        if middle and (name.startswith("tokenizer.") or name == f"{arch}.vocab_size"):
            continue
        value = _stage_value(field.contents(), name, arch, first, end, layers)
        kind = field.types[0]
        writer.add_key_value(name, value, kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY
                             else None)
    if middle:
        writer.add_key_value("tokenizer.ggml.model", "none", gguf.GGUFValueType.STRING)
        writer.add_key_value(f"{arch}.vocab_size", VOCAB_KEEP, gguf.GGUFValueType.UINT32)
    writer.add_key_value(RANGE_KEY, [first, end], gguf.GGUFValueType.ARRAY,
                         sub_type=gguf.GGUFValueType.UINT32)
    kept = []
    for tensor in reader.tensors:
        data, name = tensor.data, tensor.name
        block = _BLOCK.match(name)
        if block:
            layer = int(block.group(1))
            if not first <= layer < end:
                continue
            name = f"blk.{layer - first}.{block.group(2)}"
        elif role == "first" and name == "output.weight":
            continue  # the first stage stops before the LM head
        elif middle and name in ("token_embd.weight", "output.weight"):
            data = data[:VOCAB_KEEP]  # rows are numpy's outermost axis
        kept.append((name, data, tensor.tensor_type))
    for name, data, quant in kept:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in kept:
        writer.write_tensor_data(data)
    writer.close()
