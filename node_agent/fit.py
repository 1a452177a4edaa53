"""Whether this box can hold its llama.cpp node's share, checked before anything loads.

A `weights: gguf` node counts what it is about to hold as the planner does
(plant_config/stage_memory.py: its stage GGUF, the KV llama.cpp reserves at
the plant's limits, llama.cpp's buffers, the agent process, headroom) and
refuses to start, saying why, where its KV budget holds no request of the
plant's longest length, or where its box (its control group's limit, else the
machine's memory) has not that much free beside what the box's other
processes hold. Without the check, llama.cpp would reserve the KV, the stage
would map its weights, and the kernel's OOM killer would end it mid-load or
mid-request ("exited with code -9"), or evict its weights under load.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

from edgebus.errors import EdgebusError
from edgebus.memory_limits import available_bytes, memory_limit, rss_bytes
from node_agent.costs import Measured, costs_from
from node_agent.engines.llamacpp.engine import model_gguf
from node_agent.gguf_profile import llamacpp_shape, weight_sizes
from plant_config.layout import show
from plant_config.planner import Box, ModelCosts
from plant_config.schema import Plant, resolve_engine
from plant_config.stage_memory import IDLE_AGENT_BYTES, MIB, context_shape

log = logging.getLogger(__name__)


def check_fit(plant: Plant, node_id: str) -> None:
    """Raise EdgebusError if node `node_id` (a llama.cpp node) cannot hold its share here."""
    spec = plant.node(node_id)
    if resolve_engine(spec.engine, spec.weights) != "llamacpp":
        return  # torch and onnxruntime grow their KV as requests come; sized by the planner
    costs = memory_costs(model_gguf(plant.model))
    shape = context_shape(plant, node_id)
    box = Box(node=node_id, memory_bytes=0, speed=1.0, weights="gguf",
              kv_bytes=shape.kv_budget_bytes, positions=shape.positions,
              batch_positions=shape.batch_positions)
    memory = box.memory(costs, spec.layers)
    if memory.unheld_share:
        raise EdgebusError(
            f"{node_id}: kv_budget_mb {spec.kv_budget_mb} holds no request of "
            f"{shape.positions} positions on layers {show(spec.layers)} "
            f"({_mib(memory.unheld_share)} MiB each, reserved up front by llama.cpp): raise "
            "kv_budget_mb, or lower coordinator max_prompt_tokens or max_tokens_limit")
    limit = memory_limit()
    own = rss_bytes(os.getpid()) or 0  # this process so far, which the need counts already
    free = min(limit.limit_bytes - limit.others_bytes(own), available_bytes() + own)
    if memory.total > free:
        raise EdgebusError(
            f"{node_id} cannot hold layers {show(spec.layers)} on this box: it needs "
            f"{_mib(memory.total)} MiB ({memory.describe()}) and the box has {_mib(free)} MiB "
            f"for it ({limit.source}, less what its other processes hold) — lower "
            "kv_budget_mb or the request limits, give the node fewer layers (`edgebus "
            "plan`), cut a smaller GGUF type, or give the box more memory")
    log.info("%s: this box has %d MiB for the stage, which needs %d MiB (%s)", node_id,
             _mib(free), _mib(memory.total), memory.describe())


def memory_costs(gguf: Path) -> ModelCosts:
    """What the planner knows of a GGUF's memory, without a profile: its part bytes and
    shape (times 0: nothing here is timed)."""
    sizes = weight_sizes(gguf)
    zero = (0.0, 0.0, 0.0)
    measured = Measured(layers=[zero] * len(sizes[0]), embedding=zero, head=zero,
                        message=None, baseline_bytes=IDLE_AGENT_BYTES, key={},
                        measured_at="")
    return replace(costs_from(measured, sizes), llamacpp=llamacpp_shape(gguf))


def _mib(n_bytes: int) -> int:
    return -(-n_bytes // MIB)
