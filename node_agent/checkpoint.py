"""Read selected tensors from an HF safetensors checkpoint, and nothing else.

A stage must never hold the whole model: on a Raspberry Pi the whole model is
exactly what does not fit. `Shard` reads only the tensors asked for, with
plain reads into memory of their own; with a sharded checkpoint
(`model.safetensors.index.json`) only the shards holding them are opened.
Not a memory map: every page of a map that was read stays resident for as
long as any tensor from the map lives, so a stage that converts its weights
(to another dtype, or to column-major) would hold them twice. A tensor that
is converted is converted block by block as it is read, so loading never
holds more than the stage's weights plus one block.

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

from edgebus.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Bytes read per block when a tensor is converted while it is read: the only
# transient memory of loading, small beside any layer; reads are sequential,
# so smaller blocks cost no speed.
READ_BLOCK_BYTES = 2**20
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
        header.pop("__metadata__", None)
        self.header = header
        self._data = 8 + size

    def __enter__(self) -> Shard:
        return self

    def __exit__(self, *exc: object) -> None:
        self._file.close()

    def keys(self) -> list[str]:
        return list(self.header)

    def read(self, name: str, dtype: torch.dtype | None = None,
             column_major: bool = False) -> torch.Tensor:
        """Tensor `name`; a floating-point one converted to `dtype`, and a 2-D one to
        column-major if asked (the same [out, in] tensor, laid out as its
        contiguous transpose)."""
        entry = self.header[name]
        stored = _DTYPES[str(entry["dtype"])]
        shape: list[int] = list(entry["shape"])  # type: ignore[call-overload]
        offset = self._data + int(entry["data_offsets"][0])  # type: ignore[index]
        dtype = dtype if dtype is not None and stored.is_floating_point else stored
        column_major = column_major and len(shape) == 2
        if dtype == stored and not column_major:
            out = torch.empty(shape, dtype=stored)
            self._read_into(out, offset)
            return out
        rows, cols = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
        out = torch.empty(cols, rows, dtype=dtype) if column_major else torch.empty(
            rows, cols, dtype=dtype)
        step = max(1, READ_BLOCK_BYTES // max(1, cols * stored.itemsize))
        block = torch.empty(min(step, rows), cols, dtype=stored)
        for first in range(0, rows, step):
            part = block[:min(step, rows - first)]
            self._read_into(part, offset + first * cols * stored.itemsize)
            if column_major:
                out[:, first:first + len(part)] = part.t()
            else:
                out[first:first + len(part)] = part
        return out.t() if column_major else out.view(shape)

    def _read_into(self, tensor: torch.Tensor, offset: int) -> None:
        buffer = tensor.reshape(-1).view(torch.uint8).numpy().data
        self._file.seek(offset)
        if self._file.readinto(buffer) != len(buffer):
            raise CheckpointError(f"{self.path} ends inside a tensor: the file is truncated")


def tensor_locations(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the file that holds it."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / shard for name, shard in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if single.is_file():
        with Shard(single) as shard:
            return dict.fromkeys(shard.keys(), single)
    raise CheckpointError(
        f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}: a stage loads its layers "
        "from safetensors. Import a GGUF with `edgebus model import-gguf SRC.gguf DIR`, or point "
        "the plant file's `model:` at an HF model directory.")


def load_tensors(model_dir: Path, names: Iterable[str],
                 locations: dict[str, Path] | None = None, *, dtype: torch.dtype | None = None,
                 column_major: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Load exactly `names`, opening each shard at most once (see `Shard.read`)."""
    locations = locations if locations is not None else tensor_locations(model_dir)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in names:
        if name not in locations:
            raise CheckpointError(f"tensor {name!r} is not in the checkpoint at {model_dir}: "
                                  "the model directory does not match its config.json")
        by_file[locations[name]].append(name)
    tensors: dict[str, torch.Tensor] = {}
    for path, wanted in by_file.items():
        if not path.is_file():
            raise CheckpointError(f"shard {path} named in {INDEX_FILE} is missing")
        with Shard(path) as shard:
            for name in wanted:
                tensors[name] = shard.read(name, dtype, name in column_major)
    return tensors


class CheckpointReader:
    """A checkpoint seen under the tensor names of `model` (a skeleton; may be on meta)."""

    def __init__(self, model_dir: Path, model: PreTrainedModel) -> None:
        self.model_dir = model_dir
        self.locations = tensor_locations(model_dir)
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

    def __contains__(self, name: str) -> bool:
        return name in self._sources

    def load(self, names: Iterable[str], dtype: torch.dtype | None = None,
             column_major: Iterable[str] = ()) -> dict[str, torch.Tensor]:
        """The model tensors `names`, reading only the checkpoint tensors they come from.

        Floating-point tensors come in `dtype`, and the 2-D ones named in
        `column_major` laid out column-major (see `Shard.read`).
        """
        names = set(names)
        missing = sorted(names - self._sources.keys())
        if missing:
            raise CheckpointError(f"tensors {missing[:5]} are not in the checkpoint at "
                                  f"{self.model_dir}: the model directory does not match its "
                                  "config.json")
        plain = names - self._converted.keys()
        raw = load_tensors(self.model_dir, {k for n in names for k in self._sources[n]},
                           self.locations, dtype=dtype, column_major=frozenset(
                               self._sources[n][0] for n in plain & set(column_major)))
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
