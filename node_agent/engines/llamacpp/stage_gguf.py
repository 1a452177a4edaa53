"""A stage's GGUF: layers [first, end) of the model's GGUF, as a model llama.cpp loads by itself.

The blocks are copied as shipped (Q4_0, Q4_K, Q8_0, F16, ... whatever the file
holds; nothing is dequantized), renumbered from 0, with `{arch}.block_count`
set to end - first. What else a stage keeps depends on where it sits:

| stage  | keeps |
| ---    | ---   |
| first  | the token embedding; an LM head stand-in of zeros |
| middle | the embedding and LM head cut to VOCAB_KEEP rows |
| last   | the final norm and the LM head; an embedding stand-in of zeros |
| whole  | the model's own file, not a copy |

No stage file keeps the tokenizer: the coordinator tokenizes, from the model's
own file, and a stage sees token ids and logits only. A stage file says
`tokenizer.ggml.model = none` with `{arch}.vocab_size`, from which llama.cpp
makes that many empty tokens (40 bytes each) instead of its tokenizer tables:
33 MiB less on each end of Llama-3-8B (128,256 tokens, 280,147 merges), whose
first and last stage were up to 66 MiB over issue 33's memory target.

llama.cpp insists on a token embedding and an LM head of the vocabulary's size
in every model, so a middle stage keeps VOCAB_KEEP rows of each (and says
vocab_size = VOCAB_KEEP): a few KiB, and no logits buffer worth the name. A
first or a last stage keeps the whole vocabulary's rows (token ids in, logits
out), so the matrix it never uses is a stand-in of zeros in the smallest type
llama.cpp loads (plant_config/stage_memory.py, STANDIN_TYPES): without it,
llama.cpp loads a first stage's embedding a second time as its LM head.

Stage files are cut once and cached in `$EDGEBUS_HOME/stages/` (CACHE_DIR),
named by the source file's fingerprint (a digest of its header and of pieces
spread over it), the range, the role and llama-cpp-python's
version (whose llama.cpp reads them). Not beside the source: a plant may name
a GGUF in a directory the agents cannot write (a package's, or one the
systemd units keep read-only), and the fingerprint in the name keeps the files of
different models apart. A file is written under a temporary name, synced to
the disk and renamed into place, so neither a crash nor a power cut leaves a
half-cut file that looks usable.

A cut streams: the header is walked without decoding the vocabulary
(gguf_model.layout), keys the stage does not change are copied as bytes, and
tensor bytes go from the source to the stage file in COPY_CHUNK pieces, by the
kernel where it can (copy_file_range), each piece written back to the disk and
its source's pages dropped from the page cache as it goes (read once; the
memory keeps the stage file llama.cpp reads next). Nothing maps the model into the
agent's memory, free disk space is checked before writing, and a long cut logs
its progress every PROGRESS_S seconds. The file is byte for byte what gguf-py's
writer would write from the same tensors (tests/test_gguf_model.py).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import math
import mmap
import os
import re
import shutil
import struct
import time
import uuid
from pathlib import Path
from typing import Any

import gguf

from edgebus.core.errors import CheckpointError, EngineError
from edgebus.core.paths import edgebus_home
from node_agent import gguf_model
from plant_config.stage_memory import standin_type

CACHE_DIR = "stages"  # under $EDGEBUS_HOME
# Rows of the embedding and LM head a middle stage keeps: llama.cpp wants both
# tensors and a vocabulary, and 32 rows are enough for it to load.
VOCAB_KEEP = 32
# Bump when the files cut here change meaning, so cached ones are cut again.
# 2: stand-ins of zeros for the matrices a first or last stage never uses; 3: no stage keeps
# the tokenizer.
CUT_FORMAT = 3
# Metadata key recording which layers of the source a stage file holds.
RANGE_KEY = "edgebus.layer_range"
# What names a source GGUF's stage files (`fingerprint`): its size and mtime, its first
# FINGERPRINT_HEAD bytes (the header: every key, tensor name, shape, type and offset, and
# the first tensors) and FINGERPRINT_SAMPLES pieces of FINGERPRINT_PIECE bytes spread evenly
# over the rest. Two checkpoints of one shape differ in every block, so any piece tells them
# apart. The sha256 of the whole file it replaces read a 9 GB model once more in every
# stage's process at first start, on a Pi's fraction of a core (issue 33: 142 s of cut and
# load where reading the file takes 12.5 s); this reads 32 MiB.
FINGERPRINT_HEAD = 16 * 2**20
FINGERPRINT_SAMPLES = 256
FINGERPRINT_PIECE = 64 * 2**10
_BLOCK = re.compile(r"^blk\.(\d+)\.(.*)$")
# Tensor bytes copied per call: bounds what a cut holds in memory where the kernel cannot copy
# (one buffer of this size) and how often progress is counted; past a few MiB a larger copy
# is no faster.
COPY_CHUNK = 16 * 2**20
# Bytes a cut writes between two write-backs to the disk (_Copier._write_back): a chunk's
# worth, however small the chunks.
WRITE_BACK = COPY_CHUNK
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
    name = (f"{fingerprint(source)[:16]}.{first}-{end}.{role}.llama-cpp-{library_version}"
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


def fingerprint(path: Path) -> str:
    """sha256 of the file's size, mtime, header and evenly spread pieces (FINGERPRINT_HEAD)."""
    stat = path.stat()
    digest = hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}:".encode())
    with path.open("rb") as f:
        digest.update(f.read(FINGERPRINT_HEAD))
        rest = stat.st_size - FINGERPRINT_HEAD
        if rest > 0:
            for index in range(FINGERPRINT_SAMPLES):
                f.seek(FINGERPRINT_HEAD + rest * index // FINGERPRINT_SAMPLES)
                digest.update(f.read(FINGERPRINT_PIECE))
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
    """Write the stage file: the source's header with what the stage changes (its layer
    count, per-layer values, tensor infos; the vocabulary), every other key's
    bytes as they are, then each kept tensor's bytes copied from `source` `chunk` bytes at a
    time (copy_file_range, else through one buffer): memory holds the header and one chunk,
    however large the model."""
    try:
        src = gguf_model.layout(source)
    except CheckpointError as exc:
        raise EngineError(str(exc)) from exc
    fields = {entry.key: entry for entry in src.entries}
    arch = str(fields[gguf.Keys.General.ARCHITECTURE].value)
    middle = role == "middle"
    layers = int(fields[f"{arch}.block_count"].value)
    # Every file llama.cpp loads has the embedding: its rows are the vocabulary, and a
    # stand-in is shaped as it.
    embedding_dims = next(t.dims for t in src.tensors if t.name == "token_embd.weight")
    header = _Encoder(src.order)
    with source.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        entries: list[bytes] = []
        for entry in src.entries:
            name = entry.key
            if name.startswith("tokenizer.") or name == f"{arch}.vocab_size":
                continue  # a vocabulary of empty tokens instead, below
            value = _stage_value(entry.value, name, arch, first, end, layers)
            if value == entry.value:
                entries.append(data[entry.start:entry.end])  # as shipped, not re-encoded
            else:
                item = (struct.unpack_from(src.order + "I", data,
                                           entry.start + 8 + len(name.encode()) + 4)[0]
                        if entry.kind == gguf.GGUFValueType.ARRAY else None)
                entries.append(header.entry(name, entry.kind, value, item))
    entries.append(header.entry("tokenizer.ggml.model", gguf.GGUFValueType.STRING, "none"))
    entries.append(header.entry(f"{arch}.vocab_size", gguf.GGUFValueType.UINT32,
                                VOCAB_KEEP if middle else embedding_dims[-1]))
    q_lora = gguf.Keys.Attention.Q_LORA_RANK.format(arch=arch)
    if arch in _LITE_BY_LAYER_COUNT and q_lora not in fields:
        # llama.cpp takes a deepseek2 file without q_lora_rank for a "lite" model (a full-rank
        # query) by its layer count alone (27 or 26): a stage of DeepSeek-V2-Lite has fewer
        # layers and says so outright, where 0 means what the absent key meant.
        entries.append(header.entry(q_lora, gguf.GGUFValueType.UINT32, 0))
    entries.append(header.entry(RANGE_KEY, gguf.GGUFValueType.ARRAY, [first, end],
                                gguf.GGUFValueType.UINT32))
    # (offset in source, or None for zeros; bytes) of each tensor written
    kept: list[tuple[int | None, int]] = []
    infos: list[bytes] = []
    offset = 0
    untied = any(tensor.name == "output.weight" for tensor in src.tensors)
    standin = _Standin(embedding_dims)
    for tensor in src.tensors:
        name, dims = tensor.name, tensor.dims
        block, block_bytes = gguf.GGML_QUANT_SIZES[tensor.kind]
        size = math.prod(dims) // block * block_bytes
        layer = _BLOCK.match(name)
        if layer:
            index = int(layer.group(1))
            if not first <= index < end:
                continue
            name = f"blk.{index - first}.{layer.group(2)}"
        elif role == "first" and name == "output.weight":
            continue  # the first stage stops before the LM head: a stand-in below
        elif role == "last" and name == "token_embd.weight" and untied:
            # Looked up by no one here: llama.cpp only insists on it (STANDIN_TYPES).
            infos.append(header.tensor_info(name, dims, standin.kind, offset))
            kept.append((None, standin.size))
            offset += standin.size + -standin.size % src.alignment
            continue
        elif middle and name in ("token_embd.weight", "output.weight"):
            # The first rows (GGUF's last axis, stored first).
            size = size // dims[-1] * VOCAB_KEEP
            dims = (*dims[:-1], VOCAB_KEEP)
        infos.append(header.tensor_info(name, dims, tensor.kind, offset))
        kept.append((src.data_start + tensor.offset, size))
        offset += size + -size % src.alignment
    if role == "first":
        # Without an LM head llama.cpp would load the embedding again as one (repacked):
        # a stand-in it loads instead, never computed, as the stage asks for no logits.
        infos.append(header.tensor_info("output.weight", standin.dims, standin.kind, offset))
        kept.append((None, standin.size))
        offset += standin.size + -standin.size % src.alignment
    head = (header.start(len(infos), len(entries)) + b"".join(entries) + b"".join(infos))
    _check_free_space(dest.parent, len(head) + src.alignment + offset, what)
    progress = _Progress(what, offset)
    with source.open("rb") as src_file, dest.open("wb") as out:
        copy = _Copier(src_file.fileno(), out.fileno(), chunk)
        copy.write(head)
        for start, size in kept:
            copy.padding(src.alignment)
            if start is None:
                copy.zeros(size, progress)
            else:
                copy.range(start, size, progress)
        copy.padding(src.alignment)
        # On the disk before the rename makes it the stage file: renamed with its blocks
        # still in the page cache, a box's power cut could leave a file of the right name
        # and the wrong bytes.
        os.fsync(out.fileno())
    progress.done()


class _Encoder:
    """GGUF header items in a byte order, as gguf-py's writer encodes them."""

    def __init__(self, order: str) -> None:
        self.order = order

    def start(self, tensors: int, entries: int) -> bytes:
        return _MAGIC + struct.pack(self.order + "IQQ", _VERSION, tensors, entries)

    def entry(self, key: str, kind: gguf.GGUFValueType, value: Any,
              item: int | None = None) -> bytes:
        return self._string(key) + struct.pack(self.order + "I", kind) + self._value(
            kind, value, item)

    def tensor_info(self, name: str, dims: tuple[int, ...], kind: gguf.GGMLQuantizationType,
                    offset: int) -> bytes:
        return (self._string(name) + struct.pack(self.order + "I", len(dims))
                + struct.pack(self.order + "Q" * len(dims), *dims)
                + struct.pack(self.order + "IQ", kind, offset))

    def _string(self, text: str) -> bytes:
        raw = text.encode()
        return struct.pack(self.order + "Q", len(raw)) + raw

    def _value(self, kind: int, value: Any, item: int | None) -> bytes:
        if kind == gguf.GGUFValueType.STRING:
            return self._string(value)
        if kind == gguf.GGUFValueType.ARRAY:
            assert item is not None
            return struct.pack(self.order + "IQ", item, len(value)) + b"".join(
                self._value(item, v, None) for v in value)
        return struct.pack(self.order + gguf_model.SCALARS[gguf.GGUFValueType(kind)], value)


_MAGIC = b"GGUF"
# The GGUF version written, as gguf-py's writer writes it.
_VERSION = 3


# Architectures whose "lite" variant llama.cpp recognises by layer count (see _cut).
_LITE_BY_LAYER_COUNT = ("deepseek2",)


def _check_free_space(folder: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed:
        raise EngineError(f"{what or 'a stage file'} needs {needed / 2**20:,.0f} MiB in "
                          f"{folder}, which has {free / 2**20:,.0f} MiB free: free space "
                          "there, or set EDGEBUS_HOME to a disk that has it")


class _Standin:
    """A vocabulary-sized matrix of zeros in plant_config.stage_memory's stand-in type."""

    def __init__(self, embedding_dims: tuple[int, ...]) -> None:
        hidden = embedding_dims[0]
        name, block, block_bytes = standin_type(hidden)
        self.kind = gguf.GGMLQuantizationType[name]
        self.dims = embedding_dims
        self.size = math.prod(embedding_dims) // block * block_bytes


class _Copier:
    """Bytes of one file appended to another in bounded chunks: the kernel copies them
    (copy_file_range) where it can, else they pass through one reused buffer."""

    def __init__(self, src: int, dst: int, chunk: int) -> None:
        self.src, self.dst, self.chunk = src, dst, chunk
        self.written = self._synced = os.lseek(dst, 0, os.SEEK_CUR)
        self._in_kernel = hasattr(os, "copy_file_range")
        self._buffer: bytearray | None = None

    def write(self, data: bytes) -> None:
        self._write(data)

    def padding(self, alignment: int) -> None:
        """Zeros up to the next multiple of `alignment`, where GGUF starts each tensor."""
        self._write(bytes(-self.written % alignment))

    def zeros(self, size: int, progress: _Progress) -> None:
        """`size` zero bytes, a chunk at a time."""
        while size > 0:
            piece = min(self.chunk, size)
            self._write(bytes(piece))
            self._write_back()
            progress.add(piece)
            size -= piece

    def range(self, offset: int, size: int, progress: _Progress) -> None:
        end = offset + size
        while offset < end:
            moved = self._copy(offset, min(self.chunk, end - offset))
            if not moved:
                raise EngineError(f"the source GGUF ended {offset} bytes in, before its "
                                  "tensors did: is the file complete?")
            # Read once: the box's memory is better spent keeping the stage file, which
            # llama.cpp reads next, than the source's pages. With them kept, a 4 GiB box
            # evicted its 3 GB stage file to hold them, and llama.cpp read it again from its
            # card (DeepSeek-V2-Lite's shape on a rehearsed 60 MB/s Pi: 2.7 GB more, ~45 s of
            # its 132 s first start).
            if _FADVISE is not None:
                _FADVISE(self.src, offset, moved, os.POSIX_FADV_DONTNEED)
            self._write_back()
            offset += moved
            progress.add(moved)

    def _write_back(self) -> None:
        """Put what is written on the disk every WRITE_BACK bytes, from this process: the box
        holds that much of dirty pages, not the kernel's dirty limit (a fifth of its memory);
        the card's write rate paces the cut as reading does, one card doing both; and a
        rehearsed box's io limit meters every byte (cgroup v1 charges the kernel's own
        writeback to no box: it metered 581 of the 2,709 MiB a rehearsed Pi wrote)."""
        if self.written - self._synced >= WRITE_BACK:
            _DATASYNC(self.dst)
            self._synced = self.written

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


# Linux's calls; where they are missing (macOS), the page cache is left to the kernel and
# fsync writes the data back with the metadata.
_FADVISE = getattr(os, "posix_fadvise", None)
_DATASYNC = getattr(os, "fdatasync", os.fsync)

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
