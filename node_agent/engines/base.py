"""What every stage engine offers the stage agent, and the parts they share.

An engine runs one contiguous slice of the model: token ids or hidden states
in, hidden states (or the last stage's logits) out, with each request's keys
and values in a cache the engine makes (`new_cache`) and the agent hands back
to every step: a `KVCache` of torch tensors, or a sequence of a llama.cpp
context (llamacpp/engine.py), which holds the keys and values itself. `step`
is the one entry point that matters: continuous batching calls it with decode rows of requests at
different positions and a prompt chunk together (node_agent/ragged.py). The
stage agent calls it as `run`, on the numpy arrays frames carry: the llamacpp
engine runs that without torch, so a llama.cpp box need not install torch
(docs/deploy.md), and this module imports torch only where an engine uses it.

Shapes: T_i = positions of request i in this call, H = hidden size,
V = vocabulary size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from edgebus.core.errors import CheckpointError, EngineError
from node_agent.model_config import kv_bytes_per_token
from plant_config.stage_memory import ContextShape as ContextShape  # the engines size by it

if TYPE_CHECKING:
    # Only the torch and onnxruntime engines use torch: a llama.cpp box has none.
    import torch
    from torch import nn

    from node_agent.kv_cache import KVCache


class Cache(Protocol):
    """What the stage agent reads of a request's cache, whichever engine made it."""

    epoch: int  # the route epoch it belongs to
    touched: float  # time.monotonic() of its last forward pass
    nbytes: int  # bytes of the positions it holds

    def get_seq_length(self) -> int: ...


# oneDNN runs a product of 1 or 2 rows through a slower kernel than 3 to 6
# rows. Measured on an EPYC (AVX-512), one thread, SmolLM2's 210 decoder
# weights: 1 row 30 ms, 2 rows 36 ms, 4 rows 26 ms. Fewer rows are padded with
# zeros to this many; a whole-model decode step of 1 request went from 50 to
# 46 ms, of 2 requests from 61 to 48 ms. Other CPUs differ, so a stage measures
# it at first load (node_agent/engines/tuning.py): this is the default.
MIN_ROWS = 4


class CacheFull(EngineError):
    """The engine holds as many requests as it can; another must wait for one to end."""


@dataclass(frozen=True)
class Kernels:
    """The kernel options an engine runs with, which a stage may measure at first load
    (node_agent/engines/tuning.py). Options that do not change what is computed, only
    how fast: a stage's replicas on different boxes still answer alike."""

    threads: int
    packed: bool = True   # torch fp32: weights packed for oneDNN (node_agent/packed.py)
    min_rows: int = MIN_ROWS  # torch fp32, packed: fewer rows padded to this

    def describe(self) -> dict[str, str | int | float]:
        return {"threads": self.threads, "packed": int(self.packed), "min_rows": self.min_rows}


@dataclass(frozen=True)
class StageSlice:
    """Which part of the model a stage owns: layers [first, end)."""

    first: int
    end: int
    num_layers: int

    @property
    def has_embedding(self) -> bool:
        return self.first == 0

    @property
    def has_head(self) -> bool:
        return self.end == self.num_layers


class StageEngine(ABC):
    """One slice of a decoder-only transformer, ready to run forward passes."""

    config: Any  # transformers' PretrainedConfig, or model_config.load_config's reading
    slice: StageSlice
    name: str  # the plant file's `engine:` value that selects this class
    # How its kernel options were chosen: "measured" or "cached" (tuning.py), "fixed"
    # (one candidate), or "default".
    tuned = "default"
    # Positions of one request that one call computes bitwise as one-position calls do,
    # measured at load by an engine whose kernels allow it (llamacpp/engine.py). At 1 every
    # position of a decode frame of several (a token and its drafts) is a call of its own.
    exact_rows = 1
    # What k positions in one call cost against one position's, for k up to exact_rows.
    row_costs: tuple[float, ...] = (1.0,)

    @property
    @abstractmethod
    def param_bytes(self) -> int:
        """Bytes of weights this stage holds, in its weight mode."""

    @abstractmethod
    def step(self, xs: list[torch.Tensor], caches: list[Any], starts: list[int],
             logits: list[bool] | None = None) -> list[torch.Tensor | None]:
        """New positions of several requests as one forward pass.

        xs[i]: [1, T_i] ids (first stage) or [1, T_i, H]: request i's positions
        [starts[i], starts[i] + T_i) with history caches[i] (made by this engine's
        `new_cache`; typed Any so each engine names its own cache class). Returns per
        request [1, T_i, H] hidden states, or on the last stage [1, V] fp32 logits of
        its last position (None where logits[i] is False: a prompt chunk
        before the last, of which nothing is sampled).
        """

    def run(self, xs: list[np.ndarray], caches: list[Any], starts: list[int],
            logits: list[bool] | None = None) -> list[np.ndarray | None]:
        """`step` on numpy arrays, as frames carry them: the stage agent's entry point.

        xs[i]: [1, T_i] int64 ids or [1, T_i, H] float16/float32 hidden states. Returns
        float32 arrays. Here through `step` and torch; the llamacpp engine runs it in
        numpy, so that a stage of it never imports torch.
        """
        import torch

        outs = self.step([torch.from_numpy(x) for x in xs], caches, starts, logits)
        # bfloat16 widens to float32 exactly; numpy has no bfloat16.
        return [None if out is None else out.to(torch.float32).numpy() for out in outs]

    def verify(self, x: np.ndarray, cache: Any, start: int) -> np.ndarray:
        """Positions [start, start + T) of one request, a token and the drafts behind it, each
        computed bitwise as a one-position decode step computes it: [1, T, H] hidden states, or
        on the last stage [T, V] logits, a row per position. Here T one-position calls; an
        engine computes up to `exact_rows` of them in one."""
        outs = [self.run([x[:, i:i + 1]], [cache], [start + i])[0] for i in range(x.shape[1])]
        return np.concatenate([out for out in outs if out is not None],
                              axis=0 if self.slice.has_head else 1)

    def new_cache(self, epoch: int) -> Cache:
        """An empty cache for a request's route `epoch`, or CacheFull."""
        from node_agent.kv_cache import KVCache

        return KVCache(epoch)

    def truncate(self, cache: Any, positions: int) -> None:
        """Keep the first `positions` of a request's cache: the drafts after them were
        rejected (node_agent/speculation.py)."""
        from node_agent.kv_cache import KVCache

        if not isinstance(cache, KVCache):
            raise EngineError(f"the {self.name} engine cannot roll back a {type(cache).__name__}")
        cache.truncate(positions)

    def free_cache(self, cache: Cache) -> None:  # noqa: B027 (a KVCache needs nothing)
        """The request of `cache` is over: give back what the engine holds for it. A
        KVCache is plain memory, freed when the agent lets go of it."""

    def close(self) -> None:  # noqa: B027 (torch's tensors are freed by the garbage collector)
        """Free what the engine holds outside Python's heap (llama.cpp's model and context)."""

    def kv_bytes_per_token(self) -> int:
        """Bytes one position adds to a request's cache on this stage."""
        return kv_bytes_per_token(self.config, (self.slice.first, self.slice.end))

    @abstractmethod
    def describe(self) -> dict[str, str | int | float]:
        """What this engine runs, for the agent's status: engine, weights, device and
        kernel options, and how they were chosen (`tuned`)."""

    def prefill(self, x: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """T >= 1 new positions [start, start+T) of one request: [1, T, H] hidden states,
        or on the last stage [1, V] logits of the last position."""
        out = self.step([x], [cache], [start])[0]
        assert out is not None  # every row asked for logits
        return out

    def decode(self, x: torch.Tensor, caches: list[KVCache], positions: list[int]
               ) -> torch.Tensor:
        """One new position for each of B requests: x [B, 1] ids or [B, 1, H] -> [B, 1, H]
        hidden states, or [B, V] logits."""
        import torch

        rows = [x[i:i + 1] for i in range(x.shape[0])]
        return torch.cat([out for out in self.step(rows, caches, positions) if out is not None])


def module_path(root: nn.Module, target: nn.Module) -> str:
    """Where `target` sits in `root` ("model.layers"): the prefix of its checkpoint names."""
    for name, module in root.named_modules():
        if module is target:
            return str(name)
    raise CheckpointError(f"{type(target).__name__} is not part of {type(root).__name__}")
