"""The command line as a newcomer meets it: every argument says what it wants."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from brokers import MosquittoBroker, free_port

from edgebus.ask import BROKER_WAIT_S, COORDINATOR_WAIT_S
from edgebus.cli import build_parser, mosquitto_config_parser
from edgebus.core.paths import GGUF_FILE
from edgebus.core.processes import LOOPBACK
from plant_config import CoordinatorSpec, load_plant, make_plant, write_plant
from plant_config.credentials import password_path


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



# `edgebus` whose edgebus.ask constant named in argv[1] (a wait) is the number in argv[2]:
# set in that process only, before its command line is read. What `ask` says when nothing
# answers is unchanged; the product's wait was most of each test's time.
def ask_with_wait(constant: str, seconds: float) -> list[str]:
    return [sys.executable, "-c", "import sys, edgebus.ask as ask; "
            "setattr(ask, sys.argv[1], float(sys.argv[2])); "
            "from edgebus.cli import main; main(sys.argv[3:])", constant, str(seconds)]


# Past the client's first retry (0.25 s), so the wait still spans a refused reconnect.
QUICK_BROKER_WAIT_S = 0.5
# No coordinator ever runs, so any wait for its status ends the same; the product's 1 s
# (QUIET_WAIT_S) was the test's idle time.
QUICK_QUIET_WAIT_S = 0.1


def test_ask_with_no_broker_says_so_within_seconds(tiny_llama: Path, tmp_path: Path) -> None:
    """Not "the coordinator is not online" half a minute later: nothing listens at all."""
    plant = make_plant(tiny_llama, stages=1, broker="embedded", plant_id="nobroker")
    plant = plant.model_copy(update={"broker": plant.broker.model_copy(
        update={"host": LOOPBACK, "port": free_port()})})
    write_plant(plant, tmp_path / "plant.yaml")
    # The text after an option, as users type it: once refused ("unrecognized arguments").
    asked = subprocess.run([*ask_with_wait("BROKER_WAIT_S", QUICK_BROKER_WAIT_S),
                            "ask", str(tmp_path / "plant.yaml"), "--raw", "Hello"],
                           capture_output=True, text=True, timeout=BROKER_WAIT_S * 12)
    assert asked.returncode != 0
    assert f"no MQTT broker answers at {LOOPBACK}:{plant.broker.port}" in asked.stderr
    assert "edgebus up" in asked.stderr and "coordinator" not in asked.stderr


def test_init_whose_reader_left_writes_the_whole_plant_without_a_traceback(
        tiny_llama_gguf: Path, tmp_path: Path) -> None:
    """`edgebus init ... | head -3`: once a BrokenPipeError traceback, after the plant file and
    before its passwords. Here the reader has left before init says anything."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        done = subprocess.run([sys.executable, "-m", "edgebus", "init", str(tmp_path / "p.yaml"),
                               "--model", str(tiny_llama_gguf)], stdout=writer,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(writer)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 128 + signal.SIGPIPE
    plant = load_plant(tmp_path / "p.yaml")
    assert plant.security is not None
    missing = [i for i in plant.identities()
               if not password_path(plant.security.credentials, i).exists()]
    assert missing == []


@pytest.mark.parametrize(("model", "weights"), [("gguf file", "gguf"),
                                                 ("imported directory", "gguf"),
                                                 ("safetensors only", "fp32")])
def test_init_runs_a_gguf_on_llamacpp_and_safetensors_alone_on_torch(
        tiny_llama: Path, tiny_llama_gguf: Path, tmp_path: Path, model: str,
        weights: str) -> None:
    """llama.cpp is the main path: a model with a GGUF (the file, or the directory an import
    writes, which keeps it as model.gguf) gets llama.cpp stages; torch only without one."""
    path = {"gguf file": tiny_llama_gguf / GGUF_FILE, "imported directory": tiny_llama_gguf,
            "safetensors only": tiny_llama}[model]
    done = subprocess.run([sys.executable, "-m", "edgebus", "init", str(tmp_path / "p.yaml"),
                           "--model", str(path), "--insecure"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert {stage.weights for stage in load_plant(tmp_path / "p.yaml").stages} == {weights}


def test_init_onto_an_existing_file_refuses_before_profiling_the_model(tmp_path: Path) -> None:
    """--example profiles the model first (24 s of the bundled one): the refusal comes before,
    so a model that is not there is never even looked at."""
    (tmp_path / "plant.yaml").write_text("kept: true\n")
    done = subprocess.run([sys.executable, "-m", "edgebus", "init", str(tmp_path / "plant.yaml"),
                           "--model", str(tmp_path / "no-model.gguf"), "--example", "jetson-2pi"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "already exists — not overwriting it" in done.stderr, done.stderr
    assert (tmp_path / "plant.yaml").read_text() == "kept: true\n"


def test_a_stage_whose_engine_needs_the_torch_extra_says_so(tiny_llama: Path,
                                                            tmp_path: Path) -> None:
    """`weights: int8` (onnxruntime) on a base install died of ModuleNotFoundError 'onnx'.
    Here onnx is made unimportable as Python's import system allows (None in sys.modules)."""
    plant = make_plant(tiny_llama, stages=1, plant_id="noonnx", weights="int8")
    write_plant(plant, tmp_path / "plant.yaml")
    code = ("import sys; sys.modules['onnx'] = None; from edgebus.cli import main; "
            f"main(['node', {str(tmp_path / 'plant.yaml')!r}, '--id', 'stage-0'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert "engine onnxruntime (weights: int8) needs the `torch` extra" in done.stderr
    assert 'pip install torch==2.13.0 "edgebus[torch]"' in done.stderr
    assert "Traceback" not in done.stderr


def test_a_command_that_needs_the_torch_extra_says_so(tiny_llama_gguf: Path,
                                                      tmp_path: Path) -> None:
    """`edgebus model import-gguf` on a base install died of ModuleNotFoundError
    'transformers'. Here transformers is made unimportable (None in sys.modules)."""
    code = ("import sys; sys.modules['transformers'] = None; from edgebus.cli import main; "
            f"main(['model', 'import-gguf', {str(tiny_llama_gguf / GGUF_FILE)!r}, "
            f"{str(tmp_path / 'imported')!r}])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert ("`edgebus model import-gguf` needs the `torch` extra here, and transformers"
            in done.stderr)
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "imported").exists()


def test_the_help_says_what_the_defaults_are() -> None:
    """`node --threads` is llama.cpp's too; `http --max-in-flight` defaults to the gateway's
    share (client_limit), not the coordinator's whole max_in_flight."""
    helps = {f"{parser.prog} {action.dest}": action.help or ""
             for parser in _parsers(build_parser()) for action in parser._actions}
    assert "llama.cpp" in helps["edgebus node threads"]
    assert "torch threads" not in helps["edgebus node threads"]
    assert "3/4 of its max_in_flight" in helps["edgebus http max_in_flight"]
    assert CoordinatorSpec(max_in_flight=8).client_limit == 6  # what the help says


def test_ask_says_it_waits_for_a_coordinator_that_is_not_online(
        tiny_llama: Path, tmp_path: Path, mosquitto_broker: MosquittoBroker) -> None:
    """A broker and no coordinator: `ask` waited COORDINATOR_WAIT_S in silence, then said so.
    It says what it waits for at once; the test stops it there."""
    plant = make_plant(tiny_llama, stages=1, plant_id="nocoord", broker=mosquitto_broker.url)
    write_plant(plant, tmp_path / "plant.yaml")
    asking = subprocess.Popen([*ask_with_wait("QUIET_WAIT_S", QUICK_QUIET_WAIT_S), "ask",
                               str(tmp_path / "plant.yaml"), "Hello"],
                              stderr=subprocess.PIPE, text=True)
    try:
        assert asking.stderr is not None
        said = ""
        while "waiting up to" not in said and asking.poll() is None:
            said = asking.stderr.readline()
    finally:
        asking.kill()
        asking.wait()
    assert (f"coordinator 'coordinator' is not online (its status at "
            f"{plant.topics.status('coordinator')} is not there): waiting up to "
            f"{COORDINATOR_WAIT_S:.0f} s") in said


def test_mosquitto_config_of_an_embedded_broker_plant_says_why_only_passwd(
        tiny_llama_gguf: Path, tmp_path: Path) -> None:
    plant_path = tmp_path / "plant.yaml"
    for argv in (["init", str(plant_path), "--model", str(tiny_llama_gguf)],
                 ["broker", "mosquitto-config", str(plant_path), str(tmp_path / "out")]):
        done = subprocess.run([sys.executable, "-m", "edgebus", *argv], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["passwd"]
    assert "the plant's broker is the embedded one" in done.stdout
    assert "only the password file" in done.stdout
