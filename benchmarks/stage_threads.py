"""Stage threads and libgomp's spin on one box: SmolLM2 plants against llama.cpp whole.

Every variant's plant is started at once as `edgebus up` starts it (its own embedded
broker, its stages' threads, GOMP_SPINCOUNT in their environment); then rounds take turns,
each in another order, so that every variant sees the same minutes of a shared box:
llama.cpp whole in one process on all the box's cores (llama-cpp-python, a child process,
libgomp's own spin), then each plant, single stream. Last, 8 concurrent per plant.

    PYTHONPATH=. python benchmarks/stage_threads.py 1 2:300000 2:10000 --rounds 3 --loaded-rounds 1

A variant is THREADS[:GOMP_SPINCOUNT]; without a spin count, the launcher's own
(edgebus.launcher.STAGE_SPINCOUNT). `--stages` splits the model (3 by default). Decode
tok/s: tokens after the first over the time between them. CPU ms a token: the stages'
user + system time over the tokens they made; the same of the coordinator and of the
broker beside it, which is what a token costs beyond the layers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

from edgebus.core.processes import cores
from edgebus.launcher import READY_TIMEOUT_S, PlantProcesses
from edgebus.model_import import bundled_gguf, ensure_demo_model
from harness import baseline, process_cpu
from harness.gateway import Gateway, closed_loop
from harness.metrics import Trace, inter_token_latencies, load_stats
from harness.peers import ARRIVAL_SEED
from harness.runner import _plant
from harness.workload import chat_request, request_id
from node_agent.text import prompt_ids
from plant_config import write_plant

TOKENS = 64
REQUESTS = 2  # single-stream requests a plant answers in a round
CONCURRENCY = 8
TIMEOUT_S = 600.0


def _decode_tok_s(traces: list[Trace]) -> float:
    gaps = [gap for trace in traces for gap in inter_token_latencies(trace)]
    return len(gaps) / sum(gaps)


def _start(variant: str, stages: int, model_dir: Path, work: Path, stack: contextlib.ExitStack
           ) -> PlantProcesses:
    threads, _, spin = variant.partition(":")
    plant = _plant(model_dir, f"threads-{threads}-spin-{spin or 'default'}", stages,
                   weights="gguf", threads=int(threads))
    path = work / f"{plant.plant_id}.yaml"
    write_plant(plant, path)
    processes = stack.enter_context(PlantProcesses(path, log_dir=work / plant.plant_id))
    # The environment's value goes before the launcher's; the stages keep the one they start with.
    os.environ.pop("GOMP_SPINCOUNT", None)
    if spin:
        os.environ["GOMP_SPINCOUNT"] = spin
    try:
        processes.start()
    finally:
        os.environ.pop("GOMP_SPINCOUNT", None)
    return processes


async def _measure(plants: dict[str, PlantProcesses], ids: list[int], rounds: int,
                   loaded_rounds: int) -> dict[str, list[dict[str, float]]]:
    results: dict[str, list[dict[str, float]]] = {}
    async with contextlib.AsyncExitStack() as stack:
        gateways = {}
        for name, processes in plants.items():
            await processes.wait_online(READY_TIMEOUT_S)
            gateways[name] = await stack.enter_async_context(Gateway(processes.plant))
            await gateways[name].generate(chat_request(request_id("warm"), TOKENS), TIMEOUT_S)
        names = ["whole", *plants]
        for turn in range(rounds):
            for name in names[turn % len(names):] + names[:turn % len(names)]:
                row = {"load": os.getloadavg()[0]}
                if name == "whole":
                    whole = await asyncio.to_thread(baseline.run_llama_cpp, bundled_gguf(), ids,
                                                    tokens=TOKENS, runs=REQUESTS,
                                                    threads=cores())
                    assert whole is not None, "llama-cpp-python did not run"
                    row["decode_tok_s"] = 1 / whole.itl_p50_s
                else:
                    roles = process_cpu.roles(plants[name])
                    before = {role: process_cpu.cpu_s(pids) for role, pids in roles.items()}
                    traces = [await gateways[name].generate(
                        chat_request(request_id("single"), TOKENS), TIMEOUT_S)
                        for _ in range(REQUESTS)]
                    row["decode_tok_s"] = _decode_tok_s(traces)
                    tokens = sum(t.tokens for t in traces)
                    for role, pids in roles.items():
                        used = process_cpu.cpu_s(pids) - before[role]
                        row[f"{role}_cpu_ms_a_token"] = used * 1e3 / tokens
                results.setdefault(name, []).append(row)
                print(turn, name, {k: round(v, 1) for k, v in row.items()}, flush=True)
        for turn in range(loaded_rounds):
            for name in list(plants)[::1 if turn % 2 == 0 else -1]:
                traces = await closed_loop(
                    gateways[name], lambda: chat_request(request_id("load"), TOKENS),
                    concurrency=CONCURRENCY, requests_each=2, seed=ARRIVAL_SEED,
                    timeout=TIMEOUT_S)
                row = {"load": os.getloadavg()[0],
                       f"{CONCURRENCY}_concurrent_tok_s": load_stats(CONCURRENCY, traces).tok_s}
                results.setdefault(f"{name} at {CONCURRENCY}", []).append(row)
                print(turn, name, {k: round(v, 1) for k, v in row.items()}, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="+", help="THREADS[:GOMP_SPINCOUNT] of every stage")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--loaded-rounds", type=int, default=2)
    args = parser.parse_args()
    model_dir = ensure_demo_model()
    ids = prompt_ids(AutoTokenizer.from_pretrained(model_dir), chat_request("ids", TOKENS))
    with tempfile.TemporaryDirectory(prefix="stage-threads-") as work, \
            contextlib.ExitStack() as stack:
        plants = {v: _start(v, args.stages, model_dir, Path(work), stack)
                  for v in args.variants}
        results = asyncio.run(_measure(plants, ids, args.rounds, args.loaded_rounds))
    whole = statistics.median(row["decode_tok_s"] for row in results["whole"])
    print(f"medians; llama.cpp whole: {cores()} threads")
    for name, rows in results.items():
        medians = {key: round(statistics.median(row[key] for row in rows), 2) for key in rows[0]}
        if "decode_tok_s" in medians:
            medians["x_whole"] = round(medians["decode_tok_s"] / whole, 2)
        print(f"{name} ({len(rows)} rounds): {medians}")


if __name__ == "__main__":
    main()
