"""A box without torch: a llama.cpp plant's agents import neither torch nor transformers.

The stage agents and the coordinator of a plant whose stages all run the
llamacpp engine need only llama.cpp, numpy, `tokenizers` and jinja2
(docs/install-a-box.md). Two checks: in this venv, which has torch, importing
them loads neither; and with torch and transformers made unimportable (a
directory ahead on PYTHONPATH whose `torch` and `transformers` packages raise
ImportError, and leave a mark of who imported them), `edgebus up` serves a
3-stage plant that answers token for token what llama.cpp answers whole, and
`edgebus demo` answers its question.

Which modules a process imports is a property of its code path, not of the model: the
plant runs the tiny Llama GGUF's directory, whose config.json the agents read without
transformers. A plant naming a GGUF file is what `edgebus demo` starts (the bundled SmolLM2
file, where the real model is the point), and tests/test_gguf_model.py holds such a plant
to llama.cpp whole.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_models import with_kv_budget
from test_launcher import READY_S, agent_ids, all_are, children_of, wait_exit, watch_statuses
from test_llamacpp import LIMITS, reference, requests
from tiny_models import build_tiny
from transformers import AutoConfig, GenerationConfig

from edgebus.ask import ask
from edgebus.core.processes import LOOPBACK, free_port, proc_status_bytes
from edgebus.launcher import STOP_GRACE_S
from node_agent.model_config import generation_eos, kv_bytes_per_token, load_config
from plant_config import make_plant, write_plant

BLOCKED = ("torch", "transformers")
# A blocked package's __init__: note who imported it (a guarded `try: import torch`
# would hide the ImportError), then refuse.
BLOCKER = """import os, traceback
with open(os.path.join({marks!r}, f"{{__name__}}-{{os.getpid()}}"), "w") as mark:
    mark.write("".join(traceback.format_stack()))
raise ImportError(f"{{__name__}} is blocked: a llama.cpp box has none")
"""
# What a llama.cpp box's agents import: the stage agent, its engine, the coordinator, and the
# CLI that starts them.
AGENT_MODULES = ("edgebus.cli", "edgebus.launcher", "node_agent.stage",
                 "node_agent.engines.llamacpp.engine", "node_agent.coordinator.agent",
                 "node_agent.gguf_tokenizer", "node_agent.costs", "node_agent.gguf_profile")
STOP_S = 2 * STOP_GRACE_S + 5.0
# A bound on a hung demo, not a timing claim: it answered in 9 s here (README.md).
DEMO_S = READY_S + STOP_S + 60.0


def test_a_llamacpp_agents_imports_load_neither_torch_nor_transformers() -> None:
    code = (f"import sys\nfor m in {AGENT_MODULES!r}: __import__(m)\n"
            f"print([m for m in {BLOCKED!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("family", ["smollm2", "llama", "qwen2", "mistral", "deepseek_v3"])
def test_the_config_read_without_transformers_is_autoconfigs(
        smollm2_dir: Path, tmp_path: Path, family: str) -> None:
    """What a llama.cpp box's agents read of config.json (sizes, the KV they book) and of
    generation_config.json (eos) is what transformers reads."""
    model = smollm2_dir if family == "smollm2" else build_tiny(family, tmp_path, smollm2_dir)
    ours, theirs = load_config(model), AutoConfig.from_pretrained(model)
    for key in ("hidden_size", "vocab_size", "num_hidden_layers"):
        assert getattr(ours, key) == getattr(theirs, key), key
    layers = (1, theirs.num_hidden_layers)
    assert kv_bytes_per_token(ours, layers) == kv_bytes_per_token(theirs, layers)
    assert generation_eos(model) == GenerationConfig.from_pretrained(model).eos_token_id


def _blocker(directory: Path) -> tuple[Path, Path]:
    """(a PYTHONPATH entry that blocks torch and transformers, where the marks go)."""
    marks = directory / "marks"
    marks.mkdir(parents=True)
    for name in BLOCKED:
        (directory / "path" / name).mkdir(parents=True)
        (directory / "path" / name / "__init__.py").write_text(BLOCKER.format(marks=str(marks)))
    return directory / "path", marks


@pytest.mark.slow
async def test_a_plant_without_torch_answers_what_llamacpp_answers_whole(
        tiny_llama_gguf: Path, tmp_path: Path) -> None:
    """The plant's model: a model directory (config.json, model.gguf)."""
    path, marks = _blocker(tmp_path / "blocker")
    source = tiny_llama_gguf
    plant = with_kv_budget(make_plant(source, stages=3, weights="gguf", plant_id="notorch"))
    plant = plant.model_copy(update={
        "broker": plant.broker.model_copy(update={"host": LOOPBACK, "port": free_port()}),
        "coordinator": plant.coordinator.model_copy(update=LIMITS)})
    plant_path = tmp_path / "plant.yaml"
    write_plant(plant, plant_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    # The chat request goes through the chat template, the long one in three prompt chunks.
    reqs = requests()[:4]
    agents = agent_ids(plant)
    with (tmp_path / "up.out").open("wb") as out:
        up = subprocess.Popen([sys.executable, "-m", "edgebus", "up", str(plant_path)],
                              stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                              env=env)
    try:
        async with watch_statuses(plant) as watch:
            online = await watch.wait(all_are(agents, "online"), READY_S)
            responses = [await ask(plant, r, client_id=f"gw{i}") for i, r in enumerate(reqs)]
            pids = {a: online[a].pid for a in agents}
            assert set(pids.values()) <= set(children_of(up.pid))
            for agent, pid in pids.items():
                maps = Path(f"/proc/{pid}/maps").read_text()
                assert "libtorch" not in maps, agent
                status = Path(f"/proc/{pid}/status").read_text()
                print(f"{agent}: RSS {proc_status_bytes(status, 'VmRSS') / 2**20:.0f} MiB, "
                      f"peak {proc_status_bytes(status, 'VmHWM') / 2**20:.0f} MiB")
                print(f"{agent}: {json.dumps(online[agent].engine or {})}")
        up.terminate()
        assert wait_exit(up, STOP_S) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        print((tmp_path / "up.out").read_text(errors="replace"))
    assert {p.name: p.read_text() for p in marks.iterdir()} == {}
    for request, response in zip(reqs, responses, strict=True):
        assert response.error is None, response.error
        assert response.tokens == reference(source, request), request.id


@pytest.mark.slow
def test_the_demo_answers_without_torch(tmp_path: Path) -> None:
    """`edgebus demo` as the README runs it first: the bundled GGUF on llama.cpp stages, no
    model import, on a box where torch and transformers cannot be imported."""
    path, marks = _blocker(tmp_path / "blocker")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    demo = subprocess.run([sys.executable, "-m", "edgebus", "demo"], capture_output=True,
                          text=True, env=env, stdin=subprocess.DEVNULL, timeout=DEMO_S)
    print(demo.stdout, demo.stderr)
    assert demo.returncode == 0
    assert {p.name: p.read_text() for p in marks.iterdir()} == {}
    # The answer the README quotes; the model's own end-of-turn ends it.
    assert "A programmable logic controller is" in demo.stdout
    assert "tokens in" in demo.stdout and "(stop)" in demo.stdout
