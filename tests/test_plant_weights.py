"""The plant file's per-node weight mode, and `edgebus init --weights`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from edgebus.cli import main
from edgebus.errors import PlantConfigError
from plant_config import load_plant


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 6, "hidden_size": 64}))
    return model


def test_init_sets_the_weight_mode_of_every_node(tmp_path: Path, model_dir: Path) -> None:
    path = tmp_path / "plant.yaml"
    main(["init", str(path), "--model", str(model_dir), "--stages", "3", "--weights", "int8"])
    assert [s.weights for s in load_plant(path).stages] == ["int8"] * 3
    main(["init", str(path), "--model", str(model_dir), "--stages", "2", "--force"])
    assert [s.weights for s in load_plant(path).stages] == ["fp32"] * 2  # the default


def test_init_refuses_a_mode_there_is_none_of(tmp_path: Path, model_dir: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["init", str(tmp_path / "plant.yaml"), "--model", str(model_dir),
              "--weights", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_modes_can_differ_per_node_and_a_wrong_one_is_named(tmp_path: Path,
                                                             model_dir: Path) -> None:
    path = tmp_path / "plant.yaml"

    def write(second: str) -> None:
        path.write_text(yaml.safe_dump({
            "plant_id": "p", "topic_root": "edgebus/p", "model": "model",
            "stages": [{"node": "stage-0", "layers": [0, 3]},
                       {"node": "stage-1", "layers": [3, 6], "weights": second}]}))

    write("bf16")
    assert [s.weights for s in load_plant(path).stages] == ["fp32", "bf16"]
    write("q4")
    with pytest.raises(PlantConfigError, match=r"stages\[1\]\.weights"):
        load_plant(path)
