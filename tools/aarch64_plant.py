"""The aarch64 check's plant (tools/aarch64_check.sh): a 3-stage llama.cpp plant of the bundled
SmolLM2 GGUF under `edgebus up`, held token for token to llama.cpp running the whole GGUF in
this process, on the same (emulated) CPU.

Needs only the base install (no torch): run it with the edgebus venv's python.
`python tools/aarch64_plant.py whole PLANT` prints llama.cpp's whole-model answers to the
same requests for that plant's model, as JSON (what tools/aarch64_mixed.py compares with).
The reference is llama-cpp-python's plain path, `Llama.generate`, greedy; the prompts fit in
the coordinator's first prompt chunk, so the plant's chunking cannot make them differ
(tests/test_llamacpp.py holds the chunked whole-model path to the same `generate`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from whole_answer import whole

from edgebus import status_view
from edgebus.core.errors import EdgebusError
from edgebus.core.messages import ChatMessage, GenerateRequest
from edgebus.core.processes import LOOPBACK, free_port
from edgebus.model_import import bundled_gguf
from edgebus.status_view import agent_ids
from plant_config import Plant, load_plant, make_plant, write_plant

STAGES = 3
MAX_TOKENS = 16
# Chat requests through the file's chat template, and verbatim prompts.
REQUESTS = [
    GenerateRequest(id="chat", messages=[ChatMessage(role="user", content="What is a PLC?")],
                    max_tokens=MAX_TOKENS),
    GenerateRequest(id="raw", prompt="The three most common causes of motor failure are",
                    max_tokens=MAX_TOKENS),
    GenerateRequest(id="chat-2", messages=[ChatMessage(
        role="user", content="Why does a hydraulic pump get hot?")], max_tokens=MAX_TOKENS),
    GenerateRequest(id="raw-2", prompt="To calibrate a pressure sensor, first",
                    max_tokens=MAX_TOKENS),
]
# Under qemu-user a core runs ~20x slower than the host's: the agents took ~80 s to come
# online and decoded ~1 token/s (docs/install-a-box.md). Bounds on failing, not waits.
READY_S = 900.0
REQUEST_TIMEOUT_S = 900.0
STATUS_POLL_S = 5.0


def plant_file(directory: Path, model: Path | None = None,
               plant_id: str = "aarch64") -> tuple[Plant, Path]:
    """The plant `edgebus init --stages 3` writes for `model` (the bundled GGUF), on a free
    loopback port, with room for emulation's pace."""
    plant = make_plant(model or bundled_gguf(), stages=STAGES, weights="gguf",
                       plant_id=plant_id)
    plant = plant.model_copy(update={
        "broker": plant.broker.model_copy(update={"host": LOOPBACK, "port": free_port()}),
        "coordinator": plant.coordinator.model_copy(
            update={"request_timeout_s": REQUEST_TIMEOUT_S})})
    path = directory / "plant.yaml"
    write_plant(plant, path)
    return plant, path


def wait_online(plant: Plant, up: subprocess.Popen[bytes]) -> float:
    """Seconds until every agent of the plant reported online."""
    start = time.monotonic()
    wanted = set(agent_ids(plant))
    while time.monotonic() - start < READY_S:
        if up.poll() is not None:
            sys.exit(f"edgebus up exited with {up.returncode} before the plant was online")
        try:
            data = status_view.report(plant, asyncio.run(status_view.collect(plant)))
        except EdgebusError as exc:  # the broker is not listening yet
            print(exc, flush=True)
        else:
            if wanted <= {a["agent_id"] for a in data["agents"] if a["state"] == "online"}:
                return time.monotonic() - start
        time.sleep(STATUS_POLL_S)
    sys.exit(f"the plant's agents were not all online within {READY_S:.0f} s")


def ask(plant_path: Path, request: GenerateRequest) -> list[int]:
    """The plant's answer through `edgebus ask`, as its users ask."""
    text = request.prompt if request.messages is None else request.messages[0].content
    cmd = [sys.executable, "-m", "edgebus", "ask", str(plant_path), str(text),
           "--max-tokens", str(request.max_tokens), "--json"]
    if request.messages is None:
        cmd.append("--raw")
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    if out.get("error"):
        sys.exit(f"{request.id}: the plant answered an error: {out['error']}")
    tokens: list[int] = out["tokens"]
    return tokens


def compare(answers: dict[str, list[int]], references: dict[str, list[int]], what: str) -> bool:
    """Print the plant's answers beside `what`'s; whether every one is token-exact."""
    exact = True
    for request in REQUESTS:
        ours, theirs = answers[request.id], references[request.id]
        same = sum(a == b for a, b in zip(ours, theirs, strict=False))
        exact &= ours == theirs
        print(f"{request.id}: plant {ours}\n{request.id}: {what} {theirs}\n{request.id}: "
              f"{'token-exact' if ours == theirs else 'DIFFERENT'}, {same} of {len(theirs)} "
              "ids at the same place", flush=True)
    return exact


def ask_all(path: Path) -> dict[str, list[int]]:
    answers = {}
    for request in REQUESTS:
        start = time.monotonic()
        answers[request.id] = ask(path, request)
        print(f"{request.id}: {len(answers[request.id])} tokens in "
              f"{time.monotonic() - start:.0f} s", flush=True)
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("whole", nargs="?", choices=["whole"],
                        help="print llama.cpp's whole-model answers for PLANT as JSON")
    parser.add_argument("plant", nargs="?", type=Path, help="the plant file (with `whole`)")
    args = parser.parse_args()
    if args.whole:
        plant = load_plant(args.plant)
        print(json.dumps({r.id: whole(plant, r) for r in REQUESTS}))
        return
    with tempfile.TemporaryDirectory(prefix="edgebus-aarch64-") as tmp:
        plant, path = plant_file(Path(tmp))
        with (Path(tmp) / "up.out").open("wb") as log:
            up = subprocess.Popen([sys.executable, "-m", "edgebus", "up", str(path)],
                                  stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            print(f"agents online after {wait_online(plant, up):.0f} s", flush=True)
            answers = ask_all(path)
        finally:
            up.terminate()
            up.wait()
            print((Path(tmp) / "up.out").read_text(errors="replace")[-4000:], flush=True)
        exact = compare(answers, {r.id: whole(plant, r) for r in REQUESTS}, "whole")
        sys.exit(0 if exact else 1)


if __name__ == "__main__":
    main()
