"""Sharded checkpoints: a stage opens only the shard files that hold its tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import node_agent.checkpoint
from edgebus.core.errors import CheckpointError
from node_agent.checkpoint import INDEX_FILE
from node_agent.engines.torch_engine import TorchEngine

# Small enough that one tiny DeepSeek-V3 layer (~400 KB: 12 experts of 3 matrices
# each) spans several shards, so a stage needs some shards of each of its layers.
MAX_SHARD_SIZE = "100KB"
STAGE = (2, 4)  # a middle stage: MoE layers, no embedding, no head


@pytest.fixture
def sharded_dir(deepseek_dir: Path, tmp_path: Path) -> Path:
    model = AutoModelForCausalLM.from_pretrained(deepseek_dir, dtype=torch.float32)
    out = tmp_path / "sharded"
    model.save_pretrained(out, max_shard_size=MAX_SHARD_SIZE)
    shutil.copy(deepseek_dir / "config.json", out / "config.json")
    return out


def _shards_of(model_dir: Path, prefixes: tuple[str, ...]) -> set[str]:
    weight_map: dict[str, str] = json.loads((model_dir / INDEX_FILE).read_text())["weight_map"]
    return {shard for name, shard in weight_map.items() if name.startswith(prefixes)}


def test_stage_opens_only_its_shards(sharded_dir: Path, deepseek_dir: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    first, end = STAGE
    needed = _shards_of(sharded_dir, tuple(f"model.layers.{i}." for i in range(first, end)))
    every = _shards_of(sharded_dir, ("",))
    # The test means something: the stage spans shards, and most shards are not its own.
    assert len(needed) >= 2 and len(every - needed) > len(needed)
    # A stage that touched any other shard fails: they are gone.
    for shard in every - needed:
        (sharded_dir / shard).unlink()
    opened: list[str] = []

    class RecordingShard(node_agent.checkpoint.Shard):
        def __init__(self, path: Path) -> None:
            opened.append(path.name)
            super().__init__(path)

    monkeypatch.setattr(node_agent.checkpoint, "Shard", RecordingShard)
    stage = TorchEngine(sharded_dir, first, end)
    assert sorted(opened) == sorted(needed)  # each needed shard opened once, nothing else

    # And the experts fused from per-expert tensors across shards are the reference's.
    full = AutoModelForCausalLM.from_pretrained(deepseek_dir, dtype=torch.float32).state_dict()
    for offset, layer in enumerate(stage.layers):
        for name, tensor in layer.state_dict().items():
            assert torch.equal(tensor, full[f"model.layers.{first + offset}.{name}"]), name


def test_a_missing_shard_the_stage_needs_is_named(sharded_dir: Path) -> None:
    first, end = STAGE
    shard = sorted(_shards_of(sharded_dir, (f"model.layers.{first}.",)))[0]
    (sharded_dir / shard).unlink()
    with pytest.raises(CheckpointError, match=shard):
        TorchEngine(sharded_dir, first, end)
