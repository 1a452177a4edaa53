"""The token's own path: what a decode step costs outside the stages' layers, per broker.

One plant per broker (the embedded amqtt, and Mosquitto on a free port), SmolLM2's
three stages of one thread each as `edgebus up` starts them, plain MQTT as the bench
harness runs its plants. Rounds take turns between the plants, in a rotating order, so
both see the same minutes of the box. A round is single-stream requests of 64 tokens.

Per token, in CPU milliseconds (user + system, from /proc): the coordinator; the broker;
the stages in all; and the stages' frame handling, which is their CPU less the CPU time of
their `llama_decode` calls (`compute_cpu_s` in their status: the calling thread's, which
is all of it with one thread a stage).

    PYTHONPATH=. python benchmarks/token_path.py --rounds 3

`--tree NAME=DIR`, given twice or more, runs a plant of each source tree on each broker,
its agents importing edgebus from DIR (a second checkout: `git worktree add`), all of them
up at once and taking turns by the round. A change to the token's path is compared so in
the same minutes of a shared box: the load moves these numbers by more than such a change.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from broker.mosquitto import MosquittoProcess, mosquitto_version
from edgebus.core.errors import EdgebusError
from edgebus.launcher import READY_TIMEOUT_S, PlantProcesses
from edgebus.model_import import ensure_demo_model
from harness import process_cpu
from harness.gateway import Gateway
from harness.runner import METRICS_WAIT_S, _plant, _start
from harness.workload import chat_request, request_id

BROKERS = ("amqtt", "mosquitto")
STAGES = 3
TOKENS = 64
REQUESTS = 2  # single-stream requests a plant answers in a round
TIMEOUT_S = 600.0


def _start_plant(broker: str, model_dir: Path, work: Path, stack: contextlib.ExitStack,
                 name: str = "", tree: Path | None = None
                 ) -> tuple[PlantProcesses, dict[str, list[int]]]:
    url = None
    extra: list[int] = []
    work.mkdir(exist_ok=True)
    if broker == "mosquitto":
        mosquitto = stack.enter_context(MosquittoProcess(work / "mosquitto"))
        url = mosquitto.url
        if mosquitto.pid is not None:
            extra.append(mosquitto.pid)
    plant = _plant(model_dir, "-".join(filter(None, ("token-path", name, broker))), STAGES,
                   url=url, weights="gguf", threads=1)
    with _importing_from(tree):
        processes = _start(plant, work, stack)
    roles = process_cpu.roles(processes)
    roles["broker"] += extra
    return processes, roles


@contextlib.contextmanager
def _importing_from(tree: Path | None) -> Iterator[None]:
    """Agents started in here import edgebus from `tree`: the launcher passes its own
    environment on, and PYTHONPATH comes before the installed (editable) package."""
    if tree is None:
        yield
        return
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(tree)
    try:
        yield
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


async def _round(gateway: Gateway, stages: list[str], roles: dict[str, list[int]]
                 ) -> dict[str, float]:
    metrics = await gateway.fresh_metrics(stages, time.time(), METRICS_WAIT_S)
    before = {role: process_cpu.cpu_s(pids) for role, pids in roles.items()}
    traces = [await gateway.generate(chat_request(request_id("path"), TOKENS), TIMEOUT_S)
              for _ in range(REQUESTS)]
    cpu = {role: process_cpu.cpu_s(pids) - before[role] for role, pids in roles.items()}
    after = await gateway.fresh_metrics(stages, time.time(), METRICS_WAIT_S)
    if metrics is None or after is None:
        raise EdgebusError(f"the stages did not publish their status within {METRICS_WAIT_S} s")
    compute = sum(after[s]["compute_cpu_s"] - metrics[s]["compute_cpu_s"] for s in stages)
    tokens = sum(t.tokens for t in traces)
    row = {f"{role}_ms": cpu[role] * 1e3 / tokens for role in roles}
    row["frame_handling_ms"] = (cpu["stage"] - compute) * 1e3 / tokens
    row["step_ms"] = sum(t.done - t.sent for t in traces) * 1e3 / tokens
    row["load"] = os.getloadavg()[0]
    return row


async def _measure(plants: dict[str, tuple[PlantProcesses, dict[str, list[int]]]],
                   rounds: int) -> dict[str, list[dict[str, float]]]:
    results: dict[str, list[dict[str, float]]] = {}
    async with contextlib.AsyncExitStack() as stack:
        gateways = {}
        for name, (processes, _) in plants.items():
            await processes.wait_online(READY_TIMEOUT_S)
            gateways[name] = await stack.enter_async_context(Gateway(processes.plant))
            await gateways[name].generate(chat_request(request_id("warm"), TOKENS), TIMEOUT_S)
        names = list(plants)
        for turn in range(rounds):
            for name in names[turn % len(names):] + names[:turn % len(names)]:
                processes, roles = plants[name]
                stages = [spec.node for spec in processes.plant.stages]
                row = await _round(gateways[name], stages, roles)
                results.setdefault(name, []).append(row)
                print(turn, name, {k: round(v, 2) for k, v in row.items()}, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--brokers", default=",".join(BROKERS),
                        help=f"comma-separated, of {', '.join(BROKERS)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", action="append", default=[], metavar="NAME=DIR",
                        help="a plant of the source tree DIR on each broker (give two or more "
                             "to compare them in the same minutes)")
    args = parser.parse_args()
    brokers = args.brokers.split(",")
    trees: dict[str, Path | None] = {"": None}
    if args.tree:
        trees = {}
        for tree in args.tree:
            name, _, path = tree.partition("=")
            if not name or not (Path(path) / "edgebus" / "__init__.py").is_file():
                parser.error(f"--tree {tree}: give NAME=DIR, DIR an edgebus checkout "
                             "(git worktree add DIR main)")
            trees[name] = Path(path).resolve()
    if unknown := set(brokers) - set(BROKERS):
        parser.error(f"--brokers: unknown {', '.join(sorted(unknown))}; choose from "
                     f"{', '.join(BROKERS)}")
    if "mosquitto" in brokers and mosquitto_version() is None:
        parser.error("--brokers mosquitto: no mosquitto binary on PATH; install it "
                     "(apt install mosquitto) or leave it out")
    model_dir = ensure_demo_model()
    with tempfile.TemporaryDirectory(prefix="token-path-") as work, \
            contextlib.ExitStack() as stack:
        plants = {"/".join(filter(None, (name, b))): _start_plant(
                      b, model_dir, Path(work) / (name or b), stack, name, tree)
                  for b in brokers for name, tree in trees.items()}
        results = asyncio.run(_measure(plants, args.rounds))
    print("medians, CPU ms a token")
    for name, rows in results.items():
        medians = {key: round(statistics.median(row[key] for row in rows), 2) for key in rows[0]}
        print(f"{name} ({len(rows)} rounds): {medians}")


if __name__ == "__main__":
    main()
