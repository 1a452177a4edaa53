"""The bench's output: target rows, `docs/benchmarks.md`, and the throughput plot beside it.

Rendering is a pure function of a `BenchResult`, so tests check it on given
numbers; only `write_report` touches the disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edgebus.bench.metrics import LoadStats
from edgebus.bench.results import BOXES_CONCURRENCY, BenchResult, PipelineRun

# The broker a plant runs in production; the targets are stated over it.
PRODUCTION_BROKER = "mosquitto"
# The concurrency the "many requests" target is stated at.
TARGET_CONCURRENCY = 16
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


def reference_run(result: BenchResult) -> PipelineRun | None:
    """The pipeline run the targets are judged on: Mosquitto's if measured, else the first."""
    runs = {run.broker: run for run in result.pipelines}
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
    llama = result.llama_cpp.tok_s if result.llama_cpp is not None else None
    rows += [
        Target(f"stretch: single stream, {where}, vs llama.cpp single stream",
               _ratio(run.single.tok_s if run else None, llama), 1.0, at_least=True),
        Target(f"stretch: {TARGET_CONCURRENCY} concurrent, {where}, vs llama.cpp single stream",
               _ratio(loaded.tok_s if loaded else None, llama), 1.0, at_least=True),
    ]
    return rows


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

# Written by `python -m edgebus.bench.weights` beside the report.
WEIGHT_MODES_DOC = "weight-modes.md"


def render_markdown(result: BenchResult, plot_name: str | None) -> str:
    """The whole `docs/benchmarks.md`; `plot_name` is the PNG beside it, None if skipped."""
    sections = [
        _header(result), _machine(result), _workload(result), _targets(result),
        _baselines(result), _single(result), _concurrency(result), _wire(result),
        _hops(result), _memory(result), _boxes(result), _STAGE_COMPUTE,
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
            f"Generated by `edgebus bench` on {result.machine.date} in {minutes:.1f} min. "
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
    return "## Machine\n\n" + table(["", ""], rows)


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
        rows.append(["llama.cpp (Q4_1 GGUF), single stream", "not installed", "", "", ""])
    else:
        rows.append(["llama.cpp (Q4_1 GGUF), single stream", rate(llama.tok_s),
                     ms(llama.ttft_s), ms(llama.itl_p50_s), ms(llama.itl_p99_s)])
    cores = result.machine.usable_cores
    return (f"## One-process baselines ({cores} threads)\n\n"
            + table(["", "tok/s", "TTFT", "ITL p50", "ITL p99"], rows))


def _single(result: BenchResult) -> str:
    hf = result.transformers
    rows = [[run.broker, rate(run.single.tok_s), times(_ratio(run.single.tok_s, hf.single.tok_s)),
             ms(run.single.ttft_s), ms(run.single.itl_p50_s), ms(run.single.itl_p99_s),
             ms(run.long_ttft_s), times(_ratio(run.long_ttft_s, hf.long_ttft_s))]
            for run in result.pipelines]
    return ("## Pipeline, 3 stages: one request at a time\n\n"
            + table(["broker", "tok/s", "x transformers", "TTFT", "ITL p50", "ITL p99",
                     f"TTFT {result.long_prompt_tokens}-token prompt", "x transformers"], rows))


def _load_row(label: list[str], stats: LoadStats, reference: float) -> list[str]:
    return [*label, str(stats.concurrency), str(stats.requests), rate(stats.tok_s),
            times(stats.tok_s / reference), ms(stats.ttft_p50_s), ms(stats.itl_p50_s),
            ms(stats.itl_p99_s)]


def _concurrency(result: BenchResult) -> str:
    reference = result.transformers.single.tok_s
    rows = [_load_row([run.broker], stats, reference)
            for run in result.pipelines for stats in run.load]
    return ("## Pipeline, 3 stages: concurrent requests\n\n"
            + table(["broker", "concurrency", "requests", "tok/s (aggregate)",
                     "x transformers single stream", "TTFT p50", "ITL p50", "ITL p99"], rows))


def _wire(result: BenchResult) -> str:
    if not result.pipelines:
        return ""
    hops = list(result.pipelines[0].wire.per_topic)
    rows = [[run.broker, *(f"{run.wire.per_topic.get(h, 0.0):.0f}" for h in hops),
             f"{run.wire.per_hop:.0f}"] for run in result.pipelines]
    return ("## Bytes on the wire per decode token\n\n"
            "Frame payload bytes per generated token on each hop (`{root}/act/<agent>`), "
            "prefill excluded; MQTT's own header and topic add ~30 bytes a message.\n\n"
            + table(["broker", *(f"→ {h}" for h in hops), "mean per hop"], rows))


def _hops(result: BenchResult) -> str:
    rows = []
    for run in result.pipelines:
        compute = (None if run.compute_per_step_s is None
                   else sum(run.compute_per_step_s))
        rows.append([run.broker, ms(run.hop.p50_s), ms(run.hop.p99_s), ms(run.single.itl_p50_s),
                     ms(compute), ms(run.overhead_per_hop_s)])
    return ("## Latency per hop\n\n"
            + table(["broker", "broker hop p50 (one way)", "broker hop p99",
                     "decode step p50", "Σ stage compute per step",
                     "pipeline overhead per hop"], rows))


def _memory(result: BenchResult) -> str:
    weights = dict(zip((f"stage-{i}" for i in range(len(result.stage_param_bytes))),
                       result.stage_param_bytes, strict=True))
    top = max(result.settings.concurrency)
    rows = []
    for run in result.pipelines:
        for name, peak in run.peak_rss.items():
            online, single = run.online_peak_rss.get(name), run.single_peak_rss.get(name)
            cells = [run.broker, name, *(mib(b) if b is not None else "" for b in
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
            + table(["broker", "process", "peak RSS, online", "peak RSS, one request at a time",
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


def _boxes(result: BenchResult) -> str:
    if not result.boxes or result.one_core is None:
        return "## Boxes add throughput\n\nNot measured (`--quick`)."
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
    "made by `python -m edgebus.bench.compute`. The weight modes a plant can choose per node "
    "(fp32, bf16, int8), with tokens/s, stage RSS, greedy agreement with fp32 and perplexity: "
    "[weight-modes.md](weight-modes.md), made by `python -m edgebus.bench.weights`.")


def _weight_modes(doc: Path) -> str:
    """The weight-mode table of `python -m edgebus.bench.weights`, if it has been run.

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
                label=f"3 stages, {run.broker}")
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


def write_report(result: BenchResult) -> tuple[str, Path | None]:
    """Write the markdown (and the PNG beside it, if possible); return the text and the PNG path."""
    out = result.settings.out
    out.parent.mkdir(parents=True, exist_ok=True)
    png = out.with_suffix(".png")
    plot = png if write_plot(result, png) else None
    text = render_markdown(result, None if plot is None else plot.name)
    out.write_text(text, encoding="utf-8")
    return text, plot
