"""An alarm storm: many PLC gateways each publish a burst of short requests at once
(docs/benchmarks.md, "An alarm storm").

    python benchmarks/alarm_storm.py [--gateways 16] [--requests 25] [--tokens 16]
        [--stages 3] [--bounded-queue 100]

Mosquitto on a free port, and a llama.cpp plant of the bundled SmolLM2 GGUF as
`make_plant` splits it, every agent a process (`edgebus.launcher.PlantProcesses`).
First each distinct request is answered alone, one after the other: the answers
the storm's must equal token for token. Then the storm, three times: with the plant's
default waiting room (`coordinator.max_queue`), where every request should be
answered, with the room's bound set to --bounded-queue, where what neither
starts nor fits in the room is answered `busy` at once with a retry time, and
with no room (`max_queue: 0`), the coordinator as it was before issue 44, the
peer of the first run. Each request must get exactly one answer every time.
Reported per run: answered, token-exact, busy (when the busy answers came, and
the retry times asked), each gateway's last served answer after the storm
began, and the ratio of the slowest gateway's to the median gateway's (target
<= 1.5).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiomqtt

from broker.mosquitto import MosquittoProcess
from edgebus.core.client import NODELAY
from edgebus.core.messages import GenerateRequest, GenerateResponse
from edgebus.launcher import READY_TIMEOUT_S, PlantProcesses
from edgebus.model_import import bundled_gguf
from plant_config import Plant, make_plant, write_plant

# What a PLC asks about an alarm: a line of text in, a short answer out. One prompt per
# request index, the same for every gateway, so each has one answer computed alone.
ALARMS = [
    "Press 3 hydraulic pressure low. Likely cause:",
    "Conveyor 7 motor overcurrent. First check:",
    "Axis 2 following error on the robot cell. Operator action:",
    "Compressor 1 discharge temperature high. Likely cause:",
    "Packaging line 4 film break. First check:",
    "Boiler feedwater level low alarm. Operator action:",
    "Oven zone 2 temperature deviation. Likely cause:",
    "Filler valve 12 stuck open. First check:",
    "Palletizer light curtain tripped. Operator action:",
    "Chiller flow switch alarm. Likely cause:",
    "Mixer gearbox vibration high. First check:",
    "Labeler sensor misread rate high. Operator action:",
]
# Far beyond the storm's length on 2 cores: only a stuck plant reaches it.
STORM_TIMEOUT_S = 1800.0
# aiomqtt warns of every publish past its tenth pending one: a burst of 25 at once is the
# point here, and the warnings (15 a gateway) would bury the report.
quiet_mqtt = logging.getLogger("edgebus.bench.alarm_storm.mqtt")
quiet_mqtt.setLevel(logging.ERROR)


@dataclass
class GatewayRun:
    """One gateway's storm: its answers, and when each came after the storm began."""

    client_id: str
    answers: dict[str, GenerateResponse] = field(default_factory=dict)
    copies: int = 0  # answers beyond the first for a request id (must stay 0)
    at: dict[str, float] = field(default_factory=dict)


@dataclass
class StormResult:
    label: str
    max_queue: int
    sent: int
    gateways: list[GatewayRun]
    exact: int
    wall_s: float

    def answers(self) -> list[tuple[GatewayRun, str, GenerateResponse]]:
        return [(gw, rid, a) for gw in self.gateways for rid, a in gw.answers.items()]


def storm_request(gateway: int, index: int, tokens: int) -> GenerateRequest:
    return GenerateRequest(id=f"g{gateway}-r{index}", prompt=ALARMS[index % len(ALARMS)],
                           max_tokens=tokens, ignore_eos=True)


def plant_file(model: Path, url: str, workdir: Path, stages: int, max_queue: int | None,
               name: str) -> Path:
    # A topic root of its own: a run cut short leaves requests journaled and retained
    # statuses behind, which the next run must not meet under the same names.
    plant = make_plant(model, stages=stages, broker=url, plant_id=name, weights="gguf",
                       topic_root=f"edgebus-bench/{name}-{secrets.token_hex(4)}")
    if max_queue is not None:
        plant = plant.model_copy(update={"coordinator": plant.coordinator.model_copy(
            update={"max_queue": max_queue})})
    path = workdir / f"{name}.yaml"
    write_plant(plant, path)
    return path


async def ask_alone(plant: Plant, requests: list[GenerateRequest]) -> dict[str, list[int]]:
    """Each request answered alone, one after the other: the tokens the storm must give."""
    run = GatewayRun("alone")
    async with _client(plant, "alone") as client:
        for request in requests:
            await _publish(client, plant, "alone", [request])
            await _receive(client, run, {request.id}, time.monotonic())
    wrong = {rid: a.error for rid, a in run.answers.items() if a.error is not None}
    if wrong:
        raise SystemExit(f"a request answered alone failed: {wrong}")
    return {rid: a.tokens for rid, a in run.answers.items()}


async def storm(plant: Plant, label: str, gateways: int, per_gateway: int, tokens: int,
                alone: dict[str, list[int]]) -> StormResult:
    """Every gateway publishes its burst at the same moment; wait for every answer."""
    runs = [GatewayRun(f"plc-{g:02d}") for g in range(gateways)]
    bursts = [[storm_request(g, i, tokens) for i in range(per_gateway)] for g in range(gateways)]
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(_client(plant, run.client_id))
                   for run in runs]
        started = time.monotonic()
        await asyncio.gather(*(_publish(c, plant, run.client_id, burst)
                               for c, run, burst in zip(clients, runs, bursts, strict=True)))
        async with asyncio.timeout(STORM_TIMEOUT_S):
            await asyncio.gather(*(_receive(c, run, {r.id for r in burst}, started)
                                   for c, run, burst in zip(clients, runs, bursts, strict=True)))
        wall = time.monotonic() - started
        # A second answer to any request would have come by now: the coordinator answers
        # each once, and the broker keeps one client's messages in order.
        await asyncio.sleep(1.0)
    exact = sum(1 for gw in runs for rid, a in gw.answers.items()
                if a.error is None and a.tokens == alone[_alone_id(rid)])
    return StormResult(label, plant.coordinator.max_queue, gateways * per_gateway, runs,
                       exact, wall)


def _alone_id(storm_id: str) -> str:
    return f"alone-{int(storm_id.split('-r')[1]) % len(ALARMS)}"


@contextlib.asynccontextmanager
async def _client(plant: Plant, client_id: str) -> AsyncIterator[aiomqtt.Client]:
    endpoint = plant.broker.endpoint()
    client = aiomqtt.Client(endpoint.host, endpoint.port,
                            identifier=f"{plant.plant_id}.{client_id}",
                            socket_options=[NODELAY], max_queued_incoming_messages=0,
                            logger=quiet_mqtt)
    async with client:
        await client.subscribe(plant.topics.response_filter(client_id), qos=1)
        yield client


async def _publish(client: aiomqtt.Client, plant: Plant, client_id: str,
                   burst: list[GenerateRequest]) -> None:
    topic = plant.topics.request(client_id)
    await asyncio.gather(*(client.publish(topic, r.model_dump_json(exclude_none=True), qos=1)
                           for r in burst))


async def _receive(client: aiomqtt.Client, run: GatewayRun, wanted: set[str],
                   started: float) -> None:
    async for message in client.messages:
        if message.topic.value.endswith("/stream") or not isinstance(message.payload, bytes):
            continue
        answer = GenerateResponse.model_validate_json(message.payload)
        if answer.id in run.answers:
            run.copies += 1
        else:
            run.answers[answer.id] = answer
            run.at[answer.id] = time.monotonic() - started
        if wanted <= run.answers.keys():
            return


def report(result: StormResult) -> str:
    answers = result.answers()
    served = [a for _, _, a in answers if a.error is None]
    busy = [(gw, rid, a) for gw, rid, a in answers
            if a.error is not None and a.error.code == "busy"]
    other = sorted({a.error.code for _, _, a in answers
                    if a.error is not None and a.error.code != "busy"})
    # A gateway's last answer that carried tokens: in the bounded run its `busy` answers
    # come at once, and the question is how long its served ones took.
    lasts = [max((gw.at[rid] for rid, a in gw.answers.items() if a.error is None),
                 default=0.0) for gw in result.gateways]
    median = statistics.median(lasts)
    copies = sum(gw.copies for gw in result.gateways)
    missing = result.sent - len(answers)
    lines = [f"### {result.label} (coordinator.max_queue {result.max_queue})", "",
             f"- answered: {len(served)}/{result.sent}, token-exact against the request "
             f"alone: {result.exact}/{len(served)}",
             f"- busy: {len(busy)}; other errors: {', '.join(other) or 'none'}; "
             f"lost: {missing}; answered twice: {copies}"]
    if busy:
        at = [gw.at[rid] for gw, rid, _ in busy]
        retry = [a.error.retry_after_s or 0.0 for _, _, a in busy if a.error is not None]
        lines.append(f"- busy answers came {min(at):.2f}-{max(at):.2f} s after the storm "
                     f"began; retry_after_s asked: {min(retry):.1f}-{max(retry):.1f} s")
    lines += [f"- storm to last answer: {result.wall_s:.1f} s",
              "- each gateway's last served answer (s): "
              + ", ".join(f"{t:.1f}" for t in lasts),
              f"- slowest gateway / median gateway: {max(lasts):.1f} / {median:.1f} s = "
              + (f"{max(lasts) / median:.2f}x" if median > 0 else
                 "n/a (the median gateway had no request served)"), ""]
    return "\n".join(lines)


async def run(args: argparse.Namespace, workdir: Path) -> str:
    model = bundled_gguf()
    # The coordinators' journals in the run's own directory (its agents inherit this).
    os.environ["EDGEBUS_HOME"] = str(workdir / "home")
    out = [f"{args.gateways} gateways x {args.requests} requests of {args.tokens} tokens, "
           f"{args.stages} llama.cpp stages of {model.name}, Mosquitto; "
           f"load before: {os.getloadavg()[0]:.1f}", ""]
    with MosquittoProcess(workdir / "mosquitto") as mosquitto:
        variants = [("waiting room as the plant file defaults it", None),
                    (f"waiting room bounded at {args.bounded_queue}", args.bounded_queue),
                    ("no waiting room: busy at once, as before issue 44", 0)]
        alone: dict[str, list[int]] = {}
        for n, (label, max_queue) in enumerate(variants):
            path = plant_file(model, mosquitto.url, workdir, args.stages, max_queue,
                              f"storm{n}")
            with PlantProcesses(path, log_dir=workdir / f"logs{n}") as processes:
                processes.start()
                await processes.wait_online(READY_TIMEOUT_S)
                plant = processes.plant
                if not alone:
                    alone = await ask_alone(plant, [
                        storm_request(0, i, args.tokens).model_copy(update={"id": f"alone-{i}"})
                        for i in range(min(len(ALARMS), args.requests))])
                result = await storm(plant, label, args.gateways, args.requests, args.tokens,
                                     alone)
                out.append(report(result))
                print(out[-1], flush=True)
    out.append(f"load after: {os.getloadavg()[0]:.1f}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--gateways", type=int, default=16)
    parser.add_argument("--requests", type=int, default=25, help="per gateway, at once")
    parser.add_argument("--tokens", type=int, default=16, help="each request's max_tokens")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--bounded-queue", type=int, default=100,
                        help="coordinator.max_queue of the second run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="edgebus-storm-") as tmp:
        text = asyncio.run(run(args, Path(tmp)))
    print(text)


if __name__ == "__main__":
    main()
