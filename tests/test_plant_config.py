"""The plant file: round trips, layer splits, and the error an engineer sees for each mistake."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from edgebus.core.errors import PlantConfigError
from plant_config import (
    BrokerSettings,
    Plant,
    even_split,
    load_plant,
    make_plant,
    write_plant,
)
from plant_config.loader import init_plant_file

NUM_LAYERS = 30
SECRET = "s3cr3t-pw"


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": NUM_LAYERS,
                                                   "hidden_size": 64}))
    return model


def plant_dict(**overrides: Any) -> dict[str, Any]:
    """A valid plant file's content for the `model` fixture, with top-level overrides."""
    data: dict[str, Any] = {
        "plant_id": "plant-a",
        "topic_root": "edgebus/plant-a",
        "model": "model",
        "stages": [{"node": "stage-0", "layers": [0, 10]},
                   {"node": "stage-1", "layers": [10, 20]},
                   {"node": "stage-2", "layers": [20, 30]}],
    }
    data.update(overrides)
    return data


def write_yaml(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "plant.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def load_error(path: Path) -> str:
    with pytest.raises(PlantConfigError) as caught:
        load_plant(path)
    return str(caught.value)


def stages(*ranges: tuple[int, int]) -> list[dict[str, Any]]:
    return [{"node": f"stage-{i}", "layers": list(r)} for i, r in enumerate(ranges)]


# --- happy paths -------------------------------------------------------------------------


def test_make_write_load_round_trip(tmp_path: Path, model_dir: Path) -> None:
    plant = make_plant(model_dir, stages=4, broker=f"mqtt://user:{SECRET}@broker.local:1884")
    path = tmp_path / "plant.yaml"
    write_plant(plant, path)
    assert load_plant(path) == plant
    text = path.read_text()
    assert text.startswith("#")
    assert "layers: [0, 8]" in text
    assert "model: model\n" in text  # relative: the file and the model directory move together


def test_make_plant_defaults(model_dir: Path) -> None:
    plant = make_plant(model_dir)
    assert [s.node for s in plant.stages] == ["stage-0", "stage-1", "stage-2"]
    assert [s.layers for s in plant.stages] == [(0, 10), (10, 20), (20, 30)]
    assert plant.topic_root == "edgebus/plant"
    assert plant.model == model_dir.resolve()
    assert plant.num_layers == NUM_LAYERS
    assert plant.stage_index("stage-2") == 2
    assert plant.topics.activations("stage-1") == "edgebus/plant/act/stage-1"
    assert plant.broker.embedded


def test_stage_index_unknown_names_known_nodes(model_dir: Path) -> None:
    with pytest.raises(PlantConfigError, match="'stage-0', 'stage-1', 'stage-2'"):
        make_plant(model_dir).stage_index("stage-9")


def test_num_hidden_layers_nested_in_text_config(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "vision_config": {"num_hidden_layers": 24}, "text_config": {"num_hidden_layers": 12}}))
    assert make_plant(model).num_layers == 12


def test_relative_model_path_resolves_against_plant_file(
        tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_yaml(tmp_path, plant_dict())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    plant = load_plant(os.path.relpath(path, elsewhere))
    assert plant.model == model_dir.resolve()
    assert plant.model.is_absolute()


def test_init_plant_file_refuses_to_overwrite(tmp_path: Path, model_dir: Path) -> None:
    path = tmp_path / "plant.yaml"
    plant = init_plant_file(path, model_dir, stages=2)
    assert [s.layers for s in plant.stages] == [(0, 15), (15, 30)]
    with pytest.raises(PlantConfigError, match="already exists"):
        init_plant_file(path, model_dir, stages=5)
    assert init_plant_file(path, model_dir, stages=5, force=True).num_layers == NUM_LAYERS
    assert len(load_plant(path).stages) == 5


# --- even_split ---------------------------------------------------------------------------


@pytest.mark.parametrize(("num_layers", "n_stages"),
                         [(30, 3), (7, 3), (5, 5), (1, 1), (100, 7), (30, 1)])
def test_even_split_properties(num_layers: int, n_stages: int) -> None:
    ranges = even_split(num_layers, n_stages)
    assert len(ranges) == n_stages
    assert ranges[0][0] == 0 and ranges[-1][1] == num_layers
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    sizes = [stop - first for first, stop in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # earlier stages get the extra layers


def test_even_split_examples() -> None:
    assert even_split(30, 3) == [(0, 10), (10, 20), (20, 30)]
    assert even_split(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert even_split(3, 3) == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("n_stages", [31, 0])
def test_even_split_rejects_impossible(n_stages: int) -> None:
    with pytest.raises(PlantConfigError, match=f"{n_stages} stages"):
        even_split(30, n_stages)


# --- errors: layers -----------------------------------------------------------------------


def test_overlap(tmp_path: Path, model_dir: Path) -> None:
    path = write_yaml(tmp_path, plant_dict(stages=stages((0, 10), (8, 20), (20, 30))))
    message = load_error(path)
    assert message.startswith(f"{path}: stages[1].layers: [8, 20] overlaps stages[0] [0, 10]")
    assert "layers 8-9 are owned twice" in message


def test_gap_between_stages(tmp_path: Path, model_dir: Path) -> None:
    path = write_yaml(tmp_path, plant_dict(stages=stages((0, 10), (12, 30))))
    assert f"{path}: stages: layers 10-11 are owned by no stage" in load_error(path)


def test_gap_at_the_end(tmp_path: Path, model_dir: Path) -> None:
    path = write_yaml(tmp_path, plant_dict(stages=stages((0, 10), (10, 20))))
    message = load_error(path)
    assert f"{path}: stages: layers 20-29 are owned by no stage" in message
    assert "num_hidden_layers = 30" in message


def test_beyond_num_hidden_layers(tmp_path: Path, model_dir: Path) -> None:
    path = write_yaml(tmp_path, plant_dict(stages=stages((0, 10), (10, 20), (20, 31))))
    assert load_error(path) == (
        f"{path}: stages[2].layers: [20, 31] goes beyond the model's num_hidden_layers = 30 "
        f"(from {(model_dir / 'config.json').resolve()})")


def test_out_of_order_and_empty_range(tmp_path: Path, model_dir: Path) -> None:
    path = write_yaml(tmp_path, plant_dict(stages=stages((10, 20), (0, 10), (20, 30))))
    assert "stages[1].layers: [0, 10] starts before stages[0] [10, 20]" in load_error(path)
    path = write_yaml(tmp_path, plant_dict(stages=stages((0, 10), (10, 10), (10, 30))))
    assert "stages[1].layers: [10, 10] holds no layer" in load_error(path)


def test_adjacent_nodes_with_the_same_layers_are_replicas(tmp_path: Path,
                                                          model_dir: Path) -> None:
    plant = load_plant(write_yaml(tmp_path, plant_dict(stages=stages(
        (0, 10), (10, 20), (10, 20), (20, 30)))))
    assert [(s.index, s.layers, s.node_ids) for s in plant.pipeline] == [
        (0, (0, 10), ["stage-0"]), (1, (10, 20), ["stage-1", "stage-2"]),
        (2, (20, 30), ["stage-3"])]
    assert plant.stage_index("stage-2") == 1 and plant.stage_index("stage-3") == 2


def test_replicas_apart_from_each_other_are_refused(tmp_path: Path, model_dir: Path) -> None:
    path = write_yaml(tmp_path, plant_dict(stages=stages((0, 10), (10, 30), (0, 10))))
    assert "stage's replicas next to each other" in load_error(path)


def test_init_writes_replicas(tmp_path: Path, model_dir: Path) -> None:
    plant = init_plant_file(tmp_path / "plant.yaml", model_dir, stages=2, replicas=2)
    assert [s.node_ids for s in plant.pipeline] == [["stage-0-a", "stage-0-b"],
                                                    ["stage-1-a", "stage-1-b"]]
    with pytest.raises(PlantConfigError, match=r"replicas must be 1\.\.8"):
        make_plant(model_dir, replicas=9)


def test_liveness_timeout_must_outlast_heartbeats(tmp_path: Path, model_dir: Path) -> None:
    path = write_yaml(tmp_path, plant_dict(liveness={"heartbeat_s": 5, "timeout_s": 5}))
    assert "liveness.timeout_s: 5.0 s is not longer than heartbeat_s" in load_error(path)


def test_duplicate_node_ids(tmp_path: Path, model_dir: Path) -> None:
    data = plant_dict()
    data["stages"][2]["node"] = "stage-0"
    message = load_error(write_yaml(tmp_path, data))
    assert "stages[2].node: 'stage-0' is already the node of stages[0]" in message


def test_coordinator_id_clashes_with_node(tmp_path: Path, model_dir: Path) -> None:
    path = write_yaml(tmp_path, plant_dict(coordinator={"id": "stage-1"}))
    assert "coordinator.id: 'stage-1' is also a stage node id" in load_error(path)


def test_bad_topic_levels(tmp_path: Path, model_dir: Path) -> None:
    data = plant_dict(topic_root="edgebus//a/")
    data["stages"][0]["node"] = "stage/0"
    message = load_error(write_yaml(tmp_path, data))
    assert "topic_root: 'edgebus//a/' cannot be a topic root" in message
    assert "stages[0].node: node id 'stage/0' cannot be an MQTT topic level" in message


# --- errors: the file and the model directory ---------------------------------------------


def test_missing_model_dir(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, plant_dict(model="nowhere"))
    message = load_error(path)
    assert message.startswith(f"{path}: model: no model directory at {tmp_path / 'nowhere'}")
    assert "edgebus model import-gguf SRC.gguf" in message


def test_missing_config_json(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    message = load_error(write_yaml(tmp_path, plant_dict()))
    assert f"looked for {tmp_path / 'model' / 'config.json'}" in message
    assert "import-gguf" in message


def test_model_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "smollm.bin").write_bytes(b"GGUF")
    message = load_error(write_yaml(tmp_path, plant_dict(model="smollm.bin")))
    assert f"model: {tmp_path / 'smollm.bin'} is a file, not a model directory" in message
    assert "name it with its .gguf suffix" in message
    assert f"edgebus model import-gguf {tmp_path / 'smollm.bin'} DIR" in message


def test_a_gguf_model_that_is_no_gguf(tmp_path: Path) -> None:
    (tmp_path / "smollm.gguf").write_bytes(b"GGUF")  # the magic, and nothing after it
    stages = [{**stage, "weights": "gguf"} for stage in plant_dict()["stages"]]
    message = load_error(write_yaml(tmp_path, plant_dict(model="smollm.gguf", stages=stages)))
    assert f"model: cannot read {tmp_path / 'smollm.gguf'} as a GGUF file" in message


def test_no_stages(tmp_path: Path, model_dir: Path) -> None:
    assert "stages: no stages" in load_error(write_yaml(tmp_path, plant_dict(stages=[])))


def test_make_plant_missing_model_dir(tmp_path: Path) -> None:
    with pytest.raises(PlantConfigError, match=r"no model directory at .*import-gguf"):
        make_plant(tmp_path / "nowhere")


def test_unknown_fields_suggest_the_right_name(tmp_path: Path, model_dir: Path) -> None:
    data = plant_dict(broker={"urll": "embedded"}, wire_dtyp="float32")
    data["stages"][1]["threds"] = 2
    path = write_yaml(tmp_path, data)
    lines = load_error(path).splitlines()
    assert f"{path}: broker.urll: unknown field — did you mean 'url'?" in lines
    assert f"{path}: wire_dtyp: unknown field — did you mean 'wire_dtype'?" in lines
    assert f"{path}: stages[1].threds: unknown field — did you mean 'threads'?" in lines
    assert len(lines) == 3  # every problem, each on its own line


def test_all_problems_listed_with_field_paths(tmp_path: Path, model_dir: Path) -> None:
    data = plant_dict(wire_dtype="int8", coordinator={"candidates": 0})
    del data["plant_id"]
    data["stages"][0]["layers"] = [0, "ten"]
    lines = load_error(write_yaml(tmp_path, data)).splitlines()
    fields = [line.split(": ")[1] for line in lines]
    assert fields == ["plant_id", "wire_dtype", "stages[0].layers[1]", "coordinator.candidates"]


def test_bad_yaml_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "plant.yaml"
    path.write_text("plant_id: a\nstages:\n  - node: [unclosed\n")
    message = load_error(path)
    assert message.startswith(f"{path}: line ")
    assert "invalid YAML" in message


def test_yaml_that_is_not_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "plant.yaml"
    path.write_text("- just\n- a list\n")
    assert "expected a mapping" in load_error(path)


def test_file_not_found(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    message = load_error(path)
    assert message.startswith(f"{path}: no such plant file")
    assert "edgebus init" in message


def test_schema_errors_without_a_file_are_pydantic_errors(model_dir: Path) -> None:
    # Code that builds a Plant directly gets the same checks.
    with pytest.raises(ValidationError, match="overlaps"):
        Plant.model_validate(plant_dict(model=model_dir, stages=stages((0, 10), (5, 30))))


# --- broker ---------------------------------------------------------------------------------


def test_url_with_credentials_and_port() -> None:
    endpoint = BrokerSettings(url="mqtt://u:p@h:1884").endpoint()
    assert (endpoint.host, endpoint.port, endpoint.tls) == ("h", 1884, False)
    assert (endpoint.username, endpoint.password, endpoint.protocol) == ("u", "p", "5")


def test_mqtts_default_port_and_tls() -> None:
    endpoint = BrokerSettings(url="mqtts://broker.example.com").endpoint()
    assert (endpoint.port, endpoint.tls, endpoint.username) == (8883, True, None)
    assert BrokerSettings(url="mqtt://h").endpoint().port == 1883


def test_embedded_endpoint() -> None:
    endpoint = BrokerSettings(host="10.0.0.5", port=1999).endpoint()
    assert (endpoint.host, endpoint.port, endpoint.tls, endpoint.protocol) == (
        "10.0.0.5", 1999, False, "3.1.1")


def test_percent_encoded_credentials() -> None:
    endpoint = BrokerSettings(url="mqtt://op%40plant:p%3Aw@h").endpoint()
    assert (endpoint.username, endpoint.password) == ("op@plant", "p:w")


def test_embedded_with_protocol_5(tmp_path: Path, model_dir: Path) -> None:
    path = write_yaml(tmp_path, plant_dict(broker={"url": "embedded", "protocol": 5}))
    message = load_error(path)
    assert f"{path}: broker.protocol: '5' needs an external broker" in message
    assert "3.1.1" in message


def test_credentials_twice(tmp_path: Path, model_dir: Path) -> None:
    broker = {"url": f"mqtt://u:{SECRET}@h", "username": "u", "password": SECRET}
    message = load_error(write_yaml(tmp_path, plant_dict(broker=broker)))
    assert "broker.url: has credentials, and so do username/password" in message
    assert SECRET not in message


@pytest.mark.parametrize(("url", "fact"), [
    ("http://h", "scheme 'http' is not supported"),
    ("mqtt://", "has no host"),
    (f"mqtt://u:{SECRET}@h:port", "is not a broker URL"),
    ("mqtt://h/topic", "must not have a path"),
])
def test_bad_urls(tmp_path: Path, model_dir: Path, url: str, fact: str) -> None:
    message = load_error(write_yaml(tmp_path, plant_dict(broker={"url": url})))
    assert f"broker.url: {fact}" in message
    assert SECRET not in message


def test_embedded_only_fields_with_a_url(tmp_path: Path, model_dir: Path) -> None:
    broker = {"url": "mqtt://h", "port": 1884, "ca_file": "ca.pem"}
    lines = load_error(write_yaml(tmp_path, plant_dict(broker=broker))).splitlines()
    assert [line.split(": ")[1] for line in lines] == ["broker.port", "broker.ca_file"]


def test_ca_file_resolved_and_checked(tmp_path: Path, model_dir: Path) -> None:
    broker = {"url": "mqtts://h", "ca_file": "ca.pem"}
    path = write_yaml(tmp_path, plant_dict(broker=broker))
    assert f"broker.ca_file: {tmp_path / 'ca.pem'} is not a file" in load_error(path)
    (tmp_path / "ca.pem").write_text("not really a certificate")
    assert load_plant(path).broker.endpoint().ca_file == tmp_path / "ca.pem"


def test_password_never_printed(tmp_path: Path, model_dir: Path) -> None:
    plant = make_plant(model_dir, broker=f"mqtts://operator:{SECRET}@h")
    assert SECRET not in repr(plant)
    assert SECRET not in str(plant)
    assert SECRET not in plant.broker.url
    assert SECRET not in repr(plant.broker.endpoint())
    assert plant.broker.endpoint().password == SECRET
    # ...but the plant file keeps it, readable by its owner only.
    path = tmp_path / "plant.yaml"
    write_plant(plant, path)
    assert f"password: {SECRET}" in path.read_text()
    assert path.stat().st_mode & 0o077 == 0
    # Errors in a file holding a password do not quote it.
    data = yaml.safe_load(path.read_text())
    data["broker"]["keepalive_s"] = "often"
    data["broker"]["password"] = 1234
    message = load_error(write_yaml(tmp_path, data))
    assert "broker.keepalive_s" in message and "broker.password" in message
    assert "often" not in message and "1234" not in message
