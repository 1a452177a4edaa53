"""GGUF files for the llamacpp engine's tests, made here from what the tests already have.

`requantize` rewrites a GGUF (the tiny Llama's F16, SmolLM2's Q4_1) in another block type with
gguf-py's own quantizers (the reference implementations of llama.cpp's), so the
engine is tested on several types without llama.cpp's build tools.
`tiny_ggufs` writes tiny random checkpoints (tiny_models.py) as GGUF in the test process,
the very files llama.cpp's own converter writes (hf_to_gguf.py).
`tiny_random_gguf` writes a tiny model of a real model's family with
tools/random_gguf.py (random quantized blocks, no checkpoint at all): the
families the tool writes at real scale (deepseek2, qwen3moe), in seconds.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import gguf
import numpy as np
import pytest
from dev_tools import dev_tool
from hf_to_gguf import write_gguf
from tiny_models import build_tiny

from edgebus.core.paths import GGUF_FILE
from plant_config import Plant

# The pre-tokenizer of SmolLM2's tokenizer, which the tiny models borrow: llama.cpp's
# converter knows it by the hash of the Hub's copy, which an import through transformers
# changes, and is told it.
SMOLLM_PRE_TOKENIZER = "smollm"


@dataclasses.dataclass(frozen=True)
class TinyGguf:
    """A tiny random `family` checkpoint to write in `dest` with its GGUF (F16) beside it as
    model.gguf; `seed` and `initializer_range` as build_tiny takes them."""

    family: str
    dest: Path
    seed: int = 0
    initializer_range: float | None = None


def tiny_ggufs(wanted: Sequence[TinyGguf], tokenizer_dir: Path) -> None:
    """Each of `wanted` built and written as GGUF in this process, as llama.cpp's converter
    writes it (hf_to_gguf.py): no sdist to download, no child importing torch again."""
    for tiny in wanted:
        build_tiny(tiny.family, tiny.dest, tokenizer_dir, seed=tiny.seed,
                   initializer_range=tiny.initializer_range)
        write_gguf(tiny.dest, tiny.dest / GGUF_FILE, SMOLLM_PRE_TOKENIZER)


def requantize(source: Path, dest: Path, qtype: gguf.GGMLQuantizationType,
               reader: gguf.GGUFReader | None = None) -> Path:
    """The GGUF file `dest`: the GGUF file `source` with every quantized or F16 matrix as
    `qtype`, the F32 tensors (norms) as they are, and the same metadata (vocabulary, config).
    An F16 source (a tiny model from `tiny_gguf`) so becomes a file of any block type.

    `reader`: `source` as gguf-py read it, for a caller writing several types of one file
    (reading a 49k-token vocabulary's fields takes gguf-py seconds)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    reader = reader or gguf.GGUFReader(str(source))
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    writer = gguf.GGUFWriter(str(dest), arch=arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY
                             else None)
    for tensor in reader.tensors:
        data: np.ndarray = tensor.data
        if tensor.tensor_type != gguf.GGMLQuantizationType.F32:
            values = gguf.quants.dequantize(data, tensor.tensor_type)
            data = gguf.quants.quantize(values, qtype)
            writer.add_tensor(tensor.name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


@dataclasses.dataclass(frozen=True)
class Tensor:
    """A tensor as gguf-py reads it, without the file kept mapped: a test of what a stage
    maps would see gguf-py's map of the source beside it."""

    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_bytes: int
    data_offset: int

    def read(self, path: Path) -> bytes:
        """Its bytes in `path`, the file it was read from."""
        with path.open("rb") as f:
            f.seek(self.data_offset)
            return f.read(self.n_bytes)

    def values(self, path: Path) -> np.ndarray:
        """Its values in `path` as gguf-py dequantizes them, outermost axis first (gguf-py's
        own `ReaderTensor.data` order)."""
        rows = np.frombuffer(self.read(path), dtype=np.uint8).reshape(
            *reversed(self.shape[1:]), -1)
        return gguf.quants.dequantize(rows, self.tensor_type)


# The files whose tensors the suite reads more than once: the shipped SmolLM2 GGUF (for the
# cut tests and the import's values), a tiny model's.
_READ_FILES = 4


def tensors(path: Path) -> dict[str, Tensor]:
    """gguf-py's reading of the tensors of the GGUF `path`, by name, once a run while the file
    is unchanged: gguf-py parses a vocabulary entry by entry, about 3 s of CPU for SmolLM2's
    49,152 tokens and their merges (2-core AMD EPYC)."""
    stat = path.stat()
    return _tensors(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=_READ_FILES)
def _tensors(path: str, _size: int, _mtime_ns: int) -> dict[str, Tensor]:
    reader = gguf.GGUFReader(path)
    return {t.name: Tensor(t.name, t.tensor_type, tuple(int(d) for d in t.shape),
                           int(t.n_bytes), int(t.data_offset)) for t in reader.tensors}


def random_gguf_tool() -> ModuleType:
    """tools/random_gguf.py, which lives outside the installed packages."""
    return dev_tool("tools/random_gguf.py")


# Each family of random_gguf's SHAPES made tiny; what each keeps of its model:
# - llama: grouped KV heads, and a vocabulary grown past SmolLM2's 49152 tokens;
# - deepseek2: DeepSeek-V2-Lite's 27 layers (llama.cpp knows a "lite" model, one without
#   q_lora_rank, by that count), MLA with a full-rank query, the leading dense layer, shared
#   experts, and 32-wide rows that Q4_K's 256-element blocks do not divide (the fallback);
# - qwen3moe: head_dim apart from hidden / heads, and the query and key norms.
# The other vocabularies are cut small: each llama.cpp load and cut reads every token.
TINY_SHAPES = {
    "llama": ("llama-3-8b", dict(hidden=256, layers=2, heads=4, kv_heads=2, intermediate=512,
                                 vocab=49408)),
    "deepseek2": ("deepseek-v2-lite", dict(hidden=256, heads=4, intermediate=512, vocab=2000,
                                           experts=4, experts_used=2, moe_intermediate=64,
                                           kv_lora_rank=64, qk_nope=32, qk_rope=32, v_head=32)),
    "qwen3moe": ("qwen3-30b-a3b", dict(hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64,
                                       vocab=2000, experts=8, experts_used=2,
                                       moe_intermediate=256)),
}


def tiny_random_gguf(family: str, file_type: str, dest: Path) -> Path:
    """A tiny model of `family` (TINY_SHAPES) written by tools/random_gguf.py as `dest`."""
    tool = random_gguf_tool()
    real, changes = TINY_SHAPES[family]
    written: Path = tool.write(dataclasses.replace(tool.SHAPES[real], **changes), file_type, dest)
    return written


# A llama.cpp node's KV in tests that start a tiny model's agents as processes: llama.cpp
# reserves and zeroes a node's whole share at start, and the plant default (512 MiB: 256
# requests of 5,120 positions on 3 tiny layers) cost 0.35-0.6 s of system CPU at every stage's
# start and 0.2 s at its exit, about half of a tiny stage agent's start (2-core EPYC). 32 MiB
# hold 17 requests on 3 tiny layers, 8 on all 6: what those tests keep in flight at most.
PROCESS_KV_BUDGET_MB = 32


def with_kv_budget(plant: Plant, kv_budget_mb: int = PROCESS_KV_BUDGET_MB) -> Plant:
    """`plant` with every stage node's kv_budget_mb set to `kv_budget_mb`."""
    return plant.model_copy(update={"stages": [
        stage.model_copy(update={"kv_budget_mb": kv_budget_mb}) for stage in plant.stages]})


# Decode and batch steps of a quick llama.cpp profile: one of each still times every part;
# the profile's 8 of each were half of a SmolLM2 profile's 3 CPU-seconds.
QUICK_PROFILE_STEPS = 1


def quick_llama_cpp_profile(patch: pytest.MonkeyPatch) -> None:
    """llama.cpp profiles (node_agent/gguf_profile.py) in one timed round, no warm-up and
    QUICK_PROFILE_STEPS, for tests of where a profile comes from and goes and of the sizes
    it gives, not of steady times (which the bench's are)."""
    from node_agent import gguf_profile

    patch.setattr(gguf_profile, "WARMUP_ROUNDS", 0)
    patch.setattr(gguf_profile, "DECODE_STEPS", QUICK_PROFILE_STEPS)
    patch.setattr(gguf_profile.measure, "__kwdefaults__", {"rounds": 1})
