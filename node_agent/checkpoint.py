"""Read selected tensors from an HF safetensors checkpoint, and nothing else.

A stage must never hold the whole model: on a Raspberry Pi the whole model is
exactly what does not fit. `Shard` reads only the tensors asked for, with
plain reads into memory of their own; with a sharded checkpoint
(`model.safetensors.index.json`) only the shards holding them are opened.
Not a memory map: every page of a map that was read stays resident for as
long as any tensor from the map lives, so a stage that converts its weights
(to another dtype, or packed for oneDNN) would hold them twice. A tensor that
changes dtype is converted block by block as it is read, and a large matrix
can be read a range of rows at a time, so loading never holds much more than
the stage's weights.

A checkpoint imported with `edgebus model import-gguf --keep-quantized` holds
some matrices as GGUF blocks (node_agent/blockwise.py): codes, scales, zero
points and minimums under `{name}.codes` etc., described in the file's
metadata under BLOCKS_METADATA. They read as one tensor `name`:
`CheckpointReader.blocks` hands out the blocks (the ONNX Runtime engine runs
them as they are), every other read dequantizes them to float.

Checkpoint names are not always the model's: a DeepSeek-V3 checkpoint stores
each routed expert as its own `mlp.experts.{e}.gate_proj.weight`, while the
transformers module holds one fused `mlp.experts.gate_up_proj` [E, 2I, H].
`CheckpointReader` applies transformers' own conversion mapping (the one
`from_pretrained` applies), so a stage reads exactly what `generate` reads.
"""

from __future__ import annotations

import copy
import functools
import json
import math
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
)

from edgebus.core.errors import CheckpointError
from node_agent.blockwise import BlockQuantized

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Bytes read per block when a tensor is converted while it is read: the only
# transient memory of loading, small beside any layer; reads are sequential,
# so smaller blocks cost no speed.
READ_BLOCK_BYTES = 2**20
# safetensors metadata key of a kept-quantized checkpoint: JSON {name: {"bits", "block",
# "source"}} for each matrix stored as blocks.
BLOCKS_METADATA = "edgebus.blocks"
# The tensors that hold one block-quantized matrix, by suffix; the last two are optional.
BLOCK_PARTS = ("codes", "scales", "zeros", "minimums")
# The safetensors header's dtype names.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
           "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class Shard:
    """One safetensors file, open for reading tensors out of it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("rb")
        try:
            size = int.from_bytes(self._file.read(8), "little")
            header: dict[str, dict[str, object]] = json.loads(self._file.read(size))
        except (ValueError, UnicodeDecodeError) as exc:
            self._file.close()
            raise CheckpointError(f"{path} is not a safetensors file ({exc})") from None
        metadata = header.pop("__metadata__", None) or {}
        self.header = header
        # name -> {"bits", "block", "source"} of the matrices stored as blocks
        self.blocks: dict[str, dict[str, object]] = json.loads(
            str(metadata.get(BLOCKS_METADATA, "{}")))
        self._data = 8 + size

    def __enter__(self) -> Shard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def keys(self) -> list[str]:
        """Tensor names, a block-quantized matrix under its own name (not its parts')."""
        parts = {f"{name}.{part}" for name in self.blocks for part in BLOCK_PARTS}
        return [key for key in self.header if key not in parts] + list(self.blocks)

    def read_blocks(self, name: str) -> BlockQuantized:
        info = self.blocks[name]
        arrays = {part: self.read(f"{name}.{part}").numpy() for part in BLOCK_PARTS
                  if f"{name}.{part}" in self.header}
        return BlockQuantized(arrays["codes"], arrays["scales"], arrays.get("zeros"),
                              arrays.get("minimums"), int(info["bits"]),  # type: ignore[call-overload]
                              int(info["block"]), str(info["source"]))  # type: ignore[call-overload]

    def read(self, name: str, dtype: torch.dtype | None = None,
             rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `name`, or its rows [first, end) (along dim 0); a floating-point
        one converted to `dtype`. A block-quantized matrix is dequantized."""
        if name in self.blocks:
            blocks = self.read_blocks(name)
            picked = blocks.dequantize(slice(*rows) if rows is not None else slice(None))
            return torch.from_numpy(picked).to(dtype or torch.float32)
        entry = self.header[name]
        stored = _DTYPES[str(entry["dtype"])]
        shape: list[int] = list(entry["shape"])  # type: ignore[call-overload]
        offset = self._data + int(entry["data_offsets"][0])  # type: ignore[index]
        row_bytes = math.prod(shape[1:]) * stored.itemsize
        if rows is not None:
            offset += rows[0] * row_bytes
            shape[0] = rows[1] - rows[0]
        dtype = dtype if dtype is not None and stored.is_floating_point else stored
        out = torch.empty(shape, dtype=dtype)
        if dtype == stored:
            self._read_into(out, offset)
            return out
        flat = out.view(shape[0] if shape else 1, -1)
        step = max(1, READ_BLOCK_BYTES // max(1, row_bytes))
        block = torch.empty(min(step, len(flat)), flat.shape[1], dtype=stored)
        for first in range(0, len(flat), step):
            part = block[:min(step, len(flat) - first)]
            self._read_into(part, offset + first * row_bytes)
            flat[first:first + len(part)] = part
        return out

    def _read_into(self, tensor: torch.Tensor, offset: int) -> None:
        buffer = tensor.reshape(-1).view(torch.uint8).numpy().data
        self._file.seek(offset)
        if self._file.readinto(buffer) != len(buffer):
            raise CheckpointError(f"{self.path} ends inside a tensor: the file is truncated")


def tensor_locations(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the file that holds it."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        # Only the index is read: a stage opens no shard it takes nothing from. A sharded
        # kept-quantized checkpoint lists its blocks in the index's metadata too.
        content = json.loads(index.read_text())
        weight_map: dict[str, str] = content["weight_map"]
        blocks = (content.get("metadata") or {}).get(BLOCKS_METADATA) or {}
        parts = {f"{name}.{part}" for name in blocks for part in BLOCK_PARTS}
        locations = {name: model_dir / shard for name, shard in weight_map.items()
                     if name not in parts}
        locations.update({name: model_dir / weight_map[f"{name}.codes"] for name in blocks})
        return locations
    single = model_dir / SINGLE_FILE
    if single.is_file():
        with Shard(single) as shard:
            return dict.fromkeys(shard.keys(), single)
    raise CheckpointError(
        f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}: a stage loads its layers "
        "from safetensors. Import a GGUF with `edgebus model import-gguf SRC.gguf DIR`, or point "
        "the plant file's `model:` at an HF model directory.")


class CheckpointReader:
    """A checkpoint seen under the tensor names of `model` (a skeleton; may be on meta).

    A context manager: shards stay open, each opened once, until it exits.
    """

    def __init__(self, model_dir: Path, model: PreTrainedModel) -> None:
        self.model_dir = model_dir
        self.locations = tensor_locations(model_dir)
        self._shards: dict[Path, Shard] = {}
        transforms = get_model_conversion_mapping(model)
        renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in transforms if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        model_keys = model.state_dict()  # meta tensors: names only, no memory
        # model name -> checkpoint names; and for fused tensors, the converter and
        # which of its source patterns each checkpoint name matched.
        self._sources: dict[str, list[str]] = defaultdict(list)
        self._converted: dict[str, tuple[WeightConverter, list[str]]] = {}
        # Natural order, so experts 0..E-1 are stacked in order (10 after 9).
        for key in sorted(self.locations, key=dot_natural_key):
            name, pattern = rename_source_key(key, renamings, converters,
                                              model.base_model_prefix, model_keys)
            self._sources[name].append(key)
            if pattern is not None:
                self._converted.setdefault(name, (by_pattern[pattern], []))[1].append(pattern)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        for shard in self._shards.values():
            shard.close()
        self._shards.clear()

    def __contains__(self, name: str) -> bool:
        return name in self._sources

    def _read(self, key: str, dtype: torch.dtype | None,
              rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Checkpoint tensor `key` (or its rows), from its shard."""
        return self._shard(key).read(key, dtype, rows)

    def _shard(self, key: str) -> Shard:
        """The shard holding checkpoint tensor `key`, opened on first use."""
        path = self.locations.get(key)
        if path is None:
            raise CheckpointError(f"tensor {key!r} is not in the checkpoint at "
                                  f"{self.model_dir}: the model directory does not match its "
                                  "config.json")
        if path not in self._shards:
            if not path.is_file():
                raise CheckpointError(f"shard {path} named in {INDEX_FILE} is missing")
            self._shards[path] = Shard(path)
        return self._shards[path]

    def blocks(self, name: str) -> BlockQuantized | None:
        """Model tensor `name` as stored blocks, or None if it is stored as floats."""
        sources = self._sources.get(name)
        if not sources or len(sources) != 1:
            return None
        shard = self._shard(sources[0])
        return shard.read_blocks(sources[0]) if sources[0] in shard.blocks else None

    def rows(self, name: str, first: int, end: int,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """Rows [first, end) of model tensor `name`, stored as one checkpoint tensor."""
        sources = self._sources.get(name)
        if not sources or name in self._converted:
            raise CheckpointError(f"tensor {name!r} is not one tensor of the checkpoint at "
                                  f"{self.model_dir}")
        return self._read(sources[0], dtype, (first, end))

    def load(self, names: Iterable[str],
             dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The model tensors `names`, reading only the checkpoint tensors they come from;
        floating-point ones in `dtype`."""
        names = set(names)
        missing = sorted(names - self._sources.keys())
        if missing:
            raise CheckpointError(f"tensors {missing[:5]} are not in the checkpoint at "
                                  f"{self.model_dir}: the model directory does not match its "
                                  "config.json")
        raw = {key: self._read(key, dtype) for n in names for key in self._sources[n]}
        tensors: dict[str, torch.Tensor] = {}
        for name in names:
            sources = self._sources[name]
            if name not in self._converted:
                tensors[name] = raw[sources[0]]
                continue
            template, patterns = self._converted[name]
            converter = copy.deepcopy(template)  # it collects tensors: one per target
            for key, pattern in zip(sources, patterns, strict=True):
                # Typed as a Future, but a callable is what transformers' own
                # synchronous loading hands it too (materialize_tensors calls it).
                converter.add_tensor(name, key, pattern,
                                     functools.partial(raw.__getitem__, key))  # type: ignore[arg-type]
            tensors.update(converter.convert(name))
        return tensors
