"""The bench's pure parts (benchmarks/harness/): the metric arithmetic and the report, on given
numbers.

Nothing here is timed and nothing starts a plant: the bench itself is the
timed run, and its numbers are machine-dependent by nature.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from edgebus.core.processes import proc_status_bytes
from harness import report, shared_cores, speculation
from harness.metrics import (
    HopLatency,
    LoadStats,
    StreamStats,
    Trace,
    hop_overhead,
    inter_token_latencies,
    load_stats,
    marginal_rate,
    param_bytes_by_stage,
    percentile,
    stream_stats,
    time_to_first_token,
)
from harness.peers import PeerRuns, RpcRun, Skipped
from harness.results import (
    BenchResult,
    BenchSettings,
    BoxesRun,
    Machine,
    OneCoreBaseline,
    PipelineRun,
    SeedShape,
    SeedShapeRun,
    TransformersBaseline,
    Wire,
)
from harness.shared_cores import Floor
from harness.speculation import SpeculationLoad, SpeculationRun
from harness.stage_steps import StageSteps
from plant_config import Plant, make_plant

MIB = 1024**2


# -- metrics ---------------------------------------------------------------------------


def test_percentile_interpolates_between_ranks_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 100) == 4.0
    assert percentile(range(1, 101), 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0


@pytest.mark.parametrize("values, q", [([], 50.0), ([1.0], 101.0)])
def test_percentile_refuses_what_has_none(values: list[float], q: float) -> None:
    with pytest.raises(ValueError):
        percentile(values, q)


def test_inter_token_latency_spreads_a_multi_token_piece_over_its_tokens() -> None:
    # Token 2's text was held back and came with token 3; index 4 is the final
    # flush past the last token and is no token at all.
    trace = Trace(sent=0.0, arrivals=[(0, 1.0), (1, 1.1), (3, 1.5), (4, 1.6)], done=1.7,
                  tokens=4)
    assert inter_token_latencies(trace) == pytest.approx([0.1, 0.2, 0.2])
    assert time_to_first_token(trace) == pytest.approx(1.0)


def test_time_to_first_token_without_stream_is_the_response() -> None:
    assert time_to_first_token(Trace(sent=2.0, arrivals=[], done=2.5, tokens=1)) == 0.5


def test_stream_stats_sums_tokens_over_summed_durations() -> None:
    traces = [Trace(sent=0.0, arrivals=[(i, 0.2 + 0.1 * i) for i in range(4)], done=0.5,
                    tokens=4),
              Trace(sent=10.0, arrivals=[(i, 10.4 + 0.1 * i) for i in range(4)], done=10.8,
                    tokens=4)]
    stats = stream_stats(traces)
    assert stats.tok_s == pytest.approx(8 / 1.3)
    assert stats.ttft_s == pytest.approx(0.3)  # median of 0.2 and 0.4
    assert stats.itl_p50_s == pytest.approx(0.1)


def test_load_stats_is_tokens_over_first_send_to_last_response() -> None:
    traces = [Trace(sent=0.0, arrivals=[(0, 0.5), (1, 0.6)], done=1.0, tokens=2),
              Trace(sent=0.2, arrivals=[(0, 0.7), (1, 0.9)], done=2.0, tokens=2)]
    stats = load_stats(2, traces)
    assert (stats.requests, stats.tokens, stats.wall_s) == (2, 4, 2.0)
    assert stats.tok_s == 2.0


def test_bytes_per_decode_token_cancel_prefill_and_release() -> None:
    prefill, release, per_token, tokens = 50_000, 56, 1208, 64
    short = prefill + release  # a 1-token request: the prefill frame gives the only token
    long = prefill + release + (tokens - 1) * per_token
    assert marginal_rate((short, 1), (long, tokens)) == per_token
    with pytest.raises(ValueError):
        marginal_rate((short, 1), (long, 1))


def test_wire_mean_per_hop_of_a_three_stage_decode_step() -> None:
    # TOKENS (header + 1 int32), two HIDDEN (header + 576 fp16), CANDIDATES (id + logit).
    wire = Wire({"stage-0": 60, "stage-1": 1208, "stage-2": 1208, "coordinator": 64})
    assert wire.per_hop == 635


def test_hop_overhead_is_what_the_stages_do_not_compute_per_hop() -> None:
    assert hop_overhead(0.084, [0.024, 0.023, 0.025], 4) == pytest.approx(0.003)


def test_proc_status_memory_fields() -> None:
    status = "Name:\tpython\nVmHWM:\t  336000 kB\nVmRSS:\t  300000 kB\n"
    assert proc_status_bytes(status, "VmHWM") == 336000 * 1024
    assert proc_status_bytes(status, "VmRSS") == 300000 * 1024
    with pytest.raises(ValueError):
        proc_status_bytes("Name:\tpython\n", "VmHWM")


def _checkpoint(layers: int, *, tied: bool) -> dict[str, int]:
    sizes = {f"model.layers.{i}.mlp.up_proj.weight": 100 for i in range(layers)}
    sizes |= {f"model.layers.{i}.input_layernorm.weight": 1 for i in range(layers)}
    sizes |= {"model.embed_tokens.weight": 1000, "model.norm.weight": 7}
    return sizes if tied else sizes | {"lm_head.weight": 2000}


def test_weight_share_with_a_tied_head() -> None:
    shares = param_bytes_by_stage(_checkpoint(6, tied=True), [(0, 2), (2, 4), (4, 6)])
    assert shares == [1000 + 202, 202, 202 + 7 + 1000]


def test_weight_share_with_an_untied_head_and_with_one_stage() -> None:
    assert param_bytes_by_stage(_checkpoint(4, tied=False), [(0, 2), (2, 4)]) == [
        1000 + 202, 202 + 7 + 2000]
    # One stage holding embedding and tied head holds that matrix once.
    assert param_bytes_by_stage(_checkpoint(4, tied=True), [(0, 4)]) == [1000 + 404 + 7]


# -- report ----------------------------------------------------------------------------


def _stream(tok_s: float) -> StreamStats:
    return StreamStats(tok_s=tok_s, ttft_s=0.2, itl_p50_s=0.07, itl_p99_s=0.09)


def _load(concurrency: int, tok_s: float) -> LoadStats:
    return LoadStats(concurrency=concurrency, requests=2 * concurrency, tokens=1000,
                     wall_s=1000 / tok_s, ttft_p50_s=0.3, itl_p50_s=0.1, itl_p99_s=0.2)


BOXES = "2 pinned stages at 4-8 concurrent vs one process on 1 core (transformers, 1 thread)"


def _pipeline(broker: str, single: float, at_16: float, weights: str = "fp32") -> PipelineRun:
    stage_rss = {"stage-0": 500 * MIB, "stage-1": 400 * MIB, "stage-2": 500 * MIB}
    held = {"stage-0": 30 * MIB, "stage-1": 20 * MIB, "stage-2": 30 * MIB}
    engine = {"fp32": "torch", "int4": "onnxruntime", "gguf": "llamacpp"}[weights]
    return PipelineRun(
        broker=broker, weights=weights, engine=engine,
        engines={node: {"weight_bytes": size, "threads": 1} for node, size in held.items()},
        single=_stream(single),
        load=[_load(1, single), _load(4, 30.0), _load(16, at_16)], long_ttft_s=1.0,
        wire=Wire({"stage-0": 60, "stage-1": 1208, "stage-2": 1208, "coordinator": 64}),
        hop=HopLatency(p50_s=0.0005, p99_s=0.001), compute_per_step_s=[0.02, 0.02, 0.03],
        overhead_per_hop_s=0.0035,
        online_peak_rss={**{name: rss - 20 * MIB for name, rss in stage_rss.items()},
                         "coordinator": 360 * MIB},
        single_peak_rss={**stage_rss, "coordinator": 365 * MIB},
        # 16 requests' KV caches on top: over weights + idle, which is not what is judged.
        peak_rss={**{name: rss + 100 * MIB for name, rss in stage_rss.items()},
                  "coordinator": 370 * MIB},
        end_rss={**stage_rss, "coordinator": 360 * MIB})


@pytest.fixture
def result(tmp_path: Path) -> BenchResult:
    settings = BenchSettings(out=tmp_path / "docs" / "benchmarks.md", quick=False,
                             brokers=("amqtt", "mosquitto"), tokens=64)
    machine = Machine(cpu="AMD EPYC", cores=2, usable_cores=2, memory_gib=23.5, kernel="6.1",
                      python="3.11.7", torch="2.13.0+cpu", transformers="5.24.0",
                      mosquitto="mosquitto version 2.0.11", llama_cpp=None,
                      date="2026-01-01 00:00 UTC", load_average=(0.1, 0.2, 0.3))
    return BenchResult(
        settings=settings, machine=machine, model="SmolLM2-135M-Instruct",
        chat_prompt_tokens=44, long_prompt_tokens=512,
        transformers=TransformersBaseline(single=_stream(10.0), batch_tok_s={8: 60.0, 16: 80.0},
                                          long_ttft_s=1.0),
        llama_cpp=None, idle_rss=300 * MIB, stage_layers=[(0, 10), (10, 20), (20, 30)],
        stage_param_bytes=[250 * MIB, 150 * MIB, 250 * MIB],
        pipelines=[_pipeline("amqtt", 9.0, 50.0), _pipeline("mosquitto", 9.6, 70.0),
                   _pipeline("mosquitto", 35.0, 150.0, weights="int4"),
                   _pipeline("mosquitto", 40.0, 200.0, weights="gguf")],
        boxes=[BoxesRun(stages=1, layers=[(0, 30)], load=[_load(4, 10.0), _load(8, 10.0)]),
               BoxesRun(stages=2, layers=[(0, 19), (19, 30)],
                        load=[_load(4, 16.0), _load(8, 18.0)])],
        one_core=OneCoreBaseline(single_tok_s=5.0, batch_tok_s={4: 12.0, 8: 15.0}),
        elapsed_s=540.0, notes=["a note for the reader"], bandwidth_gbs=20.0,
        peers=PeerRuns(single={1: _stream(50.0), 2: _stream(80.0)},
                       slots=[_load(1, 70.0), _load(16, 100.0)],
                       rpc=RpcRun(servers=3, server_threads=1, single=_stream(25.0),
                                  load=[_load(1, 25.0), _load(16, 40.0)],
                                  wire_bytes_per_token=216_000.0, wire_note=None)))


def _verdicts(markdown: str) -> dict[str, tuple[str, str]]:
    """Target name -> (measured, verdict) from the Targets table."""
    section = markdown.split("## Targets", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines()
            if line.startswith("| ") and not line.startswith("| target")]
    return {cells[0].strip(): (cells[1].strip(), cells[3].strip()) for cells in rows}


def test_targets_are_judged_on_mosquitto_against_the_same_run(result: BenchResult) -> None:
    verdicts = _verdicts(report.render_markdown(result, "benchmarks.png"))
    where = "3 stages over mosquitto"
    assert verdicts[f"single stream, {where}, vs transformers single stream"] == ("0.96x", "pass")
    assert verdicts[f"16 concurrent, {where}, vs transformers single stream"] == ("7.00x", "pass")
    # The lower of 16 and 18 tok/s, over transformers serving one request at a time.
    assert verdicts[BOXES] == ("3.20x", "pass")
    assert verdicts[f"TTFT of the 512-token prompt, {where}, vs transformers"] == \
        ("1.00x", "pass")
    # One request at a time: stage-1 400 MiB against 150 + 300, stage-0 500 against 250 + 300.
    assert verdicts["worst stage peak RSS (one request at a time) vs its weights + an idle "
                    "agent"] == ("0.91x", "pass")


def test_gguf_is_judged_against_llama_cpp_measured_in_the_same_run(
        result: BenchResult) -> None:
    verdicts = _verdicts(report.render_markdown(result, None))
    where = "gguf, 3 stages over mosquitto"
    assert verdicts[f"single stream, {where}, vs llama.cpp RPC (3 rpc-servers)"] == \
        ("1.60x", "**fail**")
    # The one-process peer with a stage's threads (1 thread: 50 tok/s), not every core's.
    assert verdicts[f"single stream, {where}, vs llama.cpp in one process with a stage's "
                    "threads (1)"] == ("0.80x", "pass")
    assert verdicts[f"16 concurrent, {where}, vs llama-server -np 16"] == ("2.00x", "pass")
    assert verdicts[f"16 concurrent, {where}, vs llama.cpp RPC"] == ("5.00x", "pass")
    assert verdicts[f"TTFT p50 at 16, {where}, vs llama-server -np 16's"] == ("1.00x", "pass")
    # stage-1: 20 MiB at 20 GB/s is 1.05 ms of a 20 ms step.
    assert verdicts["worst stage decode step vs its memory roofline (weight bytes / "
                    "bandwidth)"] == ("0.05x", "**fail**")


def test_llama_cpp_stages_are_held_to_the_whole_models_step(result: BenchResult) -> None:
    steps = [StageSteps("m", 1, [(0, 10), (10, 30)], whole_ms=10.0, stage_ms=[4.0, 6.2]),
             StageSteps("m", 2, [(0, 10), (10, 30)], whole_ms=6.0, stage_ms=[3.0, 3.5])]
    markdown = report.render_markdown(dataclasses.replace(result, stage_steps=steps), None)
    verdicts = _verdicts(markdown)
    name = "llama.cpp stages' decode steps summed vs the whole model's, m"
    assert verdicts[f"{name}, 1 thread(s)"] == ("1.02x", "pass")
    assert verdicts[f"{name}, 2 thread(s)"] == ("1.08x", "**fail**")
    assert "| m | 1 | 10.00 ms | 4.00 + 6.20 ms | 10.20 ms | 1.02x |" in markdown


def test_the_shared_cores_floor_is_set_beside_the_pipeline(result: BenchResult) -> None:
    floors = [Floor("SmolLM2-135M-Instruct", [(0, 10), (10, 20), (20, 30)], 1,
                    whole_ms=14.0, chain_ms=17.5, exact=True, load_rows=16, load_groups=2,
                    whole_threads=2, whole_tok_s=160.0, chain_tok_s=144.0)]
    markdown = report.render_markdown(dataclasses.replace(result, floors=floors), None)
    section = markdown.split("## Sharing one box's cores", 1)[1].split("\n## ", 1)[0]
    # The gguf pipeline's ITL p50 is 70 ms: 17.5 / 70 = 0.25 of the chain's speed.
    assert ("| SmolLM2-135M-Instruct | single stream, ms a token (1 thread(s) a process) | "
            "14.00 | 17.50 | 0.80x | 70.0 ms | 0.25x |") in section
    assert ("| SmolLM2-135M-Instruct | 16 rows a step, tok/s (whole: 2 threads; chain: 2 "
            "groups of 8) | 160.0 | 144.0 | 0.90x |  |  |") in section
    assert "equal the whole model's on every model" in section
    inexact = [dataclasses.replace(floors[0], exact=False)]
    markdown = report.render_markdown(dataclasses.replace(result, floors=inexact), None)
    assert "differ from the whole model's on SmolLM2-135M-Instruct" in markdown


def test_the_stages_chained_by_pipes_compute_what_the_whole_model_does(
        tiny_llama_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The floor measures the same computation as the whole model, and under load too."""
    monkeypatch.setattr(shared_cores, "SINGLE_STEPS", 12)
    monkeypatch.setattr(shared_cores, "LOAD_STEPS", 6)
    monkeypatch.setattr(shared_cores, "BLOCK_STEPS", 5)
    floor = shared_cores.measure(tiny_llama_gguf, "tiny", [(0, 2), (2, 4), (4, 6)],
                                 stage_threads=1, load_rows=4, load_groups=2, whole_threads=1)
    assert floor.exact
    assert floor.whole_ms > 0 and floor.chain_ms > 0
    assert floor.whole_tok_s is not None and floor.whole_tok_s > 0
    assert floor.chain_tok_s is not None and floor.chain_tok_s > 0


def test_drafts_are_held_to_llama_cpp_and_to_the_plant_without_them(
        result: BenchResult) -> None:
    runs = [SpeculationRun("seed Q4_0", 3, False, 1, "quoting", off=_stream(10.0), on=_stream(14.0),
                           proposed=100, accepted=60, tokens=256, llama_cpp=_stream(20.0),
                           llama_lookup=_stream(28.0)),
            SpeculationRun("seed Q4_0", 3, False, 1, "free", off=_stream(10.0), on=_stream(9.0),
                           proposed=10, accepted=1, tokens=256, llama_cpp=None,
                           llama_lookup=None)]
    load = SpeculationLoad(16, off=_load(16, 100.0), on=_load(16, 99.0))
    markdown = report.render_markdown(dataclasses.replace(
        result, speculation=runs, speculation_load=load), None)
    verdicts = _verdicts(markdown)
    assert verdicts["drafts on, seed Q4_0, 3 stages, quoting, vs llama.cpp in one process on "
                    "the same cores"] == ("0.70x", "**fail**")
    assert verdicts["drafts on, seed Q4_0, 3 stages, quoting, vs llama.cpp's own lookup "
                    "decoding"] == ("0.50x", "**fail**")
    assert verdicts["drafts on, seed Q4_0, 3 stages, free, vs the plant with drafts off"] == (
        "0.90x", "**fail**")
    assert verdicts["16 concurrent, drafts on vs off"] == ("0.99x", "pass")
    section = markdown.split("## Pipelined speculation", 1)[1].split("\n## ", 1)[0]
    assert ("| seed Q4_0 | 3 stages | quoting | 10.0 | 14.0 | 1.40x | 60 of 100 (60%) | 23% | "
            "20.0 | 0.70x | 28.0 | 0.50x |") in section
    assert ("| seed Q4_0 | 3 stages | free | 10.0 | 9.0 | 0.90x | 1 of 10 (10%) | 0% | "
            "n/a |") in section


# The speculation phase's plant's status period (the plant file's default: 2 s).
STATUS_HEARTBEAT_S = 0.25


# Tokens of each request in the speculation phase's test: the drafting Llama's answers
# fall into the phrases they repeat within their first twenty tokens or so.
SPECULATION_TOKENS = 32


def test_the_speculation_phase_measures_a_plant_with_drafts_and_without(
        drafting_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The phase for real, shortened: one turn each way, a few tokens, no llama.cpp peer
    (its tools take half an hour to build), and it says so. On the tiny Llama whose answers
    repeat themselves (conftest.py), so that drafts are taken: what is under test is the
    phase's plants, counts and report, not a real model's speed."""
    monkeypatch.setattr(speculation, "TURNS", 1)
    monkeypatch.setattr(speculation, "TOKENS", SPECULATION_TOKENS)
    # One request of each workload: the plants' starts, not their tokens, are the phase's cost.
    workloads = {name: texts[:1] for name, texts in speculation.WORKLOADS.items()}
    monkeypatch.setattr(speculation, "WORKLOADS", workloads)
    notes: list[str] = []

    def plant(url: str) -> Plant:
        made = make_plant(drafting_llama, stages=2, broker=url, plant_id="spec", weights="gguf")
        # One thread a stage: its two stages share this box's two cores. The phase reads
        # the drafts counted from the coordinator's status, refreshed every heartbeat: a
        # short one, so that each of its reads waits a fraction of a second, not up to two.
        return made.model_copy(update={"stages": [
            s.model_copy(update={"kv_budget_mb": 32, "threads": 1}) for s in made.stages],
            "liveness": made.liveness.model_copy(update={"heartbeat_s": STATUS_HEARTBEAT_S}),
            "coordinator": made.coordinator.model_copy(update={
                "max_prompt_tokens": 256, "max_tokens_limit": SPECULATION_TOKENS})})

    runs, load = speculation.measure("drafting Llama", plant, tmp_path,
                                     AutoTokenizer.from_pretrained(drafting_llama), None,
                                     threads=1, load=False, notes=notes)
    assert load is None
    assert [run.workload for run in runs] == ["quoting", "free"]
    quoting = runs[0]
    assert quoting.off.tok_s > 0 and quoting.on.tok_s > 0
    assert quoting.tokens == SPECULATION_TOKENS * len(workloads["quoting"])
    assert quoting.proposed > 0 and 0 < quoting.accepted <= quoting.proposed
    assert quoting.llama_cpp is None and any("not measured" in n for n in notes)


def test_the_seed_shape_is_held_to_llama_cpp_with_a_stages_threads(
        result: BenchResult) -> None:
    runs = [SeedShapeRun("llamacpp", "gguf", _stream(12.0), 776 * MIB)]
    seed = SeedShape(model="seed", prompt_tokens=45, tokens=256, runs=runs,
                     llama_cpp={"Q4_0": _stream(25.0)}, stage_gguf="Q4_0", stage_threads=1,
                     llama_cpp_stage_threads=_stream(15.0))
    markdown = report.render_markdown(dataclasses.replace(result, seed_shape=seed), None)
    # Against the one-process run with a stage's one thread (15 tok/s), not the box's two.
    assert _verdicts(markdown)["single stream, seed Q4_0, 3 stages over Mosquitto, vs "
                               "llama.cpp in one process with a stage's threads (1)"] == \
        ("0.80x", "**fail**")
    assert "| llama.cpp in one process, Q4_0 (1 thread(s), a stage's) | 17.1 s |" in markdown
    assert "1 thread(s) each" in markdown


def test_a_peer_that_could_not_run_says_why(result: BenchResult) -> None:
    assert result.peers is not None
    missing = dataclasses.replace(result, peers=dataclasses.replace(
        result.peers, rpc=Skipped("not built: run `python benchmarks/build_peers.py`")))
    markdown = report.render_markdown(missing, None)
    assert "| llama.cpp RPC | not built: run `python benchmarks/build_peers.py` |" in markdown
    assert _verdicts(markdown)["single stream, gguf, 3 stages over mosquitto, vs llama.cpp RPC "
                               "(rpc-servers)"] == ("n/a", "n/a")


def test_int4_memory_and_perplexity_are_read_off_the_weight_modes_table(
        result: BenchResult) -> None:
    doc = result.settings.out.parent / report.WEIGHT_MODES_DOC
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text("# Weight modes\n\nA stage's weights ...\n\n"
                   "| engine and weights | tok/s | whole | middle | bytes | greedy | ppl |\n"
                   "| onnxruntime int4 | 70.1 (2.80x) | 120 MiB (0.19x) | 23 MiB (0.15x) "
                   "| 90 MiB | 20/128 (16%) | 32.633 (+0.48 %) |\n")
    verdicts = _verdicts(report.render_markdown(result, None))
    assert verdicts["int4 stage resident weights vs fp32, a middle stage (weight-modes.md)"] \
        == ("0.15x", "pass")
    assert verdicts["int4 perplexity vs fp32 (weight-modes.md), 1.03x = +3 %"] == \
        ("1.00x", "pass")


def test_a_missed_target_is_marked(result: BenchResult) -> None:
    slow = dataclasses.replace(result, pipelines=[_pipeline("mosquitto", 5.0, 20.0)])
    verdicts = _verdicts(report.render_markdown(slow, None))
    assert verdicts["single stream, 3 stages over mosquitto, vs transformers single stream"] \
        == ("0.50x", "**fail**")


def test_pinned_stages_fail_below_1_7x_of_one_core(result: BenchResult) -> None:
    faster = dataclasses.replace(result, one_core=OneCoreBaseline(single_tok_s=10.0,
                                                                  batch_tok_s={}))
    assert _verdicts(report.render_markdown(faster, None))[BOXES] == ("1.60x", "**fail**")


def test_quick_run_reports_what_it_skipped(result: BenchResult) -> None:
    quick = dataclasses.replace(
        result, settings=dataclasses.replace(result.settings, quick=True, tokens=16),
        pipelines=[_pipeline("amqtt", 9.0, 50.0)], boxes=[], one_core=None)
    quick = dataclasses.replace(quick, pipelines=[dataclasses.replace(
        quick.pipelines[0], load=quick.pipelines[0].load[:2])])
    markdown = report.render_markdown(quick, None)
    verdicts = _verdicts(markdown)
    assert verdicts["16 concurrent, 3 stages over amqtt, vs transformers single stream"] == \
        ("n/a", "n/a")
    assert verdicts[BOXES] == ("n/a", "n/a")
    assert "Not measured (`--quick`)" in markdown
    assert "python benchmarks/pipeline_vs_peers.py --out" in markdown and "--quick" in markdown
    assert "Skipped: matplotlib is not installed" in markdown


def test_the_weight_mode_table_is_copied_in_when_it_was_measured(result: BenchResult) -> None:
    assert "## Weight modes" not in report.render_markdown(result, None)
    doc = result.settings.out.parent / report.WEIGHT_MODES_DOC
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text("# Weight modes\n\nA stage's weights ... measured on 2026-11-30.\n\n"
                   "| weights | decode tok/s |\n| --- | --- |\n| int8 | 48.3 |\n\nReproduce: ...\n")
    markdown = report.render_markdown(result, None)
    assert "## Weight modes\n\nFrom [weight-modes.md](weight-modes.md): A stage's weights" \
        in markdown
    assert "| weights | decode tok/s |\n| --- | --- |\n| int8 | 48.3 |" in markdown


def test_markdown_has_every_section_and_row(result: BenchResult) -> None:
    markdown = report.render_markdown(result, "benchmarks.png")
    assert f"python benchmarks/pipeline_vs_peers.py --out {result.settings.out}\n" in markdown
    assert "| CPU | AMD EPYC |" in markdown
    assert "stages hold layers [0, 10), [10, 20), [20, 30)" in markdown
    assert "| llama.cpp (Q4_1 GGUF), single stream | not measured (see Notes) |" in markdown
    assert "| transformers, static batch 16 | 80.0 |" in markdown
    fp32 = "fp32 (torch) over mosquitto"
    assert f"| {fp32} | 16 | 32 | 70.0 | 7.00x | 300.0 ms | 100.0 ms | 200.0 ms |" in markdown
    assert "| fp32 (torch) over amqtt | 60 | 1208 | 1208 | 64 | 635 |" in markdown
    assert f"| {fp32} | 0.5 ms | 1.0 ms | 70.0 ms | 70.0 ms | 3.5 ms |" in markdown
    # online 380, one at a time 400, after 16 concurrent 500, at end 400; minus 300 idle and
    # 150 weights (fp32: the checkpoint's bytes)
    assert ("| fp32 (torch) over amqtt | stage-1 | 380 MiB | 400 MiB | 500 MiB | 400 MiB "
            "| 150 MiB | -70 MiB | -50 MiB | pass |") in markdown
    assert ("| fp32 (torch) over amqtt | coordinator | 360 MiB | 365 MiB | 370 MiB | 360 MiB "
            "|  |  |  |  |") in markdown
    # int4: what the stage reported holding
    assert "| int4 (onnxruntime) over mosquitto | stage-1 | 380 MiB | 400 MiB | 500 MiB " \
        "| 400 MiB | 20 MiB |" in markdown
    assert ("| edgebus, 3 stages over mosquitto, int4 (onnxruntime) | 35.0 | 150.0 | 300.0 ms "
            "| 2540 B |") in markdown
    assert ("| edgebus, 3 stages over mosquitto, gguf (llamacpp) | 40.0 | 200.0 | 300.0 ms "
            "| 2540 B |") in markdown
    assert "| llama.cpp RPC: 3 rpc-servers of 1 thread(s) + llama-server | 25.0 | 40.0 | " \
        "300.0 ms | 216000 B |" in markdown
    assert "| int4 (onnxruntime) over mosquitto | stage-1 | 20 MiB | 20.0 ms | 1.0 ms | 5% |" \
        in markdown
    assert "| transformers, 1 core, static batch of 8 | 8 | 15.0 | 3.00x | 1.00x |  |" in markdown
    assert ("| edgebus, 2 stage(s) of 19 + 11 layers, a core each | 8 | 18.0 | 3.60x | 1.20x "
            "| 1.80x |") in markdown
    assert "![aggregate tokens/s against concurrency](benchmarks.png)" in markdown
    assert "- a note for the reader" in markdown


def test_command_repeats_the_run() -> None:
    settings = BenchSettings(out=Path("docs/benchmarks.md"), quick=True, brokers=("mosquitto",),
                             tokens=16)
    assert settings.command() == ("python benchmarks/pipeline_vs_peers.py --out docs/benchmarks.md "
                                  "--quick --brokers mosquitto")
    assert dataclasses.replace(settings, quick=False, brokers=("amqtt", "mosquitto"),
                               tokens=32).command() == \
        "python benchmarks/pipeline_vs_peers.py --out docs/benchmarks.md --tokens 32"


def test_a_run_without_fp32_skips_the_pinned_stage_phase_and_says_why(
        result: BenchResult) -> None:
    """The phase runs fp32 stages: `--weights gguf` is the llama.cpp plant and its peers."""
    gguf = dataclasses.replace(result.settings, weights=("gguf",))
    assert result.settings.boxes and not gguf.boxes
    markdown = report.render_markdown(
        dataclasses.replace(result, settings=gguf, boxes=[], one_core=None), None)
    assert "Not measured (`--weights` without fp32" in markdown


def test_write_report_without_matplotlib_still_writes_the_markdown(
        result: BenchResult, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report, "write_plot", lambda result, path: False)
    text, plot = report.write_report(result)
    assert plot is None
    assert result.settings.out.read_text(encoding="utf-8") == text
    assert "Skipped: matplotlib is not installed" in text


def test_a_bench_rerun_keeps_the_sections_other_runs_made() -> None:
    previous = ("# Benchmarks\n\n## Targets\n\nold\n\n## Rehearsal: planned against equal split\n\n"
                "| a |\n\n### detail\n\ntext\n\n## Plot\n\nold plot\n\n## Slow links\n\nlinks\n"
                "\n## Stage threads and libgomp's spin\n\nspin\n")
    assert report.kept_sections(previous) == [
        "## Rehearsal: planned against equal split\n\n| a |\n\n### detail\n\ntext",
        "## Slow links\n\nlinks", "## Stage threads and libgomp's spin\n\nspin"]
