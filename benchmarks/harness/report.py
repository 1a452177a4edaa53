"""The bench's output: target rows, `docs/benchmarks.md`, and the throughput plot beside it.

Rendering is a pure function of a `BenchResult`, so tests check it on given
numbers; only `write_report` touches the disk.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from harness import roofline, shared_cores, speculation
from harness.metrics import LoadStats, StreamStats
from harness.peers import BUILD_COMMAND, RpcRun, Skipped
from harness.results import BENCH_SCRIPT, BOXES_CONCURRENCY, BenchResult, PipelineRun

# The broker a plant runs in production; the targets are stated over it.
PRODUCTION_BROKER = "mosquitto"
# The concurrency the "many requests" target is stated at.
TARGET_CONCURRENCY = 16
# The fast weight mode of edgebus's own kernels, whose memory and quality targets stand.
FAST_WEIGHTS = "int4"
# The mode the targets against llama.cpp are stated in: the llamacpp engine on the GGUF's
# own blocks, the same file and kernels as the peers.
PEER_WEIGHTS = "gguf"
# A llama.cpp stage's decode step against the same layers' share of the whole model's.
STAGE_STEP_GOAL = 1.05
# The seed's shape through 3 llama.cpp stages against llama.cpp in one process (issue 19):
# a bigger model's steps dwarf the hops, so the pipeline should lose little to them.
SEED_SINGLE_GOAL = 0.95
# Pipelined speculation (issue 21): drafts must beat llama.cpp in one process where answers
# quote their prompt, cost nothing where they do not, and step aside under load.
SPECULATION_QUOTING_GOAL = 1.5
SPECULATION_FREE_GOAL = 0.95
SPECULATION_LOAD_GOAL = 0.98
# A decode step should read its weights at no less than this share of memory bandwidth.
ROOFLINE_GOAL = 0.70
_MIB = 1024**2
PASS, FAIL, UNMEASURED = "pass", "**fail**", "n/a"
INSTALL_PLOT = 'pip install -e ".[bench]"'


@dataclass(frozen=True)
class Target:
    """One goal as a ratio of two numbers from the same run."""

    name: str
    ratio: float | None  # None: not measured in this run
    goal: float
    at_least: bool  # the ratio must be >= goal (else <= goal)

    @property
    def verdict(self) -> str:
        if self.ratio is None:
            return UNMEASURED
        met = self.ratio >= self.goal if self.at_least else self.ratio <= self.goal
        return PASS if met else FAIL

    @property
    def goal_text(self) -> str:
        return f"{'≥' if self.at_least else '≤'} {self.goal:.2f}x"


def reference_run(result: BenchResult, weights: str = "fp32") -> PipelineRun | None:
    """The `weights` run the targets are judged on: Mosquitto's if measured, else the first."""
    runs = {run.broker: run for run in result.pipelines if run.weights == weights}
    return runs.get(PRODUCTION_BROKER) or next(iter(runs.values()), None)


def stage_rss_ratios(result: BenchResult, run: PipelineRun) -> list[float]:
    """Each stage's peak RSS serving one request at a time over (its weights + an idle
    agent's RSS): at most 1 is the goal. Concurrent requests' KV caches come on top,
    bounded per node by its kv_budget_mb; the memory table shows that peak too."""
    nodes = [f"stage-{index}" for index in range(len(result.stage_param_bytes))]
    return [run.single_peak_rss[node] / (weights + result.idle_rss)
            for node, weights in zip(nodes, result.stage_param_bytes, strict=True)
            if node in run.single_peak_rss]


def targets(result: BenchResult) -> list[Target]:
    hf = result.transformers
    run = reference_run(result)
    where = f"3 stages over {run.broker}" if run is not None else "3 stages"
    loaded = run.at(TARGET_CONCURRENCY) if run is not None else None
    rows = [
        Target(f"single stream, {where}, vs transformers single stream",
               _ratio(run.single.tok_s if run else None, hf.single.tok_s), 0.95, at_least=True),
        Target(f"{TARGET_CONCURRENCY} concurrent, {where}, vs transformers single stream",
               _ratio(loaded.tok_s if loaded else None, hf.single.tok_s), 6.0, at_least=True),
        Target(f"2 pinned stages at {_concurrencies()} concurrent vs one process on 1 core "
               "(transformers, 1 thread)", boxes_ratio(result), 1.7, at_least=True),
        Target(f"TTFT of the {result.long_prompt_tokens}-token prompt, {where}, vs transformers",
               _ratio(run.long_ttft_s if run else None, hf.long_ttft_s), 1.15, at_least=False),
        Target("worst stage peak RSS (one request at a time) vs its weights + an idle agent",
               max(stage_rss_ratios(result, run), default=None) if run else None, 1.0,
               at_least=False),
    ]
    return rows + _peer_targets(result) + _seed_targets(result) + _stage_step_targets(
        result) + _speculation_targets(result) + [
        Target("worst stage decode step vs its memory roofline (weight bytes / bandwidth)",
               min((f for _, _, f in roofline_rows(result) if f is not None), default=None),
               ROOFLINE_GOAL, at_least=True),
        *_weight_mode_targets(result.settings.out.parent / WEIGHT_MODES_DOC)]


def _peer_targets(result: BenchResult) -> list[Target]:
    """gguf (llamacpp) through 3 stages over Mosquitto against llama.cpp's own tools on the
    same CPU and the same GGUF."""
    fast = reference_run(result, PEER_WEIGHTS)
    where = f"{PEER_WEIGHTS}, 3 stages over {fast.broker}" if fast else PEER_WEIGHTS
    loaded = fast.at(TARGET_CONCURRENCY) if fast else None
    rpc = _rpc(result)
    # The stages' own thread count: on one box `up` divides the cores among them, and
    # the one-process run to hold them to is the one with as many threads as a stage.
    threads = int(fast.engines.get("stage-0", {}).get("threads", 0)) if fast else 0
    single = _llama_single(result, threads or result.machine.usable_cores)
    slots = _slots(result)
    rpc_loaded = next((s for s in rpc.load if s.concurrency == TARGET_CONCURRENCY),
                      None) if rpc else None
    rpc_servers = f"{rpc.servers} rpc-servers" if rpc else "rpc-servers"
    return [
        Target(f"single stream, {where}, vs llama.cpp RPC ({rpc_servers})",
               _ratio(fast.single.tok_s if fast else None, rpc.single.tok_s if rpc else None),
               2.0, at_least=True),
        Target(f"single stream, {where}, vs llama.cpp in one process with a stage's "
               f"threads ({threads or result.machine.usable_cores})",
               _ratio(fast.single.tok_s if fast else None, single.tok_s if single else None),
               0.80, at_least=True),
        Target(f"{TARGET_CONCURRENCY} concurrent, {where}, vs llama-server -np "
               f"{TARGET_CONCURRENCY}",
               _ratio(loaded.tok_s if loaded else None, slots.tok_s if slots else None), 1.0,
               at_least=True),
        Target(f"{TARGET_CONCURRENCY} concurrent, {where}, vs llama.cpp RPC",
               _ratio(loaded.tok_s if loaded else None, rpc_loaded.tok_s if rpc_loaded else None),
               2.0, at_least=True),
        Target(f"TTFT p50 at {TARGET_CONCURRENCY}, {where}, vs llama-server -np "
               f"{TARGET_CONCURRENCY}'s",
               _ratio(loaded.ttft_p50_s if loaded else None,
                      slots.ttft_p50_s if slots else None), 1.0, at_least=False),
        Target(f"TTFT p50 at {TARGET_CONCURRENCY}, {where}, vs llama.cpp RPC's",
               _ratio(loaded.ttft_p50_s if loaded else None,
                      rpc_loaded.ttft_p50_s if rpc_loaded else None), 1.0, at_least=False),
    ]


def _seed_targets(result: BenchResult) -> list[Target]:
    """The seed's shape in llama.cpp stages against llama.cpp in one process with as many
    threads as a stage has, on the stages' own GGUF type."""
    seed = result.seed_shape
    if seed is None:
        return []
    run = next((r for r in seed.runs if r.weights == PEER_WEIGHTS), None)
    peer = seed.llama_cpp_stage_threads or seed.llama_cpp.get(seed.stage_gguf)
    return [Target(f"single stream, {seed.model} {seed.stage_gguf}, 3 stages over Mosquitto, "
                   f"vs llama.cpp in one process with a stage's threads ({seed.stage_threads})",
                   _ratio(run.completion.tok_s if run else None,
                          None if peer is None or isinstance(peer, Skipped) else peer.tok_s),
                   SEED_SINGLE_GOAL, at_least=True)]


def _stage_step_targets(result: BenchResult) -> list[Target]:
    """The llama.cpp stages' decode steps, summed, against the whole model's, per model and
    thread count: cutting the model must cost nothing inside the stages."""
    return [Target(f"llama.cpp stages' decode steps summed vs the whole model's, {s.model}, "
                   f"{s.threads} thread(s)", _ratio(s.sum_ms, s.whole_ms), STAGE_STEP_GOAL,
                   at_least=False)
            for s in result.stage_steps or []]


def _speculation_targets(result: BenchResult) -> list[Target]:
    """Drafts against llama.cpp in one process, and against the plant without them."""
    rows: list[Target] = []
    for run in result.speculation or []:
        where = f"{run.model}, {_stages(run)}, {run.workload}"
        if run.workload == "quoting":
            rows += [
                Target(f"drafts on, {where}, vs llama.cpp in one process on the same cores",
                       _ratio(run.on.tok_s, run.llama_cpp.tok_s if run.llama_cpp else None),
                       SPECULATION_QUOTING_GOAL, at_least=True),
                Target(f"drafts on, {where}, vs llama.cpp's own lookup decoding",
                       _ratio(run.on.tok_s,
                              run.llama_lookup.tok_s if run.llama_lookup else None),
                       1.0, at_least=True)]
        else:
            rows.append(Target(f"drafts on, {where}, vs the plant with drafts off",
                               run.gain, SPECULATION_FREE_GOAL, at_least=True))
    if (load := result.speculation_load) is not None:
        rows.append(Target(f"{load.concurrency} concurrent, drafts on vs off", load.ratio,
                           SPECULATION_LOAD_GOAL, at_least=True))
    return rows


def _speculation(result: BenchResult) -> str:
    if not result.speculation:
        return ""
    rows = [[run.model, _stages(run), run.workload, rate(run.off.tok_s), rate(run.on.tok_s),
             times(run.gain),
             f"{run.accepted} of {run.proposed}" + (f" ({run.acceptance:.0%})"
                                                   if run.acceptance is not None else ""),
             f"{run.accepted / run.tokens:.0%}" if run.tokens else UNMEASURED,
             rate(run.llama_cpp.tok_s if run.llama_cpp else None),
             times(_ratio(run.on.tok_s, run.llama_cpp.tok_s if run.llama_cpp else None)),
             rate(run.llama_lookup.tok_s if run.llama_lookup else None),
             times(_ratio(run.on.tok_s, run.llama_lookup.tok_s if run.llama_lookup else None))]
            for run in result.speculation]
    load = result.speculation_load
    under_load = ("" if load is None else
                  f"\n\n{load.concurrency} requests at once (the chat prompt, closed loop): "
                  f"{rate(load.off.tok_s)} tok/s with drafts off, {rate(load.on.tok_s)} with "
                  f"drafts on ({times(load.ratio)}): with more than "
                  "`speculation.max_in_flight` requests in flight nobody drafts.")
    first = result.speculation[0]
    return ("## Pipelined speculation\n\n"
            "One request at a time through the llama.cpp plant over Mosquitto, with "
            f"prompt-lookup drafts off and on ({first.drafts} draft in flight; "
            "[architecture.md](architecture.md#pipelined-speculation)), in alternating turns "
            f"of their own processes; {speculation.TOKENS} tokens a request, greedy. The "
            "*quoting* requests repeat their prompt (an alarm, a paragraph to rewrite, a code "
            "edit), the *free* ones do not (`benchmarks/harness/speculation.py`). Drafts "
            "come from a request's own text, else from the plant's earlier answers in the "
            "turn (a warm-up on a prompt not measured, then the requests before it). Beside it, "
            "llama.cpp whole in one process on all cores (llama-server, one slot), without "
            "and with its own lookup decoding (`--spec-type ngram-simple`, n-gram 3, drafts "
            "of 10), on the same prompts. *taken* is the drafts taken of those sent; *tokens "
            "drafted* the share of the tokens whose draft was taken. Greedy output is the same "
            "with drafts on and off, token for token (tests/test_speculation.py). The plant "
            "as `edgebus up` runs it shares this box's cores among its stages, so a draft's "
            "compute is taken from the token's own; the pinned rows give each stage a core of "
            "its own, as a plant of separate boxes has ([architecture.md]"
            "(architecture.md#what-drafts-cost-where-stages-share-cores))."
            + under_load + "\n\n"
            + table(["model", "stages", "workload", "drafts off, tok/s", "drafts on, tok/s",
                     "on / off",
                     "taken", "tokens drafted", "llama.cpp, tok/s", "on / llama.cpp",
                     "llama.cpp lookup, tok/s", "on / lookup"], rows))


def _stages(run: speculation.SpeculationRun) -> str:
    return f"{run.stages} stages" + (", each pinned to a core" if run.pinned else "")


def _stage_steps(result: BenchResult) -> str:
    if not result.stage_steps:
        return ""
    rows = [[s.model, str(s.threads), f"{s.whole_ms:.2f} ms",
             " + ".join(f"{ms_:.2f}" for ms_ in s.stage_ms) + " ms",
             f"{s.sum_ms:.2f} ms", times(_ratio(s.sum_ms, s.whole_ms))]
            for s in result.stage_steps]
    layers = "; ".join(f"{s.model}: {', '.join(f'[{a}, {b})' for a, b in s.layers)}"
                       for s in result.stage_steps if s.threads == 1)
    return ("## llama.cpp stages against the whole model\n\n"
            "One decode step (median of 48, after a 32-token prompt) of each llamacpp stage, "
            "its own stage GGUF in its own llama.cpp context as its agent runs it (Python "
            "call included), beside a step of the whole GGUF in llama.cpp, round-robin in one "
            f"process. Layers: {layers}. The last stage's step includes the final norm and "
            "the LM head, as the whole model's does.\n\n"
            + table(["model", "threads", "whole model", "stages", "sum of stages",
                     "sum / whole"], rows))


def _shared_cores(result: BenchResult) -> str:
    if not result.floors:
        return ""
    rows = []
    for floor in result.floors:
        pipeline = _pipeline_itl(result, floor)
        rows.append([floor.model, f"single stream, ms a token ({floor.stage_threads} thread(s) "
                     "a process)", f"{floor.whole_ms:.2f}", f"{floor.chain_ms:.2f}",
                     times(floor.single_ratio), ms(pipeline),
                     times(_ratio(floor.chain_ms / 1e3, pipeline))])
        if floor.load_rows:
            rows.append([floor.model, f"{floor.load_rows} rows a step, tok/s (whole: "
                         f"{floor.whole_threads} threads; chain: {floor.load_groups} groups of "
                         f"{floor.load_rows // floor.load_groups})", rate(floor.whole_tok_s),
                         rate(floor.chain_tok_s), times(floor.load_ratio), "", ""])
    inexact = [floor.model for floor in result.floors if not floor.exact]
    exact = (f"**The chain's tokens differ from the whole model's on {', '.join(inexact)}: "
             "these rows do not measure the same computation.**" if inexact else
             "The chain's greedy tokens equal the whole model's on every model.")
    return ("## Sharing one box's cores\n\n"
            "Every agent of the bench's plants runs on this one box, where the stages take "
            "turns on shared cores. What that alone costs, with no transport at all: the "
            "plant's llama.cpp stages as bare processes (each its own stage GGUF, a stage's "
            "threads) chained by OS pipes, beside the whole model in one process, alternating "
            f"in blocks of {shared_cores.BLOCK_STEPS} steps so that both see the same minutes "
            "of the machine (`benchmarks/harness/shared_cores.py`). No broker, agent, coordinator "
            "or frame. *chain / whole* is the most any transport reaches on this box; *pipeline / "
            "chain* is what edgebus's transport costs on top (the pipeline's single-stream ITL "
            "p50, from its own run above). Under load the two are not alike: the pipeline's "
            "rate includes prompts and arrivals, the chain's is decode steps only, so that "
            f"ratio is left out. {exact}\n\n"
            + table(["model", "measure", "whole model, one process", "stages chained by pipes",
                     "chain / whole", "edgebus pipeline", "pipeline / chain"], rows))


def _pipeline_itl(result: BenchResult, floor: shared_cores.Floor) -> float | None:
    """The edgebus pipeline's single-stream ITL p50 on the floor's model, in seconds."""
    if floor.model == result.model:
        run = reference_run(result, PEER_WEIGHTS)
        return run.single.itl_p50_s if run else None
    seed = result.seed_shape
    runs = [r for r in seed.runs if r.weights == PEER_WEIGHTS] if seed else []
    return runs[0].completion.itl_p50_s if runs else None


def _llama_single(result: BenchResult, threads: int) -> StreamStats | None:
    """llama.cpp in one process with `threads` threads (llama-server, one slot)."""
    if result.peers is None:
        return None
    found = result.peers.single.get(threads)
    return found if isinstance(found, StreamStats) else None


def _slots(result: BenchResult) -> LoadStats | None:
    if result.peers is None or isinstance(result.peers.slots, Skipped):
        return None
    return next((s for s in result.peers.slots if s.concurrency == TARGET_CONCURRENCY), None)


def _rpc(result: BenchResult) -> RpcRun | None:
    if result.peers is None or isinstance(result.peers.rpc, Skipped):
        return None
    return result.peers.rpc


def roofline_rows(result: BenchResult) -> list[tuple[PipelineRun, str, float | None]]:
    """(run, stage, fraction of its roofline its decode step reaches) for every stage."""
    if result.bandwidth_gbs is None:
        return []
    rows: list[tuple[PipelineRun, str, float | None]] = []
    for run in result.pipelines:
        if run.compute_per_step_s is None:
            continue
        for index, step in enumerate(run.compute_per_step_s):
            node = f"stage-{index}"
            held = run.engines.get(node, {}).get("weight_bytes")
            rows.append((run, node, None if held is None or step <= 0 else roofline.fraction(
                float(held), step, result.bandwidth_gbs * 1e9)))
    return rows


# "| onnxruntime int4 | ... | 27 MiB (0.16x) | ... | 32.633 (+0.48 %) |" in weight-modes.md
_MIDDLE_RATIO = re.compile(r"\(([0-9.]+)x\)")
_PERPLEXITY = re.compile(r"\(([+-][0-9.]+) %\)")


def _weight_mode_targets(doc: Path) -> list[Target]:
    """int4's memory and quality targets, read off `python benchmarks/weight_modes.py`'s table
    (its own run: it loads the model once per mode)."""
    row = next((line for line in (doc.read_text(encoding="utf-8").splitlines()
                                  if doc.is_file() else [])
                if line.startswith(f"| onnxruntime {FAST_WEIGHTS} |")), None)
    cells = row.split("|")[1:-1] if row else []
    middle = _MIDDLE_RATIO.search(cells[3]) if len(cells) > 6 else None
    quality = _PERPLEXITY.search(cells[6]) if len(cells) > 6 else None
    return [
        Target(f"{FAST_WEIGHTS} stage resident weights vs fp32, a middle stage "
               f"({WEIGHT_MODES_DOC})", float(middle.group(1)) if middle else None, 0.16,
               at_least=False),
        Target(f"{FAST_WEIGHTS} perplexity vs fp32 ({WEIGHT_MODES_DOC}), 1.03x = +3 %",
               1 + float(quality.group(1)) / 100 if quality else None, 1.03, at_least=False),
    ]


def boxes_ratio(result: BenchResult) -> float | None:
    """Two pinned stages' aggregate tok/s (the lower of BOXES_CONCURRENCY's) over one
    process on one core serving those requests as `generate` does: one at a time."""
    two = next((run for run in result.boxes if run.stages == 2), None)
    if two is None or result.one_core is None or not two.load:
        return None
    return min(s.tok_s for s in two.load) / result.one_core.single_tok_s


def _concurrencies() -> str:
    return "-".join(str(c) for c in (min(BOXES_CONCURRENCY), max(BOXES_CONCURRENCY)))


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


# -- markdown ------------------------------------------------------------------------

# Written by `python benchmarks/weight_modes.py` beside the report.
WEIGHT_MODES_DOC = "weight-modes.md"


def render_markdown(result: BenchResult, plot_name: str | None) -> str:
    """The whole `docs/benchmarks.md`; `plot_name` is the PNG beside it, None if skipped."""
    sections = [
        _header(result), _machine(result), _workload(result), _targets(result),
        _baselines(result), _peers(result), _single(result), _concurrency(result),
        _stage_steps(result), _shared_cores(result), _speculation(result),
        _wire(result), _hops(result), _roofline(result), _memory(result), _boxes(result),
        _seed_shape(result), _STAGE_COMPUTE,
        _weight_modes(result.settings.out.parent / WEIGHT_MODES_DOC), _plot(plot_name),
        _definitions(result), _notes(result)]
    return "\n\n".join(s for s in sections if s) + "\n"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = [_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows)]
    return "\n".join(lines)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def ms(seconds: float | None) -> str:
    return UNMEASURED if seconds is None else f"{seconds * 1e3:.1f} ms"


def rate(tok_s: float | None) -> str:
    return UNMEASURED if tok_s is None else f"{tok_s:.1f}"


def times(ratio: float | None) -> str:
    return UNMEASURED if ratio is None else f"{ratio:.2f}x"


def mib(size: float) -> str:
    return f"{size / _MIB:.0f} MiB"


def _header(result: BenchResult) -> str:
    minutes = result.elapsed_s / 60
    return (f"# Benchmarks\n\n"
            f"Generated by `python {BENCH_SCRIPT}` on {result.machine.date} in {minutes:.1f} min. "
            "Every ratio compares two numbers measured in this same run on this same "
            "machine: the pipeline (every agent its own OS process, talking over a real "
            "broker) against the model in one process.\n\n"
            f"Reproduce:\n\n```sh\npip install -e \".[bench]\"\n{result.settings.command()}\n```")


def _machine(result: BenchResult) -> str:
    m = result.machine
    load = ", ".join(f"{x:.2f}" for x in m.load_average)
    rows = [["CPU", m.cpu], ["cores", f"{m.cores} ({m.usable_cores} usable by the bench)"],
            ["memory", f"{m.memory_gib:.1f} GiB"], ["kernel", m.kernel],
            ["Python", m.python], ["torch", m.torch], ["transformers", m.transformers],
            ["Mosquitto", m.mosquitto or "not installed"],
            ["llama-cpp-python", m.llama_cpp or "not installed"],
            ["load average at start", load]]
    return ("## Machine\n\nEvery table on this page was measured on this machine in this "
            "run; weight-modes.md, copied in below, says when and where it ran.\n\n"
            + table(["", ""], rows))


def _workload(result: BenchResult) -> str:
    s = result.settings
    concurrency = ", ".join(map(str, s.concurrency))
    split = ", ".join(f"[{first}, {end})" for first, end in result.stage_layers)
    # What `edgebus up` gives stages that set no threads: the cores shared out.
    threads = max(1, result.machine.usable_cores // len(result.stage_layers))
    return (
        "## Workload\n\n"
        f"- Model: {result.model}, fp32 (the bundled GGUF imported by `edgebus demo`); "
        f"the pipeline's stages hold layers {split} (as `edgebus plan` splits equal boxes: the "
        f"last stage also runs the LM head), {threads} torch thread(s) each.\n"
        f"- Chat prompt: one user turn through the chat template, {result.chat_prompt_tokens} "
        f"tokens. Long prompt: {result.long_prompt_tokens} tokens of fixed text, verbatim.\n"
        f"- Greedy, `ignore_eos: true`, `max_tokens: {s.tokens}`: every request generates "
        f"exactly {s.tokens} tokens; one-at-a-time numbers are over {s.runs} runs after a "
        "warm-up.\n"
        f"- Concurrency {concurrency}: that many closed-loop clients, each starting at a "
        "seeded random offset in the first 250 ms and sending its next request when its "
        f"last is answered, {s.requests_each} request(s) each.")


def _targets(result: BenchResult) -> str:
    rows = [[t.name, times(t.ratio), t.goal_text, t.verdict] for t in targets(result)]
    return "## Targets\n\n" + table(["target", "measured", "goal", ""], rows)


def _baselines(result: BenchResult) -> str:
    hf = result.transformers
    rows = [["transformers, single stream", rate(hf.single.tok_s), ms(hf.single.ttft_s),
             ms(hf.single.itl_p50_s), ms(hf.single.itl_p99_s)]]
    rows += [[f"transformers, static batch {size}", rate(tok_s), "", "", ""]
             for size, tok_s in sorted(hf.batch_tok_s.items())]
    rows.append([f"transformers, {result.long_prompt_tokens}-token prompt (prefill + 1 token)",
                 "", ms(hf.long_ttft_s), "", ""])
    llama = result.llama_cpp
    if llama is None:
        rows.append(["llama.cpp (Q4_1 GGUF), single stream", "not measured (see Notes)", "",
                     "", ""])
    else:
        rows.append(["llama.cpp (Q4_1 GGUF, llama-cpp-python), single stream", rate(llama.tok_s),
                     ms(llama.ttft_s), ms(llama.itl_p50_s), ms(llama.itl_p99_s)])
    cores = result.machine.usable_cores
    return (f"## One-process baselines ({cores} threads)\n\n"
            + table(["", "tok/s", "TTFT", "ITL p50", "ITL p99"], rows))


def _single(result: BenchResult) -> str:
    hf = result.transformers
    rows = [[run.label, rate(run.single.tok_s), times(_ratio(run.single.tok_s, hf.single.tok_s)),
             ms(run.single.ttft_s), ms(run.single.itl_p50_s), ms(run.single.itl_p99_s),
             ms(run.long_ttft_s), times(_ratio(run.long_ttft_s, hf.long_ttft_s))]
            for run in result.pipelines]
    return ("## Pipeline, 3 stages: one request at a time\n\n"
            + table(["plant", "tok/s", "x transformers", "TTFT", "ITL p50", "ITL p99",
                     f"TTFT {result.long_prompt_tokens}-token prompt", "x transformers"], rows))


def _load_row(label: list[str], stats: LoadStats, reference: float) -> list[str]:
    return [*label, str(stats.concurrency), str(stats.requests), rate(stats.tok_s),
            times(stats.tok_s / reference), ms(stats.ttft_p50_s), ms(stats.itl_p50_s),
            ms(stats.itl_p99_s)]


def _concurrency(result: BenchResult) -> str:
    reference = result.transformers.single.tok_s
    rows = [_load_row([run.label], stats, reference)
            for run in result.pipelines for stats in run.load]
    return ("## Pipeline, 3 stages: concurrent requests\n\n"
            + table(["plant", "concurrency", "requests", "tok/s (aggregate)",
                     "x transformers single stream", "TTFT p50", "ITL p50", "ITL p99"], rows))


def _wire(result: BenchResult) -> str:
    if not result.pipelines:
        return ""
    hops = list(result.pipelines[0].wire.per_topic)
    rows = [[run.label, *(f"{run.wire.per_topic.get(h, 0.0):.0f}" for h in hops),
             f"{run.wire.per_hop:.0f}"] for run in result.pipelines]
    return ("## Bytes on the wire per decode token\n\n"
            "Frame payload bytes per generated token on each hop (`{root}/act/<agent>`), "
            "prefill excluded; MQTT's own header and topic add ~30 bytes a message.\n\n"
            + table(["plant", *(f"→ {h}" for h in hops), "mean per hop"], rows))


def _hops(result: BenchResult) -> str:
    rows = []
    for run in result.pipelines:
        compute = (None if run.compute_per_step_s is None
                   else sum(run.compute_per_step_s))
        rows.append([run.label, ms(run.hop.p50_s), ms(run.hop.p99_s), ms(run.single.itl_p50_s),
                     ms(compute), ms(run.overhead_per_hop_s)])
    return ("## Latency per hop\n\n"
            "Where a hop's time goes, segment by segment (the broker, paho reading and "
            "writing, frame checks, encoding), and what was cut: [architecture.md]"
            "(architecture.md#time-per-hop).\n\n"
            + table(["plant", "broker hop p50 (one way)", "broker hop p99",
                     "decode step p50", "Σ stage compute per step",
                     "pipeline overhead per hop"], rows))


def _memory(result: BenchResult) -> str:
    fp32 = dict(zip((f"stage-{i}" for i in range(len(result.stage_param_bytes))),
                    result.stage_param_bytes, strict=True))
    top = max(result.settings.concurrency)
    rows = []
    for run in result.pipelines:
        # What each stage reported holding in its mode; the checkpoint's bytes in fp32.
        weights = {**fp32, **{node: int(engine["weight_bytes"])
                              for node, engine in run.engines.items()
                              if "weight_bytes" in engine and run.weights != "fp32"}}
        for name, peak in run.peak_rss.items():
            online, single = run.online_peak_rss.get(name), run.single_peak_rss.get(name)
            cells = [run.label, name, *(mib(b) if b is not None else "" for b in
                                         (online, single, peak, run.end_rss.get(name)))]
            if name in weights and online is not None and single is not None:
                base = weights[name] + result.idle_rss
                cells += [mib(weights[name]), mib(online - base), mib(single - base),
                          PASS if single <= base else FAIL]
            else:
                cells += ["", "", "", ""]
            rows.append(cells)
    return ("## Memory per process\n\n"
            "Peak RSS (VmHWM) once the agent is online (loading included, nothing served "
            "yet), after the one-request-at-a-time measurements (single stream, the long "
            f"prompt), and at the end of the phase (after {top} concurrent requests: their "
            "KV caches, which each node bounds by its `kv_budget_mb`, come on top); RSS "
            "(VmRSS) at the end. An idle agent (Python with torch, transformers and the "
            "stage agent imported, and the model built on the meta device: its code, no "
            f"weights) peaks at {mib(result.idle_rss)}.\n\n"
            + table(["plant", "process", "peak RSS, online", "peak RSS, one request at a time",
                     f"peak RSS, after {top} concurrent", "RSS at end", "weights held",
                     "online - idle - weights", "one at a time - idle - weights",
                     "≤ weights + idle"], rows)
            + "\n\nAbove weights + idle, a stage holds what serving needs: the KV cache of "
            "the request in service (a middle stage: ~9 MiB for the long prompt's 576 "
            "positions), the pages of library code its forward pass runs (~11 MiB of "
            "libtorch, counted in RSS though shared between processes), and the working set "
            "of its largest prefill chunk (~6 MiB for 128 positions), which the heap keeps "
            "for the next one ([architecture.md](architecture.md)). Measured in one process "
            "with `TorchEngine`; the agent's MQTT client and frame buffers add the rest.")


def _peers(result: BenchResult) -> str:
    """edgebus against llama.cpp's own tools on the same model and CPU, in this run."""
    peers = result.peers
    if peers is None:
        return ""
    top = TARGET_CONCURRENCY
    rows = []
    for run in result.pipelines:
        if run.broker != PRODUCTION_BROKER:
            continue
        loaded = run.at(top)
        rows.append([f"edgebus, 3 stages over {run.broker}, {run.weights} ({run.engine})",
                     rate(run.single.tok_s), rate(loaded.tok_s if loaded else None),
                     ms(loaded.ttft_p50_s if loaded else None),
                     f"{run.wire.per_hop * len(run.wire.per_topic):.0f} B"])
    for threads, single in sorted(peers.single.items()):
        rows.append([f"llama.cpp in one process (llama-server, 1 slot, {threads} thread(s))",
                     *_stream_or_skip(single), "", "", "none"])
    if isinstance(peers.slots, Skipped):
        rows.append([f"llama-server -np {top}", peers.slots.reason, "", "", ""])
    else:
        at_top = next((s for s in peers.slots if s.concurrency == top), None)
        at_one = next((s for s in peers.slots if s.concurrency == 1), None)
        rows.append([f"llama-server -np {top} ({result.machine.usable_cores} threads)",
                     rate(at_one.tok_s if at_one else None),
                     rate(at_top.tok_s if at_top else None),
                     ms(at_top.ttft_p50_s if at_top else None), "none"])
    if isinstance(peers.rpc, Skipped):
        rows.append(["llama.cpp RPC", peers.rpc.reason, "", "", ""])
    else:
        rpc = peers.rpc
        at_top = next((s for s in rpc.load if s.concurrency == top), None)
        wire = (f"{rpc.wire_bytes_per_token:.0f} B" if rpc.wire_bytes_per_token is not None
                else rpc.wire_note or UNMEASURED)
        rows.append([f"llama.cpp RPC: {rpc.servers} rpc-servers of {rpc.server_threads} "
                     "thread(s) + llama-server", rate(rpc.single.tok_s),
                     rate(at_top.tok_s if at_top else None),
                     ms(at_top.ttft_p50_s if at_top else None), wire])
    return ("## Against llama.cpp\n\n"
            "llama.cpp's own tools, built from the source vendored in the installed "
            f"llama-cpp-python (`{BUILD_COMMAND}`), on the bundled Q4_1 GGUF of the "
            "same model, measured in this run on this machine with the same prompt, tokens "
            "and closed-loop clients as edgebus. Bytes on the wire: per generated token, over "
            "every hop (edgebus: frame payloads; RPC: both directions of every worker "
            "connection).\n\n"
            + table(["", "single stream tok/s", f"{top} concurrent tok/s (aggregate)",
                     f"TTFT p50 at {top}", "bytes on the wire per token"], rows))


def _stream_or_skip(stats: StreamStats | Skipped) -> list[str]:
    if isinstance(stats, Skipped):
        return [stats.reason, ""]
    return [rate(stats.tok_s), ""]


def _roofline(result: BenchResult) -> str:
    rows = [[run.label, node,
             mib(float(run.engines.get(node, {}).get("weight_bytes", 0))),
             ms(step), ms(float(run.engines.get(node, {}).get("weight_bytes", 0))
                          / (result.bandwidth_gbs * 1e9)) if result.bandwidth_gbs else "",
             f"{fraction:.0%}" if fraction is not None else UNMEASURED]
            for run, node, fraction in roofline_rows(result)
            for step in [run.compute_per_step_s[int(node.split("-")[1])]
                         if run.compute_per_step_s else None]]
    if not rows:
        return ""
    return ("## Decode steps against the memory roofline\n\n"
            f"A decode step reads every weight of its stage once, so it takes at least weight "
            f"bytes / memory bandwidth. Bandwidth measured here, one thread reading 1 GiB: "
            f"{result.bandwidth_gbs:.1f} GB/s. A stage's step is its compute per decode step "
            "from its status metrics (one thread a stage); a stage whose weights fit in the "
            "CPU's caches can beat the DRAM roofline. The goal is "
            f"{ROOFLINE_GOAL:.0%} or more.\n\n"
            + table(["plant", "stage", "weights held", "decode step", "roofline",
                     "roofline / step"], rows))


def _seed_shape(result: BenchResult) -> str:
    seed = result.seed_shape
    if seed is None:
        return ("## The seed's model shape\n\nNot measured (`--quick` or "
                "`--no-seed-shape`).")
    rows = [[f"edgebus, 3 stages over Mosquitto, {run.weights} ({run.engine})",
             f"{run.completion.tok_s and seed.tokens / run.completion.tok_s:.1f} s",
             rate(run.completion.tok_s), ms(run.completion.ttft_s), mib(run.weight_bytes)]
            for run in seed.runs]
    peers = [(f"{quant} ({result.machine.usable_cores} threads)", stats)
             for quant, stats in seed.llama_cpp.items()]
    if seed.llama_cpp_stage_threads is not None:
        peers.append((f"{seed.stage_gguf} ({seed.stage_threads} thread(s), a stage's)",
                      seed.llama_cpp_stage_threads))
    for what, stats in peers:
        label = f"llama.cpp in one process, {what}"
        if isinstance(stats, Skipped):
            rows.append([label, stats.reason, "", "", ""])
        else:
            rows.append([label, f"{seed.tokens / stats.tok_s:.1f} s", rate(stats.tok_s),
                         ms(stats.ttft_s), ""])
    return ("## The seed's model shape: DeepSeek-Coder-1.3B\n\n"
            "Random weights of DeepSeek-Coder-1.3B's shape (hidden 2048, 24 layers, FFN 5504, "
            "vocabulary 32256; speed does not depend on the values), written as GGUF blocks "
            f"by tools/random_gguf.py (`{seed.model}`); the torch and onnxruntime stages run "
            "its Q8_0 file imported to fp32 (`edgebus model import-gguf`), llama.cpp each "
            f"GGUF type as written. The seed's headline metric: a {seed.tokens}-token "
            f"completion of a {seed.prompt_tokens}-token code prompt, one request, seconds "
            "from send to the last token. edgebus: 3 stages over Mosquitto on this machine, "
            f"{seed.stage_threads} thread(s) each, as `edgebus up` shares out the cores.\n\n"
            + table(["", f"{seed.tokens}-token completion", "tok/s", "TTFT", "weights held"],
                    rows))


def _boxes(result: BenchResult) -> str:
    if not result.boxes or result.one_core is None:
        why = ("`--quick`" if result.settings.quick
               else "`--weights` without fp32: the phase runs fp32 stages")
        return f"## Boxes add throughput\n\nNot measured ({why})."
    hf = result.one_core
    one = {s.concurrency: s.tok_s for run in result.boxes if run.stages == 1 for s in run.load}
    rows = [["transformers, 1 core, one request at a time", "", rate(hf.single_tok_s),
             "1.00x", "", ""]]
    rows += [[f"transformers, 1 core, static batch of {size}", str(size), rate(tok_s),
              times(_ratio(tok_s, hf.single_tok_s)), "1.00x", ""]
             for size, tok_s in sorted(hf.batch_tok_s.items())]
    for run in result.boxes:
        split = " + ".join(f"{stop - first}" for first, stop in run.layers)
        rows += [[f"edgebus, {run.stages} stage(s) of {split} layers, a core each",
                  str(s.concurrency), rate(s.tok_s), times(_ratio(s.tok_s, hf.single_tok_s)),
                  times(_ratio(s.tok_s, hf.batch_tok_s.get(s.concurrency))),
                  times(_ratio(s.tok_s, one.get(s.concurrency)))] for s in run.load]
    return ("## Boxes add throughput\n\n"
            "Every process one torch thread. transformers runs pinned to one core; each "
            "stage is pinned to a core of its own (as on its own box), the broker (amqtt) "
            "and the coordinator unpinned. The layers are split as `edgebus plan` splits "
            "them over equal boxes (the last stage also runs the LM head, so it gets fewer "
            "layers), from the profile in the model directory. The target compares with the "
            "one process serving independent requests as `generate` does, one at a time. "
            "The static batch is an upper bound for it: requests that arrive apart cannot "
            "share one.\n\n"
            + table(["plant", "concurrency", "tok/s (aggregate)",
                     "x transformers one at a time", "x transformers static batch",
                     "x edgebus 1 stage"], rows)
            + "\n\nAgainst edgebus on one core the second box adds less, because that one "
            "stage batches too: it runs all n requests in one step, and a decode step "
            "costs nearly the same for 1 to 6 rows (it reads every weight once; "
            "[stage-compute.md](stage-compute.md)). Two stages keep both cores busy only "
            "with two groups of n/2 requests in flight, so their bound is "
            "step(n) / step(n/2): about 1.3x at 8 requests.")


def _plot(plot_name: str | None) -> str:
    if plot_name is None:
        return f"## Plot\n\nSkipped: matplotlib is not installed (`{INSTALL_PLOT}`)."
    return f"## Plot\n\n![aggregate tokens/s against concurrency]({plot_name})"


def _definitions(result: BenchResult) -> str:
    hops = len(result.stage_param_bytes) + 1
    return (
        "## How the numbers are made\n\n"
        "- Pipeline times are taken by the bench's gateway, one MQTT client with TCP_NODELAY: "
        "send, each streamed delta's arrival, the final response.\n"
        "- tok/s (one at a time): generated tokens over the seconds from send to response, "
        "TTFT included. Aggregate tok/s: all generated tokens over first send to last response.\n"
        "- TTFT: send to the first streamed token (transformers: a streamer's first `put` "
        "after the prompt). ITL: the gaps between tokens, pooled over requests.\n"
        "- Bytes per token: a sniffer sums frame payloads per topic during a 1-token and a "
        "full-length request; their difference over the extra tokens is decode traffic only.\n"
        "- Broker hop: median of 200 QoS 1 round trips of a 1208-byte payload (a decode "
        "frame) between two clients, halved.\n"
        "- Decode step p50: the single-stream ITL p50, one trip of a token around the loop.\n"
        f"- Pipeline overhead per hop: (decode step p50 - Σ stage compute per decode step) / "
        f"{hops} hops, the compute from the stages' status metrics (`compute_s`, `steps`) over "
        "the same two requests as the bytes.\n"
        "- Weights held: the stage's tensors' sizes from the safetensors headers (its layers; "
        "the embedding on the first; the final norm and the tied head on the last).")


_STAGE_COMPUTE = (
    "## Stage compute\n\nWhat was tried to make a stage's forward pass faster (bf16, int8, "
    "torch.compile, batching), with numbers: [stage-compute.md](stage-compute.md), "
    "made by `python benchmarks/stage_compute.py`. The engines and weight modes a plant can "
    "choose per node (torch: fp32, bf16, int8; onnxruntime: fp32, int8, int4), with "
    "tokens/s, stage RSS, greedy agreement with torch fp32 and perplexity: "
    "[weight-modes.md](weight-modes.md), made by `python benchmarks/weight_modes.py`.")


def _weight_modes(doc: Path) -> str:
    """The weight-mode table of `python benchmarks/weight_modes.py`, if it has been run.

    Copied in, not re-measured: that benchmark takes minutes of its own and
    loads the model once per mode; the doc it writes says when it ran.
    """
    if not doc.is_file():
        return ""
    lines = doc.read_text(encoding="utf-8").splitlines()
    rows = [line for line in lines if line.startswith("|")]
    when = next((line for line in lines if line.startswith("A stage's weights")), "")
    return "\n".join([f"## Weight modes\n\nFrom [{doc.name}]({doc.name}): {when}\n", *rows])


def _notes(result: BenchResult) -> str:
    if not result.notes:
        return ""
    return "## Notes\n\n" + "\n".join(f"- {note}" for note in result.notes)


# -- files -----------------------------------------------------------------------------


def write_plot(result: BenchResult, path: Path) -> bool:
    """Aggregate tok/s against concurrency per broker, baselines as lines.

    False, and no file, when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")  # a file, no display
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run in result.pipelines:
        ax.plot([s.concurrency for s in run.load], [s.tok_s for s in run.load], marker="o",
                label=f"3 stages, {run.label}")
    if result.peers is not None and not isinstance(result.peers.slots, Skipped):
        ax.plot([s.concurrency for s in result.peers.slots],
                [s.tok_s for s in result.peers.slots], marker="s", linestyle="--",
                label=f"llama-server -np {TARGET_CONCURRENCY}")
    # Doubling steps of concurrency, evenly spaced and labelled as measured.
    ax.set_xscale("log", base=2)
    ax.set_xticks(result.settings.concurrency, [str(c) for c in result.settings.concurrency])
    hf = result.transformers
    lines = [("transformers, single stream", hf.single.tok_s, "-")]
    lines += [(f"transformers, static batch {size}", tok_s, "--")
              for size, tok_s in sorted(hf.batch_tok_s.items())]
    if result.llama_cpp is not None:
        lines.append(("llama.cpp Q4_1, single stream", result.llama_cpp.tok_s, ":"))
    for (label, value, style), color in zip(lines, ("dimgray", "darkgray", "gray", "black"),
                                            strict=False):
        ax.axhline(value, linestyle=style, color=color, label=label)
    ax.set_ylim(bottom=0)  # after every line is drawn: it freezes the top too
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("generated tokens/s (aggregate)")
    ax.set_title(f"{result.model} on {result.machine.usable_cores} cores")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# Sections of the report that runs other than the bench's made: `edgebus rehearse`
# (root, namespaces, minutes each) and benchmarks/stage_threads.py (a plant per variant,
# all up at once). A bench rerun keeps them as they are.
KEPT_HEADINGS = ("## Rehearsal", "## Slow links", "## Stage threads")


def kept_sections(previous: str) -> list[str]:
    """The kept sections of a previous report, each up to the next `## ` heading."""
    parts = re.split(r"(?m)^(?=## )", previous)
    return [part.rstrip("\n") for part in parts if part.startswith(KEPT_HEADINGS)]


def write_report(result: BenchResult) -> tuple[str, Path | None]:
    """Write the markdown (and the PNG beside it, if possible); return the text and the PNG path."""
    out = result.settings.out
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    plot = png if write_plot(result, png) else None
    text = render_markdown(result, None if plot is None else plot.name)
    if out.exists():
        text += "".join(f"\n{section}\n" for section in kept_sections(out.read_text("utf-8")))
    out.write_text(text, encoding="utf-8")
    return text, plot
