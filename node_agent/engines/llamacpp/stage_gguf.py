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

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import time
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
# Tensor bytes copied per call: bounds what a cut holds in memory where the kernel cannot copy
# (one buffer of this size) and how often progress is counted; past a few MiB a larger copy
# is no faster.
COPY_CHUNK = 16 * 2**20
# Seconds between progress lines on a long cut (minutes for a 9 GB model on an SD card).
PROGRESS_S = 5.0

log = logging.getLogger(__name__)


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
        _cut(source, staging, first, end, role,
             what=f"layers [{first}, {end}) of {source.name} into {target}")
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


def _cut(source: Path, dest: Path, first: int, end: int, role: str, *,
         chunk: int = COPY_CHUNK, what: str = "") -> None:
    """Write the stage file: metadata and tensor infos through gguf-py's writer, then each
    kept tensor's bytes copied from `source` `chunk` bytes at a time (copy_file_range, else
    read into one buffer), so memory holds no tensor, however large the model."""
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
    q_lora = gguf.Keys.Attention.Q_LORA_RANK.format(arch=arch)
    if arch in _LITE_BY_LAYER_COUNT and q_lora not in reader.fields:
        # llama.cpp takes a deepseek2 file without q_lora_rank for a "lite" model (a full-rank
        # query) by its layer count alone (27 or 26): a stage of DeepSeek-V2-Lite has fewer
        # layers and says so outright, where 0 means what the absent key meant.
        writer.add_key_value(q_lora, 0, gguf.GGUFValueType.UINT32)
    writer.add_key_value(RANGE_KEY, [first, end], gguf.GGUFValueType.ARRAY,
                         sub_type=gguf.GGUFValueType.UINT32)
    kept: list[tuple[int, int]] = []  # (offset in source, bytes) of each tensor written
    for tensor in reader.tensors:
        name, shape, size = tensor.name, tensor.data.shape, int(tensor.n_bytes)
        block = _BLOCK.match(name)
        if block:
            layer = int(block.group(1))
            if not first <= layer < end:
                continue
            name = f"blk.{layer - first}.{block.group(2)}"
        elif role == "first" and name == "output.weight":
            continue  # the first stage stops before the LM head
        elif middle and name in ("token_embd.weight", "output.weight"):
            # The first rows: numpy's outermost axis, stored first.
            size = size // shape[0] * VOCAB_KEEP
            shape = (VOCAB_KEEP, *shape[1:])
        writer.add_tensor_info(name, shape, tensor.data.dtype, size, tensor.tensor_type)
        kept.append((int(tensor.data_offset), size))
    total = sum(size for _, size in kept)
    _check_free_space(dest.parent, total + reader.data_offset + len(kept) * writer.data_alignment,
                      what)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None
    out = writer.fout[0]
    out.flush()  # from here on the tensor bytes go to the descriptor directly
    progress = _Progress(what, total)
    with source.open("rb") as src:
        copy = _Copier(src.fileno(), out.fileno(), chunk)
        for offset, size in kept:
            copy.padding(writer.data_alignment)
            copy.range(offset, size, progress)
    writer.close()
    progress.done()


# Architectures whose "lite" variant llama.cpp recognises by layer count (see _cut).
_LITE_BY_LAYER_COUNT = ("deepseek2",)


def _check_free_space(folder: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise EngineError(f"{what or 'a stage file'} needs {needed / 2**20:,.0f} MiB in "
                          f"{folder}, which has {free / 2**20:,.0f} MiB free: free space "
                          "there, or set EDGEBUS_HOME to a disk that has it")


class _Copier:
    """Bytes of one file appended to another in bounded chunks: the kernel copies them
    (copy_file_range) where it can, else they pass through one reused buffer."""

    def __init__(self, src: int, dst: int, chunk: int) -> None:
        self.src, self.dst, self.chunk = src, dst, chunk
        self.written = os.lseek(dst, 0, os.SEEK_CUR)
        self._in_kernel = hasattr(os, "copy_file_range")
        self._buffer: bytearray | None = None

    def padding(self, alignment: int) -> None:
        """Zeros up to the next multiple of `alignment`, where GGUF starts each tensor."""
        self._write(bytes(-self.written % alignment))

    def range(self, offset: int, size: int, progress: _Progress) -> None:
        end = offset + size
        while offset < end:
            moved = self._copy(offset, min(self.chunk, end - offset))
            if not moved:
                raise EngineError(f"the source GGUF ended {offset} bytes in, before its "
                                  "tensors did: is the file complete?")
            offset += moved
            progress.add(moved)

    def _copy(self, offset: int, size: int) -> int:
        if self._in_kernel:
            try:
                moved = os.copy_file_range(self.src, self.dst, size, offset)
            except OSError as exc:
                # Not between these files (another file system, an old kernel): read instead.
                if exc.errno not in _NO_KERNEL_COPY:
                    raise
                self._in_kernel = False
            else:
                self.written += moved
                return moved
        if self._buffer is None:
            self._buffer = bytearray(self.chunk)
        view = memoryview(self._buffer)[:size]
        got = os.preadv(self.src, [view], offset)
        self._write(view[:got])
        return got

    def _write(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        self.written += len(view)
        while view:
            view = view[os.write(self.dst, view):]


# copy_file_range's errors that mean "not between these two files", not a failed copy.
_NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


class _Progress:
    """Log lines on a long cut: the stage agent's log, which `edgebus up` shows."""

    def __init__(self, what: str, total: int) -> None:
        self.what, self.total, self.copied = what or "a stage file", total, 0
        self.started = self._last = time.monotonic()

    def add(self, size: int) -> None:
        self.copied += size
        now = time.monotonic()
        if now - self._last >= PROGRESS_S:
            self._last = now
            log.info("cutting %s: %.0f of %.0f MiB (%.0f %%), %.0f s", self.what,
                     self.copied / 2**20, self.total / 2**20,
                     100 * self.copied / max(self.total, 1), now - self.started)

    def done(self) -> None:
        seconds = time.monotonic() - self.started
        if seconds >= PROGRESS_S:
            log.info("cut %s: %.0f MiB in %.0f s", self.what, self.total / 2**20, seconds)
