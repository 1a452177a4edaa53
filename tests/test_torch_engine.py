"""A stage holds its own slice of the model and nothing more, and computes it right."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from edgebus.core.errors import CheckpointError
from node_agent.engines.torch_engine import TorchEngine
from node_agent.kv_cache import KVCache

_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}


def _checkpoint_bytes(model_dir: Path, prefixes: tuple[str, ...]) -> int:
    """Bytes of the checkpoint tensors whose names start with one of `prefixes`."""
    total = 0
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            if name.startswith(prefixes):
                sl = f.get_slice(name)
                n = 1
                for d in sl.get_shape():
                    n *= d
                total += n * _DTYPE_BYTES[sl.get_dtype()]
    return total


@pytest.mark.slow
@pytest.mark.parametrize(("first", "end", "extra"), [
    (0, 10, ("model.embed_tokens.",)),
    (10, 20, ()),
    # SmolLM2 ties its head to the embedding: the last stage loads that tensor as its head.
    (20, 30, ("model.embed_tokens.", "model.norm.")),
])
def test_stage_holds_only_its_own_parameters(smollm2_dir: Path, first: int, end: int,
                                             extra: tuple[str, ...]) -> None:
    stage = TorchEngine(smollm2_dir, first, end)
    own = tuple(f"model.layers.{i}." for i in range(first, end)) + extra
    assert stage.param_bytes == _checkpoint_bytes(smollm2_dir, own)
    assert stage.param_bytes < 0.5 * _checkpoint_bytes(smollm2_dir, ("",))


@pytest.mark.slow
def test_last_stage_skips_the_head_for_a_prompt_chunk_before_the_last(smollm2_dir: Path) -> None:
    stage = TorchEngine(smollm2_dir, 20, 30)
    x = torch.randn(1, 8, 576)                                                       # [1,T,H]
    assert stage.prefill(x, KVCache(), 0, logits=False).shape == (1, 8, 576)
    assert stage.prefill(x, KVCache(), 0).shape == (1, stage.config.vocab_size)


@pytest.mark.slow
def test_a_prompt_chunk_and_decode_rows_in_one_pass_equal_each_alone(smollm2_dir: Path) -> None:
    """One packed pass: a decode row, a prompt chunk after cached history, a fresh prompt.
    Each request gets the logits it gets alone, and a cache it can go on from."""
    stage = TorchEngine(smollm2_dir, 20, 30)
    torch.manual_seed(0)
    histories = [torch.randn(1, 9, 576), torch.randn(1, 6, 576), torch.randn(1, 0, 576)]
    news = [torch.randn(1, 1, 576), torch.randn(1, 5, 576), torch.randn(1, 4, 576)]
    packed, alone = [KVCache() for _ in news], [KVCache() for _ in news]
    for history, *caches in zip(histories, packed, alone, strict=True):
        for cache in caches:
            if history.shape[1]:
                stage.prefill(history, cache, 0)
    starts = [h.shape[1] for h in histories]
    together = stage.step(news, packed, starts, [True, True, False])
    for i, (x, cache, start) in enumerate(zip(news, alone, starts, strict=True)):
        each = stage.prefill(x, cache, start)                                       # [1,V]
        if i == 2:  # no logits asked for: a prompt chunk before the last
            assert together[i] is None
        else:
            result = together[i]
            assert result is not None
            # Packed rows go through a GEMM of more rows: equal to ~1e-6, not bitwise.
            torch.testing.assert_close(result, each, rtol=1e-4, atol=1e-4)
    nxt = torch.randn(1, 1, 576)
    for i, start in enumerate(starts):  # the packed pass left each cache as its own pass did
        assert packed[i].get_seq_length() == alone[i].get_seq_length() == start + news[i].shape[1]
        torch.testing.assert_close(stage.prefill(nxt, packed[i], packed[i].get_seq_length()),
                                   stage.prefill(nxt, alone[i], alone[i].get_seq_length()),
                                   rtol=1e-4, atol=1e-4)


_MEASURE = """
import json, os, sys, traceback
from pathlib import Path
from node_agent.engines.torch_engine import TorchEngine

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) * 1024

def measure(model_dir, weights):
    TorchEngine(model_dir, 1, 2, weights=weights)  # pay for lazy initialisation first
    base = rss()
    stage = TorchEngine(model_dir, 10, 20, weights=weights)
    # Touch every weight: RSS must count them, however they were loaded.
    # max, not sum: an int8 sum makes int64 temporaries, whose leftovers in the heap
    # moved the int8 figure by up to 25 MB from run to run.
    assert all(bool(p.max().isfinite()) for p in stage.parameters())
    return {"grown": rss() - base, "params": stage.param_bytes}

model_dir, measured = Path(sys.argv[1]), {}
for weights in sys.argv[2:]:
    # Each mode in a child forked before any weight was loaded or any thread started: its
    # growth is its own, and the imports are paid once.
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(write, json.dumps(measure(model_dir, weights)).encode())
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        written = pipe.read()
    assert os.waitpid(pid, 0)[1] == 0, f"measuring {weights} failed"
    measured[weights] = json.loads(written)
print(json.dumps(measured))
"""
MODES = ("fp32", "int8", "bf16")


MemoryByMode = dict[str, dict[str, int]]
# The measuring process's imports and three loads, on a loaded box.
MEASURE_S = 120


@pytest.fixture(scope="module", autouse=True)
def middle_stage_memory(smollm2_dir: Path) -> Iterator[Callable[[], MemoryByMode]]:
    """How much a fresh process grows loading layers [10, 20) in each weight mode, by mode;
    measured once a run, in one process that forks a child a mode after its imports (a
    process a mode spent 5 s apiece, most of it importing torch and transformers).

    Started with the module's first test, on a core of its own: the 7 s it takes (most of
    them importing torch) run beside the module's other tests, on one torch thread in
    this process, instead of after them. What a process holds is its own either way."""
    proc = subprocess.Popen([sys.executable, "-c", _MEASURE, str(smollm2_dir), *MODES],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    @functools.cache
    def measured() -> MemoryByMode:
        out, err = proc.communicate(timeout=MEASURE_S)
        assert proc.returncode == 0, f"measuring failed: {err}"
        by_mode: MemoryByMode = json.loads(out.strip().splitlines()[-1])
        return by_mode

    try:
        yield measured
    finally:
        proc.kill()
        proc.communicate()


@pytest.mark.slow
def test_middle_stage_process_memory_grows_by_its_layers_only(
        smollm2_dir: Path, middle_stage_memory: Callable[[], MemoryByMode]) -> None:
    measured = middle_stage_memory()["fp32"]
    full_model = _checkpoint_bytes(smollm2_dir, ("",))
    # 10 of 30 layers are ~26 % of SmolLM2's bytes (the embedding is the rest).
    assert measured["grown"] < measured["params"] * 1.1 + 32 * 2**20
    assert measured["grown"] < full_model * 0.4


@pytest.mark.slow
def test_int8_stage_resident_memory_is_at_most_035_of_fp32(
        middle_stage_memory: Callable[[], MemoryByMode]) -> None:
    fp32, int8, bf16 = (middle_stage_memory()[mode] for mode in MODES)
    # int8 codes are a quarter of fp32, plus one bf16 scale per 576-wide row and fp32 norms.
    assert int8["params"] < 0.26 * fp32["params"]
    assert int8["grown"] <= 0.35 * fp32["grown"], (int8, fp32)
    assert bf16["grown"] <= 0.6 * fp32["grown"], (bf16, fp32)


@pytest.mark.slow
def test_rotary_buffers_match_a_fully_loaded_model(smollm2_dir: Path) -> None:
    stage = TorchEngine(smollm2_dir, 20, 30)
    full = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    assert torch.equal(stage.rotary_emb.inv_freq, full.model.rotary_emb.inv_freq)
    assert stage.rotary_emb.attention_scaling == full.model.rotary_emb.attention_scaling


def test_missing_weights_say_how_to_fix(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8,
        "intermediate_size": 16, "num_attention_heads": 2, "vocab_size": 10}))
    with pytest.raises(CheckpointError, match="import-gguf"):
        TorchEngine(tmp_path, 0, 1)
