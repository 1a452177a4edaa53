"""The plant file's per-node weight mode, and `edgebus init --weights`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from edgebus.cli import main
from edgebus.core.errors import PlantConfigError
from plant_config import load_plant
from plant_config.schema import resolve_engine


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
              "--weights", "int2"])
    assert "invalid choice: 'int2'" in capsys.readouterr().err


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


@pytest.mark.parametrize(("stage", "message"), [
    ({"weights": "int4", "engine": "torch"}, "engine torch does not run int4 weights: use "
                                             "`engine: onnxruntime`"),
    ({"weights": "bf16", "engine": "onnxruntime"}, "engine onnxruntime does not run bf16"),
    ({"weights": "fp32", "device": "cuda"}, "device cuda runs on engine onnxruntime"),
])
def test_an_engine_that_cannot_run_the_mode_is_named(tmp_path: Path, model_dir: Path,
                                                      stage: dict[str, str], message: str) -> None:
    path = tmp_path / "plant.yaml"
    path.write_text(yaml.safe_dump({
        "plant_id": "p", "topic_root": "edgebus/p", "model": "model",
        "stages": [{"node": "stage-0", "layers": [0, 6], **stage}]}))
    with pytest.raises(PlantConfigError, match=r"stages\[0\]") as error:
        load_plant(path)
    assert message in str(error.value)


def test_auto_runs_fp32_on_torch_and_int4_on_onnxruntime(tmp_path: Path, model_dir: Path) -> None:
    path = tmp_path / "plant.yaml"
    path.write_text(yaml.safe_dump({
        "plant_id": "p", "topic_root": "edgebus/p", "model": "model",
        "stages": [{"node": "stage-0", "layers": [0, 3]},
                   {"node": "stage-1", "layers": [3, 6], "weights": "int4"}]}))
    stages = load_plant(path).stages
    assert [resolve_engine(s.engine, s.weights) for s in stages] == ["torch", "onnxruntime"]
