"""The bench's speculation phase: a lone request with drafts and without, beside llama.cpp.

Two workloads:
- *quoting*: answers that repeat their prompt: an alarm to repeat, a paragraph to
  rewrite, an alarm summary with its numbers, a code edit;
- *free*: questions whose answers quote nothing.

Every request makes TOKENS tokens (end of sequence ignored, as everywhere in the bench).

The plant runs with drafts off and on in turns (off, on, off, on). Each turn is its own
processes over Mosquitto, all else alike, so the machine's drift over minutes falls on
both. Beside it runs llama.cpp in one process on all cores (llama-server, one slot), with
and without its own lookup decoding (peers.LOOKUP_DECODING). Last, 16 requests at once
with drafts off and on: there the pipeline is full, and speculation must step aside
(coordinator.speculation.max_in_flight).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from broker.mosquitto import MosquittoProcess
from edgebus.core.errors import EdgebusError
from edgebus.core.messages import ChatMessage, GenerateRequest
from edgebus.launcher import READY_TIMEOUT_S, PlantProcesses
from harness import peers
from harness.gateway import Gateway, closed_loop
from harness.metrics import LoadStats, StreamStats, Trace, load_stats, stream_stats
from harness.workload import chat_request, request_id
from node_agent.text import prompt_ids
from plant_config import Plant, write_plant
from plant_config.coordinator_section import Speculation

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Tokens per request: long enough that a quote is repeated whole, short enough that the
# phase takes minutes.
TOKENS = 64
# Drafts in flight on the plant: one fills the stage after the first, and on this box,
# where the stages share its cores, more drafts took turns from the token's own steps
# (measured: 3 stages on 2 cores, quoting, 53.4 tok/s with 1 draft, 49.2 with 2).
DRAFTS = 1
# Turns of (off, on): two, so that neither setting always runs first.
TURNS = 2
# Concurrency of the load check: the bench's highest.
LOAD_CONCURRENCY = 16
LOAD_REQUESTS_EACH = 2
REQUEST_TIMEOUT_S = 600.0
# The coordinator refreshes its retained status every heartbeat (2 s): fresh counters
# are due within that.
METRICS_WAIT_S = 6.0
_ALARM = ("ALARM 4711 press line 2: hydraulic oil temperature 71 C above limit 65 C, "
          "pump P2 stopped at 14:02, operator acknowledged at 14:05.")
_CODE = ("def total(items):\n    s = 0\n    for x in items:\n        s = s + x\n"
         "    return s\n")
_PARAGRAPH = ("The press line stops when the oil pressure in the main pump drops below the "
              "set point. The operator then resets the alarm on the panel, checks the filter "
              "and the valve, and restarts the line from the first station.")
QUOTING = (f"Repeat this alarm text word for word: {_ALARM}",
           f"Rewrite this paragraph in the passive voice: {_PARAGRAPH}",
           f"Summarise this alarm, quoting its numbers: {_ALARM}",
           f"Rename the variable s to acc in this code and show all of it:\n{_CODE}")
FREE = ("What does a PLC do in a factory? Answer in two sentences.",
        "Why do hydraulic pumps wear out? Give three reasons.",
        "Explain what a safety relay is to a new technician.",
        "What should a maintenance plan for a conveyor include?")
WORKLOADS = {"quoting": QUOTING, "free": FREE}
# The plant's warm-up asks none of the measured prompts: the coordinator keeps its answers
# (node_agent/ngram_cache.py), and a measured prompt asked before would draft its whole
# answer from the warm-up's.
WARMUP = "Name one part of a press line."


@dataclass(frozen=True)
class SpeculationRun:
    """One workload, single stream: the plant with drafts off and on, and llama.cpp."""

    model: str
    stages: int
    pinned: bool  # each stage on a core of its own, as on a plant of separate boxes
    drafts: int
    workload: str
    off: StreamStats
    on: StreamStats
    proposed: int  # drafts sent, over the on turns
    accepted: int  # ... and taken
    tokens: int  # tokens generated with drafts on
    llama_cpp: StreamStats | None  # whole, one process, all cores; None: tools not built
    llama_lookup: StreamStats | None  # ... with its own lookup decoding

    @property
    def gain(self) -> float:
        return self.on.tok_s / self.off.tok_s

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None


@dataclass(frozen=True)
class SpeculationLoad:
    """LOAD_CONCURRENCY closed-loop clients, drafts off and on."""

    concurrency: int
    off: LoadStats
    on: LoadStats

    @property
    def ratio(self) -> float:
        return self.on.tok_s / self.off.tok_s


def requests(workload: str) -> list[GenerateRequest]:
    return [GenerateRequest(id=request_id(f"spec-{workload}"), max_tokens=TOKENS,
                            ignore_eos=True, stream=True,
                            messages=[ChatMessage(role="user", content=text)])
            for text in WORKLOADS[workload]]


def measure(model: str, plant_on: Callable[[str], Plant], workdir: Path,
            tokenizer: PreTrainedTokenizerBase, gguf: Path | None, *, threads: int, load: bool,
            notes: list[str], pin: bool = False
            ) -> tuple[list[SpeculationRun], SpeculationLoad | None]:
    """The phase on the llama.cpp plant `plant_on(broker_url)` gives: single stream per
    workload, drafts off and on, and llama.cpp on `gguf` with `threads`; with `load`,
    LOAD_CONCURRENCY at once too; with `pin`, stage i on usable core i only."""
    settings = {False: Speculation(), True: Speculation(drafts=DRAFTS)}
    traces: dict[tuple[bool, str], list[Trace]] = {}
    drafted: dict[str, tuple[int, int]] = {}
    loads: dict[bool, LoadStats] = {}
    stages = 0
    for turn in range(TURNS):
        for on in (False, True):
            name = f"speculation-{'on' if on else 'off'}-{turn}"

            def plant_for(url: str, on: bool = on, name: str = name) -> Plant:
                plant = plant_on(url)
                return plant.model_copy(update={"plant_id": name, "coordinator":
                                                plant.coordinator.model_copy(
                                                    update={"speculation": settings[on]})})

            single, counts, loaded, stages = _turn(plant_for, workdir / name,
                                                   load and turn == TURNS - 1, pin)
            for workload, got in single.items():
                traces.setdefault((on, workload), []).extend(got)
                if on:
                    before = drafted.get(workload, (0, 0))
                    drafted[workload] = (before[0] + counts[workload][0],
                                         before[1] + counts[workload][1])
            if loaded is not None:
                loads[on] = loaded
    llama, lookup = _llama_cpp(gguf, tokenizer, threads, workdir, notes)
    runs = [SpeculationRun(model=model, stages=stages, pinned=pin, drafts=DRAFTS,
                           workload=workload, off=stream_stats(traces[(False, workload)]),
                           on=stream_stats(traces[(True, workload)]),
                           proposed=drafted[workload][0], accepted=drafted[workload][1],
                           tokens=sum(t.tokens for t in traces[(True, workload)]),
                           llama_cpp=llama.get(workload), llama_lookup=lookup.get(workload))
            for workload in WORKLOADS]
    under_load = (SpeculationLoad(LOAD_CONCURRENCY, loads[False], loads[True])
                  if len(loads) == 2 else None)
    return runs, under_load


def _turn(plant_for: Callable[[str], Plant], workdir: Path, load: bool, pin: bool
          ) -> tuple[dict[str, list[Trace]], dict[str, tuple[int, int]], LoadStats | None, int]:
    """One plant, started as `edgebus up` starts it, over a Mosquitto of its own."""
    with contextlib.ExitStack() as stack:
        mosquitto = stack.enter_context(MosquittoProcess(workdir / "mosquitto"))
        plant = plant_for(mosquitto.url)
        path = workdir / "plant.yaml"
        write_plant(plant, path)
        cores = sorted(os.sched_getaffinity(0))
        pins = ({spec.node: [cores[i % len(cores)]] for i, spec in enumerate(plant.stages)}
                if pin else None)
        processes = stack.enter_context(PlantProcesses(path, log_dir=workdir / "logs",
                                                       cpus=pins))
        processes.start()
        return (*asyncio.run(_measure_turn(processes, load)), len(plant.stages))


async def _measure_turn(processes: PlantProcesses, load: bool
                        ) -> tuple[dict[str, list[Trace]], dict[str, tuple[int, int]],
                                   LoadStats | None]:
    await processes.wait_online(READY_TIMEOUT_S)
    plant = processes.plant
    coordinator = [plant.coordinator.id]
    async with Gateway(plant) as gateway:
        await gateway.generate(GenerateRequest(
            id=request_id("spec-warmup"), max_tokens=TOKENS, ignore_eos=True, stream=True,
            messages=[ChatMessage(role="user", content=WARMUP)]), REQUEST_TIMEOUT_S)
        single: dict[str, list[Trace]] = {}
        counts: dict[str, tuple[int, int]] = {}
        for workload in WORKLOADS:
            before = await _counters(gateway, coordinator)
            single[workload] = [await gateway.generate(r, REQUEST_TIMEOUT_S)
                                for r in requests(workload)]
            after = await _counters(gateway, coordinator)
            counts[workload] = (int(after[0] - before[0]), int(after[1] - before[1]))
        loaded = None
        if load:
            def chat() -> GenerateRequest:
                return chat_request(request_id("spec-load"), TOKENS)

            loaded = load_stats(LOAD_CONCURRENCY, await closed_loop(
                gateway, chat, concurrency=LOAD_CONCURRENCY,
                requests_each=LOAD_REQUESTS_EACH, seed=peers.ARRIVAL_SEED,
                timeout=REQUEST_TIMEOUT_S))
    return single, counts, loaded


async def _counters(gateway: Gateway, agents: list[str]) -> tuple[float, float]:
    """The coordinator's drafts proposed and accepted so far, freshly published."""
    fresh = await gateway.fresh_metrics(agents, time.time(), METRICS_WAIT_S)
    if fresh is None:
        raise EdgebusError(f"the coordinator published no status within {METRICS_WAIT_S:.0f} s")
    metrics = fresh[agents[0]]
    return metrics.get("drafts_proposed", 0.0), metrics.get("drafts_accepted", 0.0)


def _llama_cpp(gguf: Path | None, tokenizer: PreTrainedTokenizerBase, threads: int,
               workdir: Path, notes: list[str]
               ) -> tuple[dict[str, StreamStats], dict[str, StreamStats]]:
    """llama-server on `gguf`, one slot, `threads` threads: each workload's requests one at a
    time, without and with its lookup decoding."""
    tools = peers.find_tools()
    if isinstance(tools, peers.Skipped) or gguf is None:
        notes.append("speculation: llama.cpp in one process not measured: "
                     f"{tools.reason if isinstance(tools, peers.Skipped) else 'no GGUF'}")
        return {}, {}
    ids = {workload: [prompt_ids(tokenizer, r) for r in requests(workload)]
           for workload in WORKLOADS}
    longest = max(len(i) for prompts in ids.values() for i in prompts)
    logs = workdir / "peers"
    logs.mkdir(parents=True, exist_ok=True)
    result: list[dict[str, StreamStats]] = []
    for name, options in (("plain", ()), ("lookup", peers.LOOKUP_DECODING)):
        with peers.llama_server(tools, gguf, threads=threads, slots=1,
                                context=peers.context_size(longest, TOKENS, 1),
                                logs=logs,
                                name=f"llama-server-{name}-t{threads}",
                                speculative=options) as server:
            server.complete(ids["quoting"][0], TOKENS)  # warm-up
            result.append({workload: stream_stats(_complete_all(server, prompts))
                           for workload, prompts in ids.items()})
    return result[0], result[1]


def _complete_all(server: peers.LlamaServer, prompts: Sequence[list[int]]) -> list[Trace]:
    return [server.complete(ids, TOKENS) for _ in range(TURNS) for ids in prompts]
