"""`edgebus model import-gguf --keep-quantized`: GGUF blocks kept as they are, provably lossless.

Three layers of proof:
- `blockwise.from_gguf` turns each kept GGUF type into blocks that dequantize to
  gguf-py's own dequantization bit for bit (random blocks, every field exercised);
- a tiny GGUF with all five kept types (and one that is not kept) imports with
  its matrices stored as blocks that read back, through the checkpoint reader
  a stage uses, as exactly the fp32 values the plain import writes; its blocks run
  in an ONNX Runtime stage, whose MatMulNBits multiply by exactly the GGUF's codes,
  and through two stages over a real broker they answer what the same engine and
  weights answer in one process;
- a tiny GGUF in the shipped SmolLM2 file's block types (Q4_1 matrices, a Q8_0
  embedding the head is tied to), imported as the demo model is
  (`ensure_demo_model(keep_quantized=True)`, made once), gives the torch engine
  bit-identical logits to its fp32 import. The shipped file's own import is
  test_model_import.py's, SmolLM2's split through onnxruntime test_engines.py's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import onnx
import pytest
import torch
from brokers import BrokerHandle
from onnx import numpy_helper
from pipeline import ask_all, engine_tokens, plant_for, running, stage_model
from test_model_import import HALF_FIELDS, SHIPPED_MATRICES, random_blocks, write_tiny_gguf
from test_pipeline import requests
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_gguf_pytorch_utils import GPT2TensorProcessor, LlamaTensorProcessor

from edgebus import model_import
from edgebus.cli import main
from edgebus.core.errors import ModelImportError
from edgebus.model_import import (
    MARKER_FILE,
    WEIGHTS_FILE,
    ensure_demo_model,
    import_gguf,
    import_summary,
)
from node_agent.blockwise import GGUF_TYPES, BlockQuantized, from_gguf
from node_agent.checkpoint import CheckpointReader, Shard
from node_agent.engines import load_engine
from node_agent.engines.onnx_engine import CACHE_DIR
from node_agent.kv_cache import KVCache

# Types gguf-py can also quantize, so real quantized values are checked besides random blocks.
QUANTIZABLE = ("Q4_0", "Q4_1", "Q8_0")
# The tiny model's widths: K-quant rows hold whole super-blocks of 256 weights.
TINY_HIDDEN, TINY_FFN = 256, 512
# Every kept type, twice over two layers, on Q and K (whose rows Llama's import permutes)
# as well as on the others; one Q5_0 matrix, which is dequantized.
TINY_TYPES = {
    "blk.0.attn_q.weight": "Q4_0", "blk.0.attn_k.weight": "Q4_1", "blk.0.attn_v.weight": "Q8_0",
    "blk.0.attn_output.weight": "Q4_K", "blk.0.ffn_gate.weight": "Q6_K",
    "blk.0.ffn_up.weight": "Q4_1", "blk.0.ffn_down.weight": "Q5_0",
    "blk.1.attn_q.weight": "Q4_K", "blk.1.attn_k.weight": "Q6_K", "blk.1.attn_v.weight": "Q4_0",
    "blk.1.attn_output.weight": "Q4_1", "blk.1.ffn_gate.weight": "Q8_0",
    "blk.1.ffn_up.weight": "Q4_K", "blk.1.ffn_down.weight": "Q6_K",
}
TINY_KEPT = {"Q4_0": 2, "Q4_1": 3, "Q4_K": 3, "Q6_K": 3, "Q8_0": 3}  # with the embedding
TINY_DEQUANTIZED = {"F32": 5, "Q5_0": 1}  # 2 norms a layer, the final norm; ffn_down of layer 0
# The kept import must be far smaller than fp32: Q4_1 is 0.78 bytes a weight as kept
# (codes, fp32 scale and minimum, zero point), Q8_0 1.125, fp32 4.
SHIPPED_MAX_SIZE_RATIO = 0.30
# The tiny kept model through MatMulNBits against its dequantized weights in torch: 0.7 %
# of the largest logit measured, 9.5 % with the minimums left out.
ORT_TOLERANCE = 0.03
# Token ids of the tiny GGUFs' vocabulary (3 specials, 256 bytes, one merge).
PROMPT_IDS = torch.tensor([[1, 72, 101, 108, 108, 111, 259, 2]])


def bits(a: np.ndarray) -> np.ndarray:
    """float32 values as their bit patterns: equality that tells -0.0 from 0.0 and NaN."""
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


# --- blockwise.from_gguf against gguf-py --------------------------------------

def _awkward_scales(raw: np.ndarray, qtype: str, block_bytes: int) -> None:
    """Set some blocks' fp16 fields to 0, -0, a subnormal and a large value, in place."""
    blocks = raw.reshape(raw.shape[0], -1, block_bytes)
    specials = np.array([0.0, -0.0, 6e-8, -6e-8, 60000.0, -1.5], np.float16)
    specials = specials[:blocks.shape[1]]
    for offset in HALF_FIELDS[qtype]:
        field = blocks[:, :len(specials), offset:offset + 2]
        field[:] = np.broadcast_to(specials.view(np.uint8).reshape(-1, 2), field.shape)


@pytest.mark.parametrize("qtype", GGUF_TYPES)
def test_blocks_dequantize_bit_for_bit_as_gguf_py(qtype: str) -> None:
    rng = np.random.default_rng(sum(qtype.encode()))
    ggml_type = gguf.GGMLQuantizationType[qtype]
    _, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
    rows, cols = 24, 8 * 256
    samples = [random_blocks(rng, qtype, rows, cols, scale=scale) for scale in (1e-3, 1.0)]
    awkward = random_blocks(rng, qtype, rows, cols)
    _awkward_scales(awkward, qtype, block_bytes)
    samples.append(awkward)
    if qtype in QUANTIZABLE:
        samples.append(gguf.quants.quantize(
            rng.standard_normal((rows, cols)).astype(np.float32), ggml_type))
    for raw in samples:
        expected = gguf.quants.dequantize(raw, ggml_type)
        blocks = from_gguf(raw, qtype, rows, cols)
        assert blocks.shape == (rows, cols)
        assert blocks.source == qtype
        assert np.array_equal(bits(blocks.dequantize()), bits(expected))
        picked = np.array([5, 0, 23, 5])
        assert np.array_equal(bits(blocks.dequantize(picked)), bits(expected[picked]))
        order = rng.permutation(rows)
        assert np.array_equal(bits(blocks.permute_rows(order).dequantize()),
                              bits(expected[order]))


def test_blocks_take_whole_blocks_of_known_types() -> None:
    raw = np.zeros((2, 144), np.uint8)
    with pytest.raises(ValueError, match="do not split into whole blocks"):
        from_gguf(raw, "Q4_K", 2, 128)
    with pytest.raises(ValueError, match="Q5_K is not one of the block formats kept"):
        from_gguf(np.zeros((2, 176), np.uint8), "Q5_K", 2, 256)


def test_row_order_is_what_transformers_does_to_the_rows() -> None:
    """Llama's processor permutes Q rows in heads; the order found from an index array is
    exactly the permutation it applies to real weights."""
    config = {"num_attention_heads": 4, "num_key_value_heads": 2}
    processor = LlamaTensorProcessor(config=config)  # type: ignore[no-untyped-call]
    names = {"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight"}
    found = model_import._row_order(processor, "llama", config, names,
                                    "blk.0.attn_q.weight", "Q4_0", 16)
    assert found is not None
    name, order = found
    assert name == "model.layers.0.self_attn.q_proj.weight"
    weights = np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32)
    permuted = processor.process(  # type: ignore[no-untyped-call]
        weights=weights, name="blk.0.attn_q.weight").weights
    assert not np.array_equal(order, np.arange(16))
    assert np.array_equal(weights[order], permuted)


def test_a_matrix_transformers_transposes_cannot_be_kept() -> None:
    names = {"blk.0.ffn_down.weight": "transformer.h.0.mlp.c_proj.weight"}
    with pytest.raises(ModelImportError, match=r"blk\.0\.ffn_down\.weight \(Q4_0\).*gpt2.*"
                                               r"beyond reordering its rows.*without --keep"):
        model_import._row_order(GPT2TensorProcessor(), "gpt2", {},  # type: ignore[no-untyped-call]
                                names,
                                "blk.0.ffn_down.weight", "Q4_0", 8)


# --- a tiny GGUF with every kept type -------------------------------------------

@pytest.fixture(scope="module")
def tiny_mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("mixed") / "mixed.gguf",
                           embedding_type="Q8_0", matrix_types=TINY_TYPES,
                           hidden=TINY_HIDDEN, ffn=TINY_FFN)


@pytest.fixture(scope="module")
def tiny_kept(tiny_mixed: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return import_gguf(tiny_mixed, tmp_path_factory.mktemp("kept") / "model", progress=False,
                       keep_quantized=True)


@pytest.fixture(scope="module")
def tiny_fp32(tiny_mixed: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return import_gguf(tiny_mixed, tmp_path_factory.mktemp("fp32") / "model", progress=False)


def _skeleton(model_dir: Path) -> Any:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            AutoConfig.from_pretrained(model_dir), dtype=torch.float32)


def _stored_types(model_dir: Path) -> dict[str, str]:
    """HF name -> GGUF type of every matrix stored as blocks."""
    with Shard(model_dir / WEIGHTS_FILE) as shard:
        return {name: str(info["source"]) for name, info in shard.blocks.items()}


def test_tiny_kept_import_reads_back_as_the_fp32_import(tiny_mixed: Path, tiny_kept: Path,
                                                        tiny_fp32: Path) -> None:
    stored = _stored_types(tiny_kept)
    assert stored == {
        "model.embed_tokens.weight": "Q8_0",
        **{f"model.layers.{i}.{module}.weight": qtype for i in (0, 1)
           for module, qtype in [
               ("self_attn.q_proj", TINY_TYPES[f"blk.{i}.attn_q.weight"]),
               ("self_attn.k_proj", TINY_TYPES[f"blk.{i}.attn_k.weight"]),
               ("self_attn.v_proj", TINY_TYPES[f"blk.{i}.attn_v.weight"]),
               ("self_attn.o_proj", TINY_TYPES[f"blk.{i}.attn_output.weight"]),
               ("mlp.gate_proj", TINY_TYPES[f"blk.{i}.ffn_gate.weight"]),
               ("mlp.up_proj", TINY_TYPES[f"blk.{i}.ffn_up.weight"]),
               ("mlp.down_proj", TINY_TYPES[f"blk.{i}.ffn_down.weight"])]
           if qtype in GGUF_TYPES}}
    with Shard(tiny_fp32 / WEIGHTS_FILE) as plain:
        names = plain.keys()
        expected = {name: plain.read(name) for name in names}
    assert "lm_head.weight" not in names, "tied head written twice"
    skeleton = _skeleton(tiny_kept)
    with CheckpointReader(tiny_kept, skeleton) as reader:
        got = reader.load(names, torch.float32)
        for name in names:
            assert np.array_equal(bits(got[name].numpy()), bits(expected[name].numpy())), name
            blocks = reader.blocks(name)
            assert (blocks.source if blocks is not None else None) == stored.get(name), name
        # Rows read in part are the same rows.
        q = "model.layers.1.self_attn.q_proj.weight"
        assert torch.equal(reader.rows(q, 64, 128), expected[q][64:128])

    marker = json.loads((tiny_kept / MARKER_FILE).read_text())
    assert marker["keep_quantized"] is True
    assert (marker["kept"], marker["dequantized"]) == (TINY_KEPT, TINY_DEQUANTIZED)
    assert "keep_quantized" not in json.loads((tiny_fp32 / MARKER_FILE).read_text())
    assert (tiny_kept / WEIGHTS_FILE).stat().st_size < 0.4 * (tiny_fp32 / WEIGHTS_FILE).stat(
        ).st_size


# The tiny kept model's ONNX Runtime stages, each holding every kept type: layer 0 (its
# Q5_0 matrix dequantized), and layer 1 with the head, the tied Q8_0 embedding. Their
# graphs come from three templates (entry, exit, head), where the whole model needs four;
# the two stages over a broker (below) are these.
FIRST_STAGE, LAST_STAGE = (0, 1), (1, 2)


def test_every_kept_type_runs_in_an_onnxruntime_stage(tiny_kept: Path) -> None:
    """Q4_K's minimum, Q6_K's 16-weight blocks with zero points, and the rest go into
    MatMulNBits as stored; what it computes is the dequantized weights' product (the
    torch engine's, in fp32), up to the int8 rounding of activations it makes at
    onnx_weights.INT8_ACCURACY_LEVEL where the CPU has VNNI."""
    ids = torch.tensor([[1, 70, 71, 72, 73, 74]])
    reference = load_engine(tiny_kept, *FIRST_STAGE, engine="torch", weights="fp32")
    kept = stage_model(tiny_kept, *FIRST_STAGE, "int4", "onnxruntime")
    want = reference.step([ids], [KVCache()], [0])[0]
    got = kept.step([ids], [KVCache()], [0])[0]
    assert want is not None and got is not None
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() < ORT_TOLERANCE * want.abs().max()
    # The kept stage holds codes, not fp32: well under half the fp32 stage's bytes.
    assert kept.param_bytes < 0.5 * reference.param_bytes


def test_a_4bit_stage_multiplies_by_exactly_the_kept_codes(tiny_kept: Path) -> None:
    """Every MatMulNBits weight in the stage's graphs is kept matrices, one after another
    (the engine stacks products of one input, as Q, K and V, into one where their blocks
    are of one form): the GGUF's codes, scales and minimums as they are."""
    stage_model(tiny_kept, *LAST_STAGE, "int4", "onnxruntime")
    first, end = LAST_STAGE
    layer = [f"model.layers.{first}.{m}.weight" for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    with CheckpointReader(tiny_kept, _skeleton(tiny_kept)) as reader:
        kept = [reader.blocks(name) for name in [*layer, "model.embed_tokens.weight"]]
    by_first_row: dict[bytes, list[BlockQuantized]] = {}
    for blocks in kept:
        assert blocks is not None
        by_first_row.setdefault(blocks.codes[0].tobytes(), []).append(blocks)
    graphs = next((tiny_kept / CACHE_DIR).glob(f"layers-{first}-{end}-int4-*"))
    used = []
    for path in sorted(graphs.glob("*.onnx")):
        graph = onnx.load(str(path)).graph
        initializers = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
        for node in graph.node:
            if node.op_type != "MatMulNBits":
                continue
            codes = initializers[node.input[1]]
            scales = initializers[node.input[2]].reshape(len(codes), -1)
            minimums = initializers.get(node.input[1].replace(".codes", ".minimums"))
            row = 0
            while row < len(codes):
                found = _kept_at(by_first_row, codes, row)
                assert found is not None, f"{path.name}: {node.input[1]} row {row} is not kept"
                end_row = row + found.shape[0]
                assert np.array_equal(scales[row:end_row], found.scales)
                if found.minimums is None:
                    assert minimums is None
                else:
                    assert minimums is not None
                    assert np.array_equal(minimums[:, row:end_row], found.minimums.T)
                used.append(found.source)
                row = end_row
    # Layer 1's 7 matrices, and the tied LM head as the Q8_0 embedding.
    assert sorted(used) == sorted([TINY_TYPES[f"blk.{first}.{m}.weight"] for m in (
        "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")]
        + ["Q8_0"])


def _kept_at(by_first_row: dict[bytes, list[BlockQuantized]], codes: np.ndarray,
             row: int) -> BlockQuantized | None:
    """The kept matrix whose codes are `codes` from `row` on, if any."""
    for blocks in by_first_row.get(codes[row].tobytes(), []):
        if np.array_equal(codes[row:row + blocks.shape[0]], blocks.codes):
            return blocks
    return None


def test_cli_reports_what_was_kept_and_what_was_dequantized(
        tiny_mixed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["model", "import-gguf", "--keep-quantized", str(tiny_mixed), str(tmp_path / "m")])
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [
        f"imported into {tmp_path / 'm'}",
        "kept as GGUF blocks: 2 Q4_0, 3 Q4_1, 3 Q4_K, 3 Q6_K, 3 Q8_0; "
        "dequantized to fp32: 5 F32, 1 Q5_0"]
    assert "Importing mixed.gguf" in captured.err
    assert "6/6" in captured.err


def test_blocks_in_the_wrong_row_order_fail_the_import(
        tiny_mixed: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bit-for-bit check is what stands between a mapping mistake and a wrong model:
    Q rows kept in GGUF order (not un-permuted as transformers does) must fail by name."""
    row_order: Callable[..., Any] = model_import._row_order

    def unpermuted(*args: Any) -> Any:
        found = row_order(*args)
        return None if found is None else (found[0], np.arange(len(found[1])))

    monkeypatch.setattr(model_import, "_row_order", unpermuted)
    with pytest.raises(ModelImportError, match=r"blk\.0\.attn_q\.weight \(Q4_0, model\.layers\.0"
                                               r"\.self_attn\.q_proj\.weight\): its blocks "
                                               r"dequantize to \d+ of 65536 values other"):
        import_gguf(tiny_mixed, tmp_path / "model", progress=False, keep_quantized=True)
    assert list(tmp_path.iterdir()) == []


def test_unsupported_architecture_fails_as_without_the_flag(tmp_path: Path) -> None:
    src = write_tiny_gguf(tmp_path / "rwkv.gguf", arch="rwkv7")
    with pytest.raises(ModelImportError, match=r"is a rwkv7 model.*GGUF only for .*llama"):
        import_gguf(src, tmp_path / "model", progress=False, keep_quantized=True)
    assert [p.name for p in tmp_path.iterdir()] == ["rwkv.gguf"]


# --- a tiny GGUF in the shipped file's block types, imported as the demo model is ---------

@pytest.fixture(scope="module")
def tiny_shipped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama GGUF in the shipped SmolLM2 file's block types: the code path of the
    demo model's kept import (Q4_1 matrices with their minimums, Q and K rows permuted back,
    a Q8_0 embedding the head is tied to) in a second, where SmolLM2's took 36 s."""
    return write_tiny_gguf(tmp_path_factory.mktemp("shipped") / "tiny-q4_1.gguf",
                           embedding_type="Q8_0", matrix_types=SHIPPED_MATRICES)


@pytest.fixture(scope="module")
def demo_kept(tiny_shipped: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ensure_demo_model(keep_quantized=True) with the tiny file as the bundled one."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_import, "bundled_gguf", lambda: tiny_shipped)
        return ensure_demo_model(tmp_path_factory.mktemp("home") / "demo-kept", progress=False,
                                 keep_quantized=True)


@pytest.fixture(scope="module")
def shipped_fp32(tiny_shipped: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return import_gguf(tiny_shipped, tmp_path_factory.mktemp("shipped-fp32") / "model",
                       progress=False)


def test_the_demo_import_with_blocks_kept_is_made_once(
        demo_kept: Path, tiny_shipped: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ensure_demo_model(keep_quantized=True): a kept import, left alone once it is there."""
    assert import_summary(demo_kept).startswith("kept as GGUF blocks: 14 Q4_1, 1 Q8_0")
    written = (demo_kept / WEIGHTS_FILE).stat().st_mtime_ns
    monkeypatch.setattr(model_import, "bundled_gguf", lambda: tiny_shipped)
    monkeypatch.setattr(model_import, "import_gguf", lambda *a, **k: pytest.fail("re-imported"))
    assert ensure_demo_model(demo_kept, progress=False, keep_quantized=True) == demo_kept
    assert (demo_kept / WEIGHTS_FILE).stat().st_mtime_ns == written


def test_kept_demo_gives_the_torch_engine_bit_identical_logits(
        demo_kept: Path, shipped_fp32: Path) -> None:
    kept = load_engine(demo_kept, 0, 2, engine="torch")
    fp32 = load_engine(shipped_fp32, 0, 2, engine="torch", weights="fp32")
    got = kept.step([PROMPT_IDS], [KVCache()], [0])[0]
    want = fp32.step([PROMPT_IDS], [KVCache()], [0])[0]
    assert got is not None and want is not None
    assert torch.equal(got, want)


def test_kept_demo_holds_the_gguf_blocks(demo_kept: Path, shipped_fp32: Path) -> None:
    size, fp32_size = ((d / WEIGHTS_FILE).stat().st_size for d in (demo_kept, shipped_fp32))
    assert size < SHIPPED_MAX_SIZE_RATIO * fp32_size
    assert len(_stored_types(demo_kept)) == 15  # 7 matrices in each of 2 layers, embedding
    decoder = [f"model.layers.{i}.{m}.weight" for i in range(2) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    with CheckpointReader(demo_kept, _skeleton(demo_kept)) as reader:
        for name in decoder:
            blocks = reader.blocks(name)
            assert blocks is not None and (blocks.source, blocks.bits) == ("Q4_1", 4), name
            assert blocks.minimums is not None, name
        embedding = reader.blocks("model.embed_tokens.weight")
        assert embedding is not None and (embedding.source, embedding.bits) == ("Q8_0", 8)
        assert reader.blocks("model.norm.weight") is None


async def test_kept_blocks_through_two_stages_answer_as_in_one_process(
        tiny_kept: Path, amqtt_broker: BrokerHandle) -> None:
    """Every kept type (the tiny GGUF's) through a first and a last onnxruntime stage,
    batched, answers what the same engine and weights answer in one process."""
    # Random weights may say their end token at once: they decode all their tokens instead.
    reqs = [r.model_copy(update={"ignore_eos": True}) for r in requests()]
    plant = plant_for(tiny_kept, amqtt_broker, [FIRST_STAGE, LAST_STAGE], weights="int4",
                      engine="onnxruntime")
    async with running(plant) as stages:
        responses = await ask_all(plant, reqs)
    for request, response in zip(reqs, responses, strict=True):
        assert response.error is None, response.error
        assert response.tokens == engine_tokens(tiny_kept, request, "onnxruntime", "int4"), (
            request.id)
    assert stages[-1].metrics["rows"] > stages[-1].metrics["steps"]
