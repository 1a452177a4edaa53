"""The engines behind a stage: each mode and engine exact through any split, against itself.

fp32 on the torch engine is held to transformers' `generate` (test_pipeline.py).
Every other engine and weight mode computes other sums, so its bar is itself:
the pipeline, split any way and batching concurrent requests, must answer
what the same engine and weights answer for the whole model in one process,
one request at a time (`pipeline.engine_tokens`).

The real model runs once here, through one split of the onnxruntime engine (fp32: its
decode is the cheapest of the engine's modes on a CPU without VNNI, where MatMulNBits
dequantizes every block); each weight mode is a property of the code path and runs on
the tiny random Llama, whose answers depend on their history.

torch bf16 is held to that bar only on CPUs that multiply bf16 natively with
AVX512-BF16 and have no AMX (`BF16_INVARIANT`): there oneDNN's bf16 product
of a row does not depend on the other rows (verified on AMD EPYC, Zen 4).
On an Intel Xeon with AVX-512 it did, and 4 of these tests failed; where the
CPU differs, they skip, saying so (docs/weight-modes.md).
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest
import torch
from brokers import BrokerHandle
from pipeline import ask_all, engine_tokens, plant_for, running, stage_model
from test_pipeline import SMOLLM2_SPLITS, TINY_SPLITS, requests
from tiny_models import build_tiny

from edgebus.core.errors import EngineError
from node_agent.engines import load_engine, onnx_graphs
from node_agent.engines.onnx_engine import CACHE_DIR
from node_agent.kv_cache import KVCache
from plant_config.schema import EngineName, WeightMode


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {flag for line in text.splitlines() if line.startswith("flags")
            for flag in line.partition(":")[2].split()}


_FLAGS = _cpu_flags()
# Where torch bf16 was seen to compute a row the same in any batch: AMD EPYC
# (Zen 4), native AVX512-BF16 without AMX. oneDNN picks another bf16 kernel
# with AMX, and emulates bf16 without AVX512-BF16; on an Intel Xeon with
# AVX-512 (its bf16 flags not recorded) the results depended on the batch.
BF16_INVARIANT = "avx512_bf16" in _FLAGS and "amx_bf16" not in _FLAGS
_BF16 = pytest.param("torch", "bf16", id="torch-bf16", marks=pytest.mark.skipif(
    not BF16_INVARIANT, reason="torch bf16 is batch-invariant only with AVX512-BF16 and "
    "without AMX, and this CPU differs: not claimed here (docs/weight-modes.md)"))
# (engine, weights) pairs other than the reference, torch fp32.
MODES = [
    *(pytest.param(engine, weights, id=f"{engine}-{weights}")
      for engine, weights in [("onnxruntime", "int4"), ("onnxruntime", "int8"),
                              ("onnxruntime", "fp32"), ("torch", "int8")]),
    _BF16]
# A first, a middle and a last stage: each kind of stage built, chained and batched.
SMOLLM2_SPLIT = SMOLLM2_SPLITS["3-stages"]
# The tiny Llama's: a first, a middle and a last stage, and the whole model as one.
TINY_SPLITS_CHECKED = {"3-stages": TINY_SPLITS["3-stages-uneven"],
                       "1-stage": TINY_SPLITS["1-stage"]}
# SmolLM2's tokens a request: a token costs the whole model (0.2 s in onnxruntime fp32 on
# the EPYC), and the reference decodes each request alone; a few show the split exact.
SMOLLM2_TOKENS = 8
# SmolLM2's requests: the chat and the short prompt, sent together. The long prompt's
# prefill in chunks (300 positions, twice: the plant and the reference) and the batching of
# requests are the tiny Llama's to show, through every engine and mode
# (test_every_split_answers_what_one_process_answers): two short SmolLM2 requests share a
# pass only if the second's gateway is in before the first's 8 tokens are out, and in one
# run of a fresh machine it was not.
SMOLLM2_REQUESTS = ("chat", "short")


async def test_smollm2_through_three_onnxruntime_stages_answers_what_one_process_answers(
        smollm2_dir: Path, amqtt_broker: BrokerHandle) -> None:
    """The real model through the onnxruntime engine, split: exact against itself."""
    reqs = [r.model_copy(update={"max_tokens": SMOLLM2_TOKENS}) for r in requests()
            if r.id in SMOLLM2_REQUESTS]
    assert len(reqs) == len(SMOLLM2_REQUESTS)
    plant = plant_for(smollm2_dir, amqtt_broker, SMOLLM2_SPLIT, weights="fp32",
                      engine="onnxruntime")
    async with running(plant):
        responses = await ask_all(plant, reqs)
    for r, response in zip(reqs, responses, strict=True):
        assert response.error is None, response.error
        assert response.tokens == engine_tokens(smollm2_dir, r, "onnxruntime", "fp32"), r.id


def test_onnx_fp32_computes_what_torch_computes(smollm2_dir: Path) -> None:
    """The exported parts run transformers' layers: fp32 logits agree to float rounding."""
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 5646]])
    reference = stage_model(smollm2_dir, 0, 30, "fp32", "torch").prefill(ids, KVCache(), 0)
    onnx = stage_model(smollm2_dir, 0, 30, "fp32", "onnxruntime").prefill(ids, KVCache(), 0)
    assert (onnx - reference).abs().max() < 1e-3 * reference.abs().max()


@pytest.mark.parametrize(("engine", "weights"), MODES)
async def test_every_split_answers_what_one_process_answers(
        tiny_llama: Path, amqtt_broker: BrokerHandle, engine: EngineName,
        weights: WeightMode) -> None:
    """Three uneven stages, then the whole model as one stage, on one broker: each plant
    answers what the engine gives in one process."""
    # A random model may say its end token at once: it decodes all its tokens instead.
    reqs = [r.model_copy(update={"ignore_eos": True}) for r in requests()]
    for name, split in TINY_SPLITS_CHECKED.items():
        plant = plant_for(tiny_llama, amqtt_broker, split, weights=weights, engine=engine)
        async with running(plant) as stages:
            responses = await ask_all(plant, reqs)
        for r, response in zip(reqs, responses, strict=True):
            assert response.error is None, (name, response.error)
            assert response.tokens == engine_tokens(tiny_llama, r, engine, weights), (name, r.id)
        # The three requests were in flight together: some pass carried more than one row.
        assert stages[-1].metrics["rows"] > stages[-1].metrics["steps"], name


@pytest.mark.parametrize(("engine", "weights"), MODES)
def test_a_batched_step_computes_each_request_as_alone(tiny_llama: Path, engine: EngineName,
                                                       weights: WeightMode) -> None:
    """Decode rows at different positions and a prompt chunk, in one call, each give what
    their request gives on its own: the per-request attention must not mix requests, and
    a product's row must not depend on the other rows (bf16 did, for one row alone)."""
    model = stage_model(tiny_llama, 0, 6, weights, engine)
    prompts = [torch.arange(100, 100 + n).unsqueeze(0) for n in (5, 9, 7)]

    def caches() -> list[KVCache]:
        out = [KVCache() for _ in prompts[:2]]
        for cache, prompt in zip(out, prompts[:2], strict=False):
            model.prefill(prompt, cache, 0)
        return out

    rows = [torch.tensor([[7]]), torch.tensor([[8]]), prompts[2]]
    batched = model.step(rows, [*caches(), KVCache()], [5, 9, 0])
    alone_caches = [*caches(), KVCache()]
    for i, (row, start) in enumerate(zip(rows, [5, 9, 0], strict=True)):
        alone = model.step([row], [alone_caches[i]], [start])[0]
        together = batched[i]
        assert together is not None and alone is not None
        assert int(together.argmax()) == int(alone.argmax())
        assert (together - alone).abs().max() < 1e-4 * alone.abs().max()


def test_graphs_are_built_once_and_reused(tiny_llama: Path) -> None:
    load_engine(tiny_llama, 4, 6, engine="onnxruntime", weights="int4")
    built = sorted((tiny_llama / CACHE_DIR).glob("layers-4-6-int4-*"))
    assert len(built) == 1
    before = {f.name: f.stat().st_mtime_ns for f in built[0].iterdir()}
    load_engine(tiny_llama, 4, 6, engine="onnxruntime", weights="int4")
    assert sorted((tiny_llama / CACHE_DIR).glob("layers-4-6-int4-*")) == built
    assert {f.name: f.stat().st_mtime_ns for f in built[0].iterdir()} == before


def test_a_stage_links_the_graphs_another_stage_built(tiny_llama: Path) -> None:
    """A part's graph is its layers' alone, so stages of one checkpoint and mode share the
    parts they both run (hard links), whichever was built first. That the shared graphs
    compute the model is test_onnx_fp32_computes_what_torch_computes': SmolLM2's whole
    model there links 30 of its 32 parts from the three stages built before it."""
    load_engine(tiny_llama, 4, 6, engine="onnxruntime", weights="int8")
    load_engine(tiny_llama, 3, 6, engine="onnxruntime", weights="int8")
    (narrow,) = (tiny_llama / CACHE_DIR).glob("layers-4-6-int8-*")
    (wide,) = (tiny_llama / CACHE_DIR).glob("layers-3-6-int8-*")
    for part in ("mid-4-5.onnx", "exit-5-None.onnx", "head-None-None.onnx"):
        assert (wide / part).stat().st_ino == (narrow / part).stat().st_ino, part
    assert (wide / "entry-None-3.onnx").is_file() and (wide / "mid-3-4.onnx").is_file()


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """The tiny Mistral (window 8), no graphs cached: its first layer's template is
    exported once here, by the test that watches the exporter's logging."""
    return build_tiny("mistral", tmp_path_factory.mktemp("mistral"), smollm2_dir)


def test_building_graphs_logs_nothing_below_warning_but_its_own_lines(
        tiny_mistral: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent logs at INFO: the exporter's per-pass lines flooded `edgebus up`."""
    # No templates: an earlier test's would spare the exporter, whose lines are the point.
    exported: dict[str, onnx.ModelProto] = {}
    with monkeypatch.context() as patch, caplog.at_level(logging.INFO):
        patch.setattr(onnx_graphs, "_TEMPLATES", exported)
        load_engine(tiny_mistral, 0, 1, engine="onnxruntime", weights="int8")
    assert exported  # it did export
    assert [r.name for r in caplog.records if not r.name.startswith("node_agent")] == []
    # The process's templates gain them, as any export's: the sliding-window test's stage
    # is the same layer.
    onnx_graphs._TEMPLATES.update(exported)


def test_onnx_honours_a_sliding_window(tiny_mistral: Path) -> None:
    """A tiny Mistral (window 8) past its window: onnxruntime fp32 computes what torch does,
    alone and batched, and the window changes the answer (else the test proves nothing).
    Its first layer alone, as a first stage: the window is each layer's attention, and a
    stage of one layer is two graphs to export, where the whole model is four."""
    mistral = tiny_mistral
    ids = torch.arange(200, 230).unsqueeze(0)                                         # [1,30]
    torch_fp32 = stage_model(mistral, 0, 1, "fp32", "torch")
    onnx_fp32 = stage_model(mistral, 0, 1, "fp32", "onnxruntime")
    reference = torch_fp32.prefill(ids, KVCache(), 0)
    assert (onnx_fp32.prefill(ids, KVCache(), 0) - reference).abs().max() \
        < 1e-3 * reference.abs().max()
    caches = [KVCache(), KVCache()]
    torch_fp32.prefill(ids[:, :20], caches[0], 0)
    onnx_fp32.prefill(ids[:, :20], caches[1], 0)
    batched = onnx_fp32.step([ids[:, 20:], torch.tensor([[5]])], [KVCache(), caches[1]],
                             [0, 20])
    alone = torch_fp32.step([torch.tensor([[5]])], [caches[0]], [20])[0]
    assert batched[1] is not None and alone is not None
    assert (batched[1] - alone).abs().max() < 1e-3 * alone.abs().max()
    unwindowed = load_engine(mistral, 0, 1, engine="torch")
    unwindowed.config.sliding_window = None
    for layer in unwindowed.layers:
        layer.self_attn.config.sliding_window = None
    assert (unwindowed.prefill(ids, KVCache(), 0) - reference).abs().max() \
        > 1e-2 * reference.abs().max()


def test_a_device_this_onnxruntime_lacks_is_refused_saying_what_to_do(tiny_llama: Path) -> None:
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has a CUDA execution provider")
    with pytest.raises(EngineError, match=r"no cuda execution provider .* set `device: cpu`"):
        load_engine(tiny_llama, 0, 6, engine="onnxruntime", weights="int8", device="cuda")
