"""Which profile a model gets, and its cost model for `edgebus plan`, cached.

A model directory is profiled in torch (node_agent/profile.py: its decoder
layers timed one by one in fp32, its weight bytes from its shapes); a GGUF
file in llama.cpp (node_agent/gguf_profile.py: its layers timed in llama.cpp's
own graph, its bytes the file's tensors), and so is a model directory's GGUF
for a plant whose stages all run llama.cpp (`profiled_model`). Both give a
`Measured` (node_agent/measured.py), cached as JSON, and the planner's
`ModelCosts`. This module imports neither torch nor llama.cpp; each profile
imports its own, and is imported only for a model it profiles.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from edgebus.core.paths import GGUF_FILE
from node_agent.measured import Measured, read_cache, write_cache
from node_agent.model_config import is_gguf
from plant_config.planner import ModelCosts


def model_costs(model: Path, *, remeasure: bool = False) -> tuple[ModelCosts, Measured, bool]:
    """The cost model of `model` (a model directory, or a GGUF file), its measurements and
    whether they are new.

    Uses the cached profile unless `remeasure`, or unless it was measured on
    another machine, library version or checkpoint; a fresh one is cached if
    the cache's directory is writable.
    """
    profile = _profile(model)
    key = profile.cache_key(model)
    path = profile.cache_path(model)
    measured = None if remeasure else read_cache(path, key)
    fresh = measured is None
    if measured is None:
        measured = profile.measure(model)
        write_cache(path, measured)
    return profile.costs(measured, model), measured, fresh


def profiled_model(model: Path, engines: Collection[str]) -> Path:
    """What to profile for stages running `engines` on `model`: a model directory's GGUF
    when every stage runs llama.cpp, whose times are llama.cpp's, not torch fp32's (which
    put a llama.cpp plant's predicted stage times 1.7-4x off, docs/benchmarks.md); else
    `model` itself."""
    gguf_file = Path(model) / GGUF_FILE
    if engines and set(engines) == {"llamacpp"} and gguf_file.is_file():
        return gguf_file
    return model


def profile_path(model: Path) -> Path:
    """Where the profile of `model` is cached."""
    return Path(_profile(model).cache_path(model))


def _profile(model: Path) -> Any:
    """The module that profiles `model`: llama.cpp's for a GGUF file, else torch's."""
    if is_gguf(model):
        from node_agent import gguf_profile

        return gguf_profile
    from node_agent import profile

    return profile
