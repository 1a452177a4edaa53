"""The command line as a newcomer meets it: every argument says what it wants."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from edgebus.cli import build_parser, mosquitto_config_parser


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


def test_model_bundled_names_the_gguf_the_readme_imports() -> None:
    printed = subprocess.run([sys.executable, "-m", "edgebus", "model", "bundled"],
                             capture_output=True, text=True, check=True).stdout.strip()
    path = Path(printed)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes()[:4] == b"GGUF"
