"""What each process of a plant imports: what it runs, not what another kind of process runs.

A suite run starts ~180 agent processes, and a box restarts its agents on every
failure: each pays for its imports in CPU before it comes online. Each check
here starts a fresh interpreter, takes one process kind's own path (its
modules, and for the coordinator and `edgebus up` the set-up they do before
connecting), and lists which of the modules that kind never runs were loaded:

- the coordinator of a llama.cpp plant on a model directory tokenizes from its
  tokenizer.json and books KV by llama.cpp's item size, so it loads neither
  gguf-py nor llama.cpp, nor the planner;
- `edgebus up` checks the plant fits this machine from the GGUF's header, without
  any engine;
- a stage agent loads its engine when it starts (llama.cpp, or torch), never the
  coordinator's tokenizer, and nothing of the broker.

torch and transformers, which no llama.cpp process imports at all, are
tests/test_no_torch.py's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

COORDINATOR_NEVER = ("gguf", "sentencepiece", "llama_cpp", "node_agent.engines.llamacpp",
                     "node_agent.fit", "plant_config.planner", "amqtt")
UP_NEVER = ("node_agent.engines", "llama_cpp", "jinja2", "tokenizers", "amqtt")
STAGE_NEVER = ("llama_cpp", "jinja2", "tokenizers", "node_agent.tokenizer", "amqtt")


def loaded(code: str, never: tuple[str, ...]) -> list[str]:
    """Which of `never` a fresh interpreter holds after running `code`."""
    check = f"\nimport json, sys\nprint(json.dumps([m for m in {never!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code + check], capture_output=True, text=True,
                         check=True)
    found: list[str] = json.loads(out.stdout.splitlines()[-1])
    return found


def plant_code(model: Path) -> str:
    return ("from plant_config import make_plant\n"
            f"plant = make_plant({str(model)!r}, weights='gguf')\n")


def test_the_coordinator_loads_no_gguf_reader_engine_or_planner(tiny_llama_gguf: Path,
                                                                 tmp_path: Path) -> None:
    code = ("import edgebus.cli\nfrom pathlib import Path\n"
            "from node_agent.coordinator.agent import Coordinator\n" + plant_code(tiny_llama_gguf)
            + f"Coordinator(plant, journal_dir=Path({str(tmp_path)!r}))\n")
    assert loaded(code, COORDINATOR_NEVER) == []


def test_up_checks_the_plant_fits_without_an_engine(tiny_llama_gguf: Path) -> None:
    code = ("import edgebus.cli, edgebus.launcher\n"
            "from node_agent.fit import check_plant_fits_here\n" + plant_code(tiny_llama_gguf)
            + "check_plant_fits_here(plant)\n")
    assert loaded(code, UP_NEVER) == []


def test_a_stage_agent_imports_no_engine_tokenizer_or_broker() -> None:
    assert loaded("import edgebus.cli, node_agent.runtime, node_agent.stage", STAGE_NEVER) == []
