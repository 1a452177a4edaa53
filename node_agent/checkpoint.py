"""Read selected tensors from an HF safetensors checkpoint, and nothing else.

A stage must never hold the whole model: on a Raspberry Pi the whole model is
exactly what does not fit. `safe_open` memory-maps each file and copies out
only the tensors asked for; with a sharded checkpoint
(`model.safetensors.index.json`) only the shards holding them are opened.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

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
