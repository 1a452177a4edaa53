"""The command line as a newcomer meets it: every argument says what it wants."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
from brokers import free_port

from edgebus.ask import BROKER_WAIT_S
from edgebus.cli import build_parser, mosquitto_config_parser
from edgebus.processes import LOOPBACK
from plant_config import make_plant, write_plant


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parsers(sub)
    return found


def test_every_argument_has_help() -> None:
    missing = [f"{parser.prog} {action.dest}"
               for parser in [*_parsers(build_parser()), mosquitto_config_parser()]
               for action in parser._actions
               if not isinstance(action, argparse._SubParsersAction) and not action.help]
    assert missing == []


@pytest.mark.parametrize("argv", [["ask", "plant.yaml", "--raw", "Alarm 4711", "--json"],
                                  ["ask", "--raw", "plant.yaml", "Alarm 4711"],
                                  ["ask", "plant.yaml", "Alarm 4711", "--raw"]])
def test_options_and_positionals_come_in_any_order(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert (args.plant, args.text, args.raw) == ("plant.yaml", "Alarm 4711", True)


def test_model_bundled_names_the_gguf_the_readme_imports() -> None:
    printed = subprocess.run([sys.executable, "-m", "edgebus", "model", "bundled"],
                             capture_output=True, text=True, check=True).stdout.strip()
    path = Path(printed)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes()[:4] == b"GGUF"



def test_ask_with_no_broker_says_so_within_seconds(tiny_llama: Path, tmp_path: Path) -> None:
    """Not "the coordinator is not online" half a minute later: nothing listens at all."""
    plant = make_plant(tiny_llama, stages=1, broker="embedded", plant_id="nobroker")
    plant = plant.model_copy(update={"broker": plant.broker.model_copy(
        update={"host": LOOPBACK, "port": free_port()})})
    write_plant(plant, tmp_path / "plant.yaml")
    # The text after an option, as users type it: once refused ("unrecognized arguments").
    asked = subprocess.run([sys.executable, "-m", "edgebus", "ask", str(tmp_path / "plant.yaml"),
                            "--raw", "Hello"], capture_output=True, text=True,
                           timeout=BROKER_WAIT_S * 12)
    assert asked.returncode != 0
    assert f"no MQTT broker answers at {LOOPBACK}:{plant.broker.port}" in asked.stderr
    assert "edgebus up" in asked.stderr and "coordinator" not in asked.stderr
