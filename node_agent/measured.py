"""What a profile measures, as cached, and the planner's cost model made of it.

Shared by both profiles (node_agent/profile.py in torch, node_agent/gguf_profile.py
in llama.cpp) and by the fit check (node_agent/fit.py); which profile a model
gets is node_agent/costs.py's choice.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeAlias

from edgebus.core.errors import EdgebusError
from plant_config.planner import MessageCost, ModelCosts, PartBytes, PartCost

# Weight bytes per layer, of the embedding and of the head in each mode; whether tied.
Sizes: TypeAlias = tuple[tuple[PartBytes, ...], PartBytes, PartBytes, bool]


@dataclass(frozen=True)
class Measured:
    """What a profile measures, as cached: milliseconds per part and the process baseline."""

    # (prefill ms, decode ms, BATCH_ROWS-row decode ms) per decoder layer
    layers: list[tuple[float, float, float]]
    embedding: tuple[float, float, float]
    head: tuple[float, float, float]    # final norm + LM head
    # CPU ms per decode message: (both agents, Mosquitto); None without Mosquitto
    message: tuple[float, float] | None
    baseline_bytes: int
    key: dict[str, Any]                 # where and on what it was measured
    measured_at: str


def costs_from(measured: Measured, sizes: Sizes, *, packed_fp32: bool = False) -> ModelCosts:
    """The planner's ModelCosts of a profile's times and the model's weight bytes;
    `packed_fp32`: fp32 heads are packed apart from a tied embedding (node_agent/packed.py)."""
    layer_bytes, embedding_bytes, head_bytes, tied = sizes
    if len(layer_bytes) != len(measured.layers):
        raise EdgebusError(f"the profile has {len(measured.layers)} layers, the model "
                           f"{len(layer_bytes)} — measure again with `edgebus plan --profile`")
    message = None if measured.message is None else MessageCost(*measured.message)
    return ModelCosts(layers=tuple(PartCost(*part) for part in measured.layers),
                      embedding=PartCost(*measured.embedding), head=PartCost(*measured.head),
                      message=message,
                      layer_bytes=layer_bytes, embedding_bytes=embedding_bytes,
                      head_bytes=head_bytes, tied=tied, baseline_bytes=measured.baseline_bytes,
                      packed_fp32=packed_fp32)


def read_cache(path: Path, key: dict[str, Any]) -> Measured | None:
    """The profile cached at `path` if it was measured under `key`."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        message = data["message"]
        measured = Measured(layers=[(a, b, c) for a, b, c in data["layers"]],
                            embedding=tuple(data["embedding"]), head=tuple(data["head"]),
                            message=None if message is None else (message[0], message[1]),
                            baseline_bytes=data["baseline_bytes"], key=data["key"],
                            measured_at=data["measured_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none, unreadable or of an older format: measure again
    return measured if measured.key == key else None


def write_cache(target: Path, measured: Measured) -> None:
    """Cache `measured` at `target`, if its directory can be written."""
    temporary = target.with_name(f".{target.name}.{os.getpid()}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps(asdict(measured), indent=1), encoding="utf-8")
        temporary.replace(target)  # atomic: a concurrent reader sees the old or the new file
    except OSError:
        temporary.unlink(missing_ok=True)  # a read-only directory: plan without a cache
