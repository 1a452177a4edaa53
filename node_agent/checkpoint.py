"""Read selected tensors from an HF safetensors checkpoint, and nothing else.

A stage must never hold the whole model: on a Raspberry Pi the whole model is
exactly what does not fit. `safe_open` memory-maps each file and copies out
only the tensors asked for; with a sharded checkpoint
(`model.safetensors.index.json`) only the shards holding them are opened.

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
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
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


def tensor_locations(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the file that holds it."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / shard for name, shard in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    raise CheckpointError(
        f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}: a stage loads its layers "
        "from safetensors. Import a GGUF with `edgebus model import-gguf SRC.gguf DIR`, or point "
        "the plant file's `model:` at an HF model directory.")


def load_tensors(model_dir: Path, names: Iterable[str],
                 locations: dict[str, Path] | None = None) -> dict[str, torch.Tensor]:
    """Load exactly `names`, opening each shard at most once."""
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
        with safe_open(str(path), framework="pt") as f:
            for name in wanted:
                tensors[name] = f.get_tensor(name)
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

    def load(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The model tensors `names`, reading only the checkpoint tensors they come from."""
        names = set(names)
        missing = sorted(names - self._sources.keys())
        if missing:
            raise CheckpointError(f"tensors {missing[:5]} are not in the checkpoint at "
                                  f"{self.model_dir}: the model directory does not match its "
                                  "config.json")
        raw = load_tensors(self.model_dir, {k for n in names for k in self._sources[n]},
                           self.locations)
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
