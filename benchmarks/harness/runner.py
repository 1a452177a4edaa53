"""The bench: every phase in order, each plant started as real processes, then the report.

Phases: the one-process baselines (transformers, llama.cpp, an idle agent's
memory), the 3-stage pipeline on each broker, and, without --quick,
transformers on one pinned core, one pinned stage and two pinned stages. Plants run from a temporary
directory, which keeps their plant files and agent logs for a post-mortem.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import transformers
from tqdm import tqdm
from transformers import AutoTokenizer

from broker.mosquitto import MosquittoProcess, mosquitto_version
from edgebus.core.errors import EdgebusError
from edgebus.core.messages import GenerateRequest
from edgebus.core.paths import GGUF_FILE
from edgebus.core.processes import LOOPBACK, free_port, idle_agent_rss
from edgebus.launcher import READY_TIMEOUT_S, PlantProcesses, shared_groups, shared_threads
from edgebus.model_import import DEMO_MODEL_NAME, bundled_gguf, ensure_demo_model
from harness import (
    baseline,
    peers,
    roofline,
    seed_model,
    shared_cores,
    speculation,
    stage_steps,
)
from harness.gateway import Gateway, Sniffer, broker_hop, closed_loop
from harness.metrics import (
    LoadStats,
    StreamStats,
    counter_delta,
    hop_overhead,
    load_stats,
    marginal_rate,
    param_bytes_by_stage,
    stream_stats,
    time_to_first_token,
)
from harness.report import write_report
from harness.results import (
    BOXES_CONCURRENCY,
    BROKERS,
    BenchResult,
    BenchSettings,
    BoxesRun,
    Machine,
    PipelineRun,
    SeedShape,
    SeedShapeRun,
    Wire,
)
from harness.workload import chat_request, long_prompt, long_request, request_id
from node_agent.costs import model_costs
from node_agent.engines.onnx_engine import prepare_graphs
from node_agent.engines.tuning import cpu_model
from node_agent.text import prompt_ids
from plant_config import Plant, make_plant, write_plant
from plant_config.broker_section import EMBEDDED
from plant_config.planner import balanced_split
from plant_config.schema import EngineName, WeightMode, resolve_engine

# The pipeline under test: SmolLM2's 30 layers over 3 stages, split as
# `edgebus plan` splits them over equal boxes (see _plant).
PIPELINE_STAGES = 3
# Untimed requests after a plant comes online: the agents' first forward
# passes pay for allocator growth and oneDNN kernel selection.
WARMUP_REQUESTS = 1
# Seeds the closed-loop clients' start offsets: every run arrives the same way.
ARRIVAL_SEED = 20240611
# A request at concurrency 16 shares the pipeline with 15 others; on a slow
# box that is minutes, and only a stuck plant takes longer.
REQUEST_TIMEOUT_S = 600.0
# Agents refresh their retained status every 2 s: a fresh one is due within
# that, the rest is margin for a loaded box.
METRICS_WAIT_S = 6.0
# After a measured request, time for the RELEASE frames (sent after the
# response) to reach the sniffer.
SETTLE_S = 0.5
# The counters a stage's status metrics must carry for the per-hop overhead.
STAGE_COUNTERS = ("compute_s", "steps")
_GIB = 1024**3
# The seed's headline metric: a 256-token code completion, in seconds.
SEED_COMPLETION_TOKENS = 256
SEED_PROMPT = ('def parse_alarm_log(path):\n    """Read a PLC alarm log (CSV: time, code, '
               'machine, text) and return the alarms per machine, newest first."""\n')
# Engines and modes of the seed's shape: both engines in 8 bits, onnxruntime in 4, and the
# fp32 reference. (torch has no 4-bit mode: docs/weight-modes.md.)
SEED_VARIANTS: tuple[tuple[EngineName, WeightMode], ...] = (
    ("torch", "fp32"), ("torch", "int8"), ("onnxruntime", "int8"), ("onnxruntime", "int4"),
    ("llamacpp", "gguf"))
# The GGUF type the llamacpp engine runs the seed's shape in: the leanest 4-bit type, the
# one the seed's boxes would run.
SEED_STAGE_GGUF = "Q4_0"
# A llamacpp node books every request's longest length up front (ContextShape): these
# limits fit the bench's longest request (the 512-token prompt, or the seed's 256-token
# completion) and let the default kv_budget_mb hold every request of concurrency 16.
GGUF_LIMITS = {"max_prompt_tokens": 1024, "max_tokens_limit": 256}
# The GGUF types llama.cpp runs the seed's shape in: 4 and 8 bits, as edgebus; Q4_1 is
# the 4-bit form closest to edgebus's int4 (a float minimum per block), Q4_0 the leanest.
SEED_GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0")
# llama.cpp RPC splits the model over as many workers as the pipeline has stages.
RPC_SERVERS = PIPELINE_STAGES


def run_bench(settings: BenchSettings) -> BenchResult:
    """Run every phase, write the report and the plot, print the report; return the numbers."""
    started = time.monotonic()
    _check_settings(settings)
    # Nothing here may reach for a model hub; the agents inherit this too.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    machine = machine_info()
    model_dir = ensure_demo_model()

    # A bench's terminal is for its progress bar, not for loading bars and
    # generation warnings of the baseline.
    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = long_prompt(tokenizer)
    chat_ids = prompt_ids(tokenizer, chat_request("ids", settings.tokens))
    long_tokens = len(prompt_ids(tokenizer, long_request("ids", prompt)))
    cores = len(os.sched_getaffinity(0))
    workdir = Path(tempfile.mkdtemp(prefix="edgebus-bench-"))
    notes: list[str] = []

    runs = _pipeline_runs(settings)
    seed = settings.seed_shape and not settings.quick
    gguf_steps = "gguf" in settings.weights
    phases = (5 + len(runs) + (3 if settings.boxes else 0) + (1 if seed else 0)
              + (3 if gguf_steps else 0))
    print(f"the bench on {machine.cpu}: {phases} phases; plant files and agent logs in "
          f"{workdir}", flush=True)
    with tqdm(total=phases, unit="phase", file=sys.stdout) as bar:
        with _phase(bar, "baseline: transformers"):
            hf = baseline.run_transformers(model_dir, tokenizer, tokens=settings.tokens,
                                           runs=settings.runs, long_prompt=prompt,
                                           threads=cores)
        with _phase(bar, "baseline: llama.cpp"):
            llama = baseline.run_llama_cpp(bundled_gguf(), chat_ids, tokens=settings.tokens,
                                           runs=settings.runs, threads=cores, notes=notes)
        with _phase(bar, "peers: llama.cpp's server and RPC"):
            peer_runs = peers.run_peers(
                bundled_gguf(), chat_ids, tokens=settings.tokens, runs=settings.runs,
                single_threads=sorted({1, cores}), threads=cores,
                concurrency=settings.concurrency, requests_each=settings.requests_each,
                rpc_servers=RPC_SERVERS, log_dir=workdir / "peers")
        with _phase(bar, "memory bandwidth"):
            bandwidth = roofline.read_bandwidth()
        with _phase(bar, "idle agent memory"):
            idle = idle_agent_rss(model_dir)
        pipelines: list[PipelineRun] = []
        for broker, weights in runs:
            with _phase(bar, f"pipeline: {weights} over {broker}"):
                pipelines.append(run_pipeline(broker, model_dir, workdir, settings, prompt,
                                              notes, weights=weights))
        boxes: list[BoxesRun] = []
        one_core = None
        if settings.boxes:
            cpus = sorted(os.sched_getaffinity(0))[:2]
            with _phase(bar, "boxes: transformers on 1 core"):
                one_core = baseline.run_transformers_one_core(
                    model_dir, tokenizer, tokens=settings.tokens, runs=settings.runs,
                    cpu=cpus[0], batches=BOXES_CONCURRENCY)
            for stages in (1, 2):
                with _phase(bar, f"boxes: {stages} pinned stage(s)"):
                    boxes.append(run_boxes(stages, cpus, model_dir, workdir, settings))
        layers = balanced_split(model_costs(model_dir)[0], PIPELINE_STAGES)
        steps: list[stage_steps.StageSteps] = []
        floors: list[shared_cores.Floor] = []
        if gguf_steps:
            with _phase(bar, "llama.cpp stages against the whole model"):
                steps += [stage_steps.measure(model_dir, DEMO_MODEL_NAME, layers, threads)
                          for threads in sorted({1, cores})]
            with _phase(bar, "llama.cpp stages chained by pipes: what sharing cores costs"):
                floors.append(shared_cores.measure(
                    model_dir, DEMO_MODEL_NAME, layers,
                    stage_threads=shared_threads(PIPELINE_STAGES),
                    load_rows=max(settings.concurrency),
                    load_groups=shared_groups(PIPELINE_STAGES), whole_threads=cores))
        drafted: list[speculation.SpeculationRun] = []
        drafted_load = None
        if gguf_steps:
            with _phase(bar, "pipelined speculation: drafts off and on, beside llama.cpp"):
                drafted, drafted_load = speculation.measure(
                    DEMO_MODEL_NAME, lambda url: _plant(model_dir, "bench-speculation",
                                                        PIPELINE_STAGES, url=url,
                                                        weights="gguf"),
                    workdir / "speculation", tokenizer, bundled_gguf(), threads=cores,
                    load=True, notes=notes)
                # The nearest this box comes to a plant of separate boxes: as many stages as
                # cores, each pinned to its own.
                pinned, _ = speculation.measure(
                    DEMO_MODEL_NAME, lambda url: _plant(model_dir, "bench-speculation-pinned",
                                                        cores, url=url, weights="gguf",
                                                        threads=1),
                    workdir / "speculation-pinned", tokenizer, bundled_gguf(), threads=cores,
                    load=False, notes=notes, pin=True)
                drafted += pinned
        seed_shape = None
        if seed:
            with _phase(bar, "the seed's model shape (DeepSeek-Coder-1.3B, random weights)"):
                seed_shape, seed_steps, seed_floor, seed_drafted = run_seed_shape(workdir, notes)
                steps += seed_steps
                floors += [seed_floor] if seed_floor is not None else []
                drafted += seed_drafted

    result = BenchResult(
        settings=settings, machine=machine, model=DEMO_MODEL_NAME,
        chat_prompt_tokens=len(chat_ids), long_prompt_tokens=long_tokens, transformers=hf,
        llama_cpp=llama, idle_rss=idle, stage_layers=layers,
        stage_param_bytes=param_bytes_by_stage(baseline.checkpoint_tensor_bytes(model_dir),
                                               layers),
        pipelines=pipelines, boxes=boxes, one_core=one_core,
        elapsed_s=time.monotonic() - started, notes=notes, bandwidth_gbs=bandwidth / 1e9,
        peers=peer_runs, seed_shape=seed_shape, stage_steps=steps or None,
        floors=floors or None, speculation=drafted or None, speculation_load=drafted_load)
    text, plot = write_report(result)
    print(text)
    print(f"wrote {settings.out}" + (f" and {plot}" if plot is not None else
                                     " (plot skipped: pip install -e \".[bench]\")"))
    return result


@contextlib.contextmanager
def _phase(bar: tqdm[None], name: str) -> Iterator[None]:
    bar.set_description(name)
    yield
    bar.update()


def _check_settings(settings: BenchSettings) -> None:
    unknown = set(settings.brokers) - set(BROKERS)
    if unknown or not settings.brokers:
        raise EdgebusError(f"--brokers {','.join(settings.brokers)}: choose from "
                           f"{','.join(BROKERS)}")
    if settings.tokens < 2:
        raise EdgebusError(f"--tokens {settings.tokens}: at least 2, so there is an "
                           "inter-token latency to measure")
    if "mosquitto" in settings.brokers and mosquitto_version() is None:
        raise EdgebusError("mosquitto is not installed (apt-get install mosquitto): install "
                           "it or leave it out with --brokers amqtt")
    if settings.boxes and len(os.sched_getaffinity(0)) < 2:
        raise EdgebusError("the boxes phase pins two stages to two cores, and this process may "
                           "use only one: run with --quick")


def machine_info() -> Machine:
    cpu = cpu_model()
    meminfo = Path("/proc/meminfo").read_text().split()
    memory_kib = int(meminfo[meminfo.index("MemTotal:") + 1])
    return Machine(cpu=cpu, cores=os.cpu_count() or 1, usable_cores=len(os.sched_getaffinity(0)),
                   memory_gib=memory_kib * 1024 / _GIB, kernel=platform.release(),
                   python=platform.python_version(), torch=version("torch"),
                   transformers=version("transformers"), mosquitto=mosquitto_version(),
                   llama_cpp=_version_or_none("llama_cpp_python"),
                   date=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
                   load_average=os.getloadavg())


def _version_or_none(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _plant(model_dir: Path, plant_id: str, stages: int, *, url: str | None = None,
           threads: int | None = None, weights: WeightMode = "fp32",
           engine: EngineName = "auto") -> Plant:
    """`stages` stages split as the planner splits equal boxes; the embedded broker on a free
    loopback port. Not an even split: the last stage also runs the LM head, and an even
    split leaves it the bottleneck while the other stages idle part of the time."""
    plant = make_plant(model_dir, stages=stages, broker=url or EMBEDDED, plant_id=plant_id)
    layers = balanced_split(model_costs(model_dir)[0], stages)
    update: dict[str, object] = {"stages": [
        spec.model_copy(update={"layers": r, "weights": weights, "engine": engine,
                                **({"threads": threads} if threads else {})})
        for spec, r in zip(plant.stages, layers, strict=True)]}
    if weights == "gguf":
        update["coordinator"] = plant.coordinator.model_copy(update=GGUF_LIMITS)
    if plant.broker.embedded:
        update["broker"] = plant.broker.model_copy(update={"host": LOOPBACK,
                                                           "port": free_port()})
    return plant.model_copy(update=update)


def _start(plant: Plant, workdir: Path, stack: contextlib.ExitStack,
           cpus: dict[str, list[int]] | None = None) -> PlantProcesses:
    # onnxruntime stages build their graphs at first load: one at a time here, not in
    # every agent at once on shared cores (and not against the plant's ready timeout).
    for spec in plant.stages:
        if resolve_engine(spec.engine, spec.weights) == "onnxruntime":
            prepare_graphs(plant.model, *spec.layers, spec.weights)
    path = workdir / f"{plant.plant_id}.yaml"
    write_plant(plant, path)
    processes = stack.enter_context(PlantProcesses(path, log_dir=workdir / plant.plant_id,
                                                   cpus=cpus))
    processes.start()
    return processes


# -- the 3-stage pipeline on one broker -----------------------------------------------


def _pipeline_runs(settings: BenchSettings) -> list[tuple[str, WeightMode]]:
    """(broker, weights) of each pipeline phase: fp32 on every broker, other modes on the
    production broker (Mosquitto if measured)."""
    production = "mosquitto" if "mosquitto" in settings.brokers else settings.brokers[0]
    return [(broker, weights) for weights in settings.weights for broker in settings.brokers
            if weights == "fp32" or broker == production]


def run_pipeline(broker: str, model_dir: Path, workdir: Path, settings: BenchSettings,
                 prompt: str, notes: list[str], *, weights: WeightMode = "fp32") -> PipelineRun:
    """Start the plant on `broker` ("amqtt": the embedded one), measure it, stop it."""
    with contextlib.ExitStack() as stack:
        url: str | None = None
        extra_pids: dict[str, int] = {}
        if broker == "mosquitto":
            mosquitto = stack.enter_context(MosquittoProcess(workdir / "mosquitto"))
            url = mosquitto.url
            if mosquitto.pid is not None:
                extra_pids["mosquitto"] = mosquitto.pid
        plant = _plant(model_dir, f"bench-{broker}-{weights}", PIPELINE_STAGES, url=url,
                       weights=weights)
        processes = _start(plant, workdir, stack)
        run = asyncio.run(_measure_pipeline(broker, processes, settings, prompt, extra_pids))
    if run.compute_per_step_s is None:
        notes.append(f"{run.label}: the stages' status metrics ({', '.join(STAGE_COUNTERS)}) were "
                     f"missing or not refreshed within {METRICS_WAIT_S:.0f} s, so the pipeline "
                     "overhead per hop is n/a")
    return run


async def _measure_pipeline(broker: str, processes: PlantProcesses, settings: BenchSettings,
                            prompt: str, extra_pids: dict[str, int]) -> PipelineRun:
    await processes.wait_online(READY_TIMEOUT_S)
    pids = {**processes.pids, **extra_pids}
    online_peak = {name: baseline.rss(pid)[0] for name, pid in pids.items()}
    plant = processes.plant
    hop = await broker_hop(plant)  # before any request: the broker and the agents are idle

    def chat() -> GenerateRequest:
        return chat_request(request_id("chat"), settings.tokens)

    def long() -> GenerateRequest:
        return long_request(request_id("long"), prompt)

    async with Gateway(plant) as gateway:
        for _ in range(WARMUP_REQUESTS):
            await gateway.generate(chat(), REQUEST_TIMEOUT_S)
            await gateway.generate(long(), REQUEST_TIMEOUT_S)
        single = stream_stats([await gateway.generate(chat(), REQUEST_TIMEOUT_S)
                               for _ in range(settings.runs)])
        long_ttft = statistics.median([
            time_to_first_token(await gateway.generate(long(), REQUEST_TIMEOUT_S))
            for _ in range(settings.runs)])
        wire, compute = await _wire_and_compute(gateway, settings.tokens)
        single_peak = {name: baseline.rss(pid)[0] for name, pid in pids.items()}
        load = [await _load(gateway, chat, concurrency, settings)
                for concurrency in settings.concurrency]
        # Read before the stop: the peak includes every KV cache of the highest concurrency.
        rss = {name: baseline.rss(pid) for name, pid in pids.items()}
        engines = {stage.node: status.engine for stage in plant.stages
                   if (status := gateway.statuses.get(stage.node)) is not None
                   and status.engine is not None}
    hops = len(plant.stages) + 1
    overhead = None if compute is None else hop_overhead(single.itl_p50_s, compute, hops)
    spec = plant.stages[0]
    return PipelineRun(broker=broker, weights=spec.weights,
                       engine=resolve_engine(spec.engine, spec.weights), engines=engines,
                       single=single, load=load, long_ttft_s=long_ttft,
                       wire=wire, hop=hop, compute_per_step_s=compute,
                       overhead_per_hop_s=overhead,
                       online_peak_rss=online_peak, single_peak_rss=single_peak,
                       peak_rss={name: peak for name, (peak, _) in rss.items()},
                       end_rss={name: now for name, (_, now) in rss.items()})


async def _load(gateway: Gateway, make_request: Callable[[], GenerateRequest], concurrency: int,
                settings: BenchSettings) -> LoadStats:
    traces = await closed_loop(gateway, make_request, concurrency=concurrency,
                               requests_each=settings.requests_each, seed=ARRIVAL_SEED,
                               timeout=REQUEST_TIMEOUT_S)
    return load_stats(concurrency, traces)


async def _wire_and_compute(gateway: Gateway, tokens: int) -> tuple[Wire, list[float] | None]:
    """Bytes per decode token per activation topic, and each stage's compute per decode step.

    A 1-token and a `tokens`-token request of the same prompt, one at a time:
    their difference is `tokens - 1` decode steps, with the prefill and the
    release frames cancelled out (see `marginal_rate`).
    """
    plant = gateway.plant
    stages = [stage.node for stage in plant.stages]
    hops = [*stages, plant.coordinator.id]  # each agent's act/ topic is the hop into it
    async with Sniffer(plant) as sniffer:
        await asyncio.sleep(SETTLE_S)  # the warm-up's release frames are not this phase's
        sent = [dict(sniffer.bytes)]
        marks = [await _stage_metrics(gateway, stages)]
        for count in (1, tokens):
            await gateway.generate(chat_request(request_id("wire"), count), REQUEST_TIMEOUT_S)
            await asyncio.sleep(SETTLE_S)
            marks.append(await _stage_metrics(gateway, stages))
            sent.append(dict(sniffer.bytes))
    wire = Wire({hop: marginal_rate((sent[1].get(hop, 0) - sent[0].get(hop, 0), 1),
                                    (sent[2].get(hop, 0) - sent[1].get(hop, 0), tokens))
                 for hop in hops})
    if any(mark is None for mark in marks):
        return wire, None
    compute = []
    for stage in stages:
        before, short, long = (mark[stage] for mark in marks if mark is not None)
        compute.append(marginal_rate(
            (counter_delta(before, short, "compute_s"), counter_delta(before, short, "steps")),
            (counter_delta(short, long, "compute_s"), counter_delta(short, long, "steps"))))
    return wire, compute


async def _stage_metrics(gateway: Gateway, stages: list[str]) -> dict[str, dict[str, float]] | None:
    """Each stage's counters as of now, or None if the stages do not publish them."""
    published = [gateway.statuses.get(stage) for stage in stages]
    if any(s is None or not set(STAGE_COUNTERS) <= set(s.metrics) for s in published):
        return None
    return await gateway.fresh_metrics(stages, time.time(), METRICS_WAIT_S)


# -- boxes add throughput --------------------------------------------------------------


def run_boxes(stages: int, cpus: list[int], model_dir: Path, workdir: Path,
              settings: BenchSettings) -> BoxesRun:
    """`stages` stages of one thread each, stage i pinned to cpus[i]; broker and coordinator not."""
    plant = _plant(model_dir, f"bench-boxes-{stages}", stages, threads=1)
    layers = [stage.layers for stage in plant.stages]
    pins = {stage.node: [cpu] for stage, cpu in zip(plant.stages, cpus, strict=False)}
    with contextlib.ExitStack() as stack:
        processes = _start(plant, workdir, stack, cpus=pins)
        return asyncio.run(_measure_boxes(processes, settings, layers))


async def _measure_boxes(processes: PlantProcesses, settings: BenchSettings,
                         layers: list[tuple[int, int]]) -> BoxesRun:
    await processes.wait_online(READY_TIMEOUT_S)

    def chat() -> GenerateRequest:
        return chat_request(request_id("boxes"), settings.tokens)

    async with Gateway(processes.plant) as gateway:
        for _ in range(WARMUP_REQUESTS):
            await gateway.generate(chat(), REQUEST_TIMEOUT_S)
        load = [await _load(gateway, chat, concurrency, settings)
                for concurrency in BOXES_CONCURRENCY]
    return BoxesRun(stages=len(processes.plant.stages), layers=layers, load=load)


# -- the seed's model shape ------------------------------------------------------------


def run_seed_shape(workdir: Path, notes: list[str]
                   ) -> tuple[SeedShape, list[stage_steps.StageSteps], shared_cores.Floor | None,
                              list[speculation.SpeculationRun]]:
    """Each of SEED_VARIANTS as 3 stages over Mosquitto on a random-weight model of
    DeepSeek-Coder-1.3B's shape, and llama.cpp on GGUFs of the same shape: one
    SEED_COMPLETION_TOKENS-token completion each; its llama.cpp stages' decode steps
    against the whole model's; those stages chained by pipes, single stream; and its
    llama.cpp plant with drafts and without."""
    model_dir = seed_model.seed_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = prompt_ids(tokenizer, _seed_request("ids"))
    tools = peers.find_tools()
    gguf_dir = seed_model.seed_gguf_model(SEED_STAGE_GGUF)
    runs = []
    name = f"{seed_model.SEED_MODEL_NAME} {SEED_STAGE_GGUF}"
    steps: list[stage_steps.StageSteps] = []
    floor = None
    drafted: list[speculation.SpeculationRun] = []
    for engine, weights in SEED_VARIANTS:
        source = gguf_dir if weights == "gguf" else model_dir
        with contextlib.ExitStack() as stack:
            mosquitto = stack.enter_context(MosquittoProcess(workdir / "mosquitto-seed"))
            plant = _plant(source, f"bench-seed-{engine}-{weights}", PIPELINE_STAGES,
                           url=mosquitto.url, weights=weights, engine=engine)
            processes = _start(plant, workdir, stack)
            runs.append(asyncio.run(_measure_seed(processes, engine, weights)))
        if weights == "gguf":
            layers = [spec.layers for spec in plant.stages]
            steps = [stage_steps.measure(source, name, layers, threads)
                     for threads in sorted({1, len(os.sched_getaffinity(0))})]
            floor = shared_cores.measure(source, name, layers,
                                         stage_threads=shared_threads(PIPELINE_STAGES))
            drafted, _ = speculation.measure(
                name, functools.partial(_seed_plant, source), workdir / "speculation-seed",
                tokenizer, source / GGUF_FILE, threads=len(os.sched_getaffinity(0)),
                load=False, notes=notes)
    cores = len(os.sched_getaffinity(0))

    def llama_cpp(quant: str, threads: int) -> StreamStats | peers.Skipped:
        if isinstance(tools, peers.Skipped):
            return tools
        try:
            return peers.measure_single(
                tools, seed_model.seed_gguf(quant), ids,
                tokens=SEED_COMPLETION_TOKENS, runs=1, threads=threads,
                log_dir=workdir / "peers-seed")
        except EdgebusError as exc:
            return peers.Skipped(str(exc))

    llama = {quant: llama_cpp(quant, cores) for quant in SEED_GGUF_TYPES}
    threads = shared_threads(PIPELINE_STAGES)
    alike = llama_cpp(SEED_STAGE_GGUF, threads) if threads < cores else None
    return SeedShape(model=seed_model.SEED_MODEL_NAME, prompt_tokens=len(ids),
                     tokens=SEED_COMPLETION_TOKENS, runs=runs, llama_cpp=llama,
                     stage_gguf=SEED_STAGE_GGUF, stage_threads=threads,
                     llama_cpp_stage_threads=alike), steps, floor, drafted


def _seed_plant(source: Path, url: str) -> Plant:
    return _plant(source, "bench-seed-speculation", PIPELINE_STAGES, url=url, weights="gguf")


def _seed_request(name: str, tokens: int = SEED_COMPLETION_TOKENS) -> GenerateRequest:
    return GenerateRequest(id=request_id(name), prompt=SEED_PROMPT, max_tokens=tokens,
                           ignore_eos=True, stream=True)


async def _measure_seed(processes: PlantProcesses, engine: str, weights: str) -> SeedShapeRun:
    await processes.wait_online(READY_TIMEOUT_S)
    async with Gateway(processes.plant) as gateway:
        for _ in range(WARMUP_REQUESTS):
            await gateway.generate(_seed_request("seed-warmup", 8), REQUEST_TIMEOUT_S)
        completion = stream_stats([await gateway.generate(_seed_request("seed"),
                                                          REQUEST_TIMEOUT_S)])
        weight_bytes = sum(int(status.engine.get("weight_bytes", 0))
                           for stage in processes.plant.stages
                           if (status := gateway.statuses.get(stage.node)) is not None
                           and status.engine is not None)
    return SeedShapeRun(engine=engine, weights=weights, completion=completion,
                        weight_bytes=weight_bytes)
