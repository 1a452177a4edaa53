"""A model's config and end ids, read without transformers: from a model directory's
config.json and generation_config.json, or from a GGUF file's metadata.

A box that runs the llamacpp engine has neither torch nor transformers
(docs/deploy.md); what its stage agents and coordinator need of the model's
config are a few numbers (hidden size, vocabulary, layers, attention shape)
and the ids generation stops on. A model directory holds them in the JSON
files transformers' `save_pretrained` wrote (edgebus/model_import.py,
tests/tiny_models.py); a plant whose `model:` names a GGUF file gets the same
names from the file's metadata (gguf_model.py), so no caller asks which it was.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from edgebus.core.errors import CheckpointError, EngineError
from edgebus.core.paths import GGUF_FILE
from plant_config.schema import GGUF_SUFFIX

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
# Stages of the torch engine keep keys and values in float32, the dtype their activations
# run in.
KV_ITEM_BYTES = 4
# llama.cpp's default KV type is f16. Here, not in the engine, for the coordinator's KV
# bookings and the fit checks, which count by it without loading llama.cpp.
LLAMACPP_KV_ITEM_BYTES = 2


def is_gguf(model: Path) -> bool:
    """Whether the plant's `model:` names a GGUF file rather than a model directory."""
    return Path(model).suffix.lower() == GGUF_SUFFIX


def model_gguf(model: Path) -> Path:
    """The GGUF a plant's `model:` names: the file itself, or an imported directory's."""
    path = model if is_gguf(model) else model / GGUF_FILE
    if not path.is_file():
        raise EngineError(f"no GGUF at {path}, which the llamacpp engine runs: set the plant's "
                          "model: to a .gguf file, or to a directory made by `edgebus model "
                          "import-gguf FILE.gguf DIR`")
    return path


def load_config(model: Path) -> Any:
    """The model's config as an object with config.json's keys as attributes (`hidden_size`,
    `vocab_size`, ...), as transformers' AutoConfig reads them for the families edgebus
    runs: a model directory's config.json, or what a GGUF file's metadata says of them."""
    if is_gguf(model):
        from node_agent import gguf_model  # gguf-py: only a GGUF plant's agents need it

        return gguf_model.read_config(model)
    path = Path(model) / CONFIG_FILE
    try:
        values = json.loads(path.read_text())
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}: import the model with "
                              "`edgebus model import-gguf FILE.gguf DIR`") from exc
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path} is not JSON ({exc}): import the model again") from exc
    if not isinstance(values, dict):
        raise CheckpointError(f"{path} holds no JSON object: import the model again")
    return SimpleNamespace(**values)


def generation_eos(model: Path) -> int | list[int] | None:
    """The ids `generate` stops on, from generation_config.json or a GGUF's metadata (None:
    no such file or key)."""
    if is_gguf(model):
        from node_agent import gguf_model  # gguf-py: only a GGUF plant's agents need it

        return gguf_model.end_ids(model)
    try:
        values = json.loads((Path(model) / GENERATION_CONFIG_FILE).read_text())
    except FileNotFoundError:
        return None
    eos = values.get("eos_token_id") if isinstance(values, dict) else None
    return eos if isinstance(eos, int | list) else None


def kv_bytes_per_token(config: Any, layers: tuple[int, int],
                       item_bytes: int = KV_ITEM_BYTES) -> int:
    """Bytes one position adds to a request's cache on a stage running `layers`, at
    `item_bytes` a number (float32 in the torch engine, f16 in llama.cpp).

    The coordinator reserves this times a request's longest length on every
    node of its route; a node refuses prefills past its budget.
    """
    heads: int = config.num_attention_heads
    width: int
    if getattr(config, "kv_lora_rank", None):  # MLA (DeepSeek-V2/V3) caches latents (kv_cache.py)
        width = config.kv_lora_rank + config.qk_rope_head_dim
    else:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        width = 2 * (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    return (layers[1] - layers[0]) * width * item_bytes
