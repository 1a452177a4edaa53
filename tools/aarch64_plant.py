"""The aarch64 check's plant (tools/aarch64_check.sh): a 3-stage llama.cpp plant of the bundled
SmolLM2 GGUF under `edgebus up`, held token for token to llama.cpp running the whole GGUF in
this process, on the same (emulated) CPU. The four requests go at once, with drafts on for
all of them, 4 positions a frame: the stages verify frames of several positions in one call
as far as their load-time probes found it exact (exact_rows, else a call a position), and
what each stage measured and did is printed from the plant's status.

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
# Drafts in flight per request, spread over a frame per stage, 4 positions a frame (issue
# 42's target), pinned: the coordinator would choose 1 under emulation, where k positions
# in one call cost about k one-position calls (node_agent/speculation.py), and the check
# is there to hold frames of several positions to the reference.
DRAFTS = 12
POSITIONS_PER_FRAME = 4
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
    coordinator = plant.coordinator
    plant = plant.model_copy(update={
        "broker": plant.broker.model_copy(update={"host": LOOPBACK, "port": free_port()}),
        "coordinator": coordinator.model_copy(update={
            "request_timeout_s": REQUEST_TIMEOUT_S,
            # Drafts for every request, however many are in flight.
            "speculation": coordinator.speculation.model_copy(update={
                "drafts": DRAFTS, "max_in_flight": len(REQUESTS),
                "positions_per_frame": POSITIONS_PER_FRAME})})})
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


def asking(plant_path: Path, request: GenerateRequest) -> subprocess.Popen[str]:
    """`edgebus ask` of `request`, as its users ask, started."""
    text = request.prompt if request.messages is None else request.messages[0].content
    cmd = [sys.executable, "-m", "edgebus", "ask", str(plant_path), str(text),
           "--max-tokens", str(request.max_tokens), "--json"]
    if request.messages is None:
        cmd.append("--raw")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def answer(request: GenerateRequest, asked: subprocess.Popen[str]) -> list[int]:
    """The token ids `asked` printed."""
    out, _ = asked.communicate()
    if asked.returncode != 0:
        sys.exit(f"{request.id}: edgebus ask exited with {asked.returncode}")
    reply = json.loads(out)
    if reply.get("error"):
        sys.exit(f"{request.id}: the plant answered an error: {reply['error']}")
    tokens: list[int] = reply["tokens"]
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
    """Every request at once; their answers."""
    start = time.monotonic()
    asked = [(request, asking(path, request)) for request in REQUESTS]
    answers = {request.id: answer(request, running) for request, running in asked}
    print(f"{len(REQUESTS)} requests at once, {sum(map(len, answers.values()))} tokens in "
          f"{time.monotonic() - start:.0f} s", flush=True)
    return answers


def print_stages(plant: Plant) -> None:
    """What each agent measured and did, from the plant's status: a stage's exact_batch and
    exact_rows, its rows and calls, and the frames of several positions it verified (split:
    run a call a position); the coordinator's drafts (counted as requests end). Read from
    statuses sent after this call, each agent's next heartbeat: an earlier one may predate
    the last answers."""
    since, data = time.time(), None
    while time.time() - since < plant.liveness.timeout_s:
        data = status_view.report(plant, asyncio.run(status_view.collect(plant)))
        if all(a["status"] and a["status"]["ts"] > since for a in data["agents"]):
            break
        time.sleep(plant.liveness.heartbeat_s / 2)
    assert data is not None
    for agent in data["agents"]:
        status = agent["status"] or {}
        engine, m = status.get("engine") or {}, status.get("metrics") or {}
        if "exact_batch" in engine:
            print(f"{agent['agent_id']}: exact_batch {engine['exact_batch']}, exact_rows "
                  f"{engine['exact_rows']}; {m.get('rows', 0):.0f} rows in "
                  f"{m.get('steps', 0):.0f} calls; {m.get('verify_frames', 0):.0f} frames "
                  f"of {m.get('verify_positions', 0):.0f} positions verified, "
                  f"{m.get('verify_split', 0):.0f} split", flush=True)
        elif "drafts_proposed" in m:
            print(f"{agent['agent_id']}: {m['drafts_accepted']:.0f} of "
                  f"{m['drafts_proposed']:.0f} drafts taken", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("whole", nargs="?", choices=["whole"],
                        help="print llama.cpp's whole-model answers for PLANT as JSON")
    parser.add_argument("plant", nargs="?", type=Path, help="the plant file (with `whole`)")
    parser.add_argument("--model", type=Path,
                        help="a GGUF to run instead of the bundled one (its chat template, "
                             "if it has none, is llama.cpp's default)")
    args = parser.parse_args()
    if args.whole:
        plant = load_plant(args.plant)
        print(json.dumps({r.id: whole(plant, r) for r in REQUESTS}))
        return
    with tempfile.TemporaryDirectory(prefix="edgebus-aarch64-") as tmp:
        plant, path = plant_file(Path(tmp), args.model)
        with (Path(tmp) / "up.out").open("wb") as log:
            up = subprocess.Popen([sys.executable, "-m", "edgebus", "up", str(path)],
                                  stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            print(f"agents online after {wait_online(plant, up):.0f} s", flush=True)
            answers = ask_all(path)
            print_stages(plant)
        finally:
            up.terminate()
            up.wait()
            print((Path(tmp) / "up.out").read_text(errors="replace")[-4000:], flush=True)
        exact = compare(answers, {r.id: whole(plant, r) for r in REQUESTS}, "whole")
        sys.exit(0 if exact else 1)


if __name__ == "__main__":
    main()
