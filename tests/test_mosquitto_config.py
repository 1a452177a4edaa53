"""The plant file's security and brokers sections, and what `broker mosquitto-config` writes.

The brokers enforcing these files are tested in test_broker_security.py and
test_broker_bridge.py; here: the files themselves, the command, and the
plant-file checks with the messages a plant engineer reads.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
import yaml

from broker.acl import access_rules
from broker.passwd import verify_password
from edgebus.cli import main
from edgebus.core.errors import PlantConfigError
from plant_config import load_plant, write_plant
from plant_config.credentials import password_path, read_password


def write_plant_file(tmp_path: Path, **extra: object) -> Path:
    """A plant file with a 6-layer model stub, two stages with a standby each, and `extra`."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 6}))
    data = {"plant_id": "p", "topic_root": "edgebus/p", "model": "model",
            "broker": {"url": "mqtt://broker.local:1883"},
            "stages": [{"node": "s0a", "layers": [0, 3]}, {"node": "s0b", "layers": [0, 3]},
                       {"node": "s1a", "layers": [3, 6]}, {"node": "s1b", "layers": [3, 6]}],
            "security": {"credentials": "credentials", "gateways": ["plc-1"], "ops": ["ops"]},
            **extra}
    path = tmp_path / "plant.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_command_writes_private_files_and_keeps_passwords(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]
                                                              ) -> None:
    plant_file = write_plant_file(tmp_path)
    main(["broker", "mosquitto-config", str(plant_file), str(tmp_path / "out")])
    assert "wrote" in capsys.readouterr().out
    identities = ["s0a", "s0b", "s1a", "s1b", "coordinator", "plc-1", "ops"]
    for path in [*(tmp_path / "out").iterdir(), *(tmp_path / "credentials").iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    hashes = dict(line.split(":", 1) for line in
                  (tmp_path / "out" / "passwd").read_text().splitlines())
    assert sorted(hashes) == sorted(identities)
    passwords = {i: read_password(tmp_path / "credentials", i) for i in identities}
    assert all(verify_password(passwords[i], hashes[i]) for i in identities)
    conf = (tmp_path / "out" / "mosquitto.conf").read_text()
    assert "allow_anonymous false" in conf and "listener 1883" in conf
    assert f"acl_file {tmp_path / 'out' / 'acl'}" in conf
    # A second run keeps every box's password: only missing ones are made.
    main(["broker", "mosquitto-config", str(plant_file), str(tmp_path / "out")])
    assert passwords == {i: read_password(tmp_path / "credentials", i) for i in identities}


def test_the_rules_give_each_identity_its_own_topics_only(tmp_path: Path) -> None:
    rules = access_rules(load_plant(write_plant_file(tmp_path)))
    act = "edgebus/p/act/"
    assert rules["s0a"].read == (act + "s0a",)
    # Either node of the next stage (a route may take either), and the coordinator.
    assert set(rules["s0a"].write) == {act + "s1a", act + "s1b", act + "coordinator",
                                       "edgebus/p/status/s0a", "edgebus/p/events"}
    assert set(rules["s1b"].write) == {act + "coordinator", "edgebus/p/status/s1b",
                                       "edgebus/p/events"}
    assert rules["plc-1"].write == ("edgebus/p/llm/request/plc-1", "edgebus/p/llm/cancel/plc-1")
    assert rules["ops"].write == ()
    assert {act + n for n in ["s0a", "s0b", "s1a", "s1b"]} <= set(rules["coordinator"].write)


def test_a_plant_without_security_gets_a_clear_error(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    plant_file = write_plant_file(tmp_path, security=None)
    with pytest.raises(SystemExit):
        main(["broker", "mosquitto-config", str(plant_file), str(tmp_path / "out")])
    assert "no security: section" in capsys.readouterr().err


def test_a_password_file_open_to_others_is_refused(tmp_path: Path) -> None:
    password_path(tmp_path, "s0a").write_text("pw\n")
    password_path(tmp_path, "s0a").chmod(0o644)
    with pytest.raises(PlantConfigError, match="chmod 600"):
        read_password(tmp_path, "s0a")


@pytest.mark.parametrize(("extra", "message"), [
    ({"stages": [{"node": "s0", "layers": [0, 6], "broker": "line"}]},
     "stages[0].broker: 'line' is not in brokers:"),
    ({"brokers": {"line": {"url": "embedded"}}}, "brokers.line.url: a line broker must be"),
    ({"security": {"credentials": "c", "gateways": ["s0a"]}},
     "security: 's0a' is both a stage node and a gateway"),
    ({"security": {"credentials": "c", "tls": {"cafile": "a", "certfile": "b",
                                                "keyfile": "c"}}},
     "security.tls: the broker's url is not mqtts://"),
    ({"broker": {"url": "embedded"}},
     "security.password_file: required with the embedded broker"),
    ({"broker": {"url": "mqtt://shared:pw@broker.local"}},
     "broker.username: security: gives every identity its own user name and password"),
])
def test_plant_file_mistakes_are_named(tmp_path: Path, extra: dict[str, object],
                                       message: str) -> None:
    with pytest.raises(PlantConfigError) as caught:
        load_plant(write_plant_file(tmp_path, **extra))
    assert message in str(caught.value)


def test_security_and_line_brokers_survive_write_plant(tmp_path: Path) -> None:
    plant = load_plant(write_plant_file(
        tmp_path, brokers={"line": {"url": "mqtt://line.local:1883"}},
        stages=[{"node": "s0", "layers": [0, 3], "broker": "line"},
                {"node": "s1", "layers": [3, 6]}]))
    write_plant(plant, tmp_path / "again.yaml")
    assert load_plant(tmp_path / "again.yaml") == plant
    assert plant.broker_of("s0").url == "mqtt://line.local:1883"
    assert plant.broker_of("s1") == plant.broker
