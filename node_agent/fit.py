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

from edgebus.core.errors import EdgebusError
from edgebus.core.memory_limits import available_bytes, memory_limit, rss_bytes
from node_agent.gguf_memory import llamacpp_shape, weight_sizes
from node_agent.measured import Measured, costs_from
from node_agent.model_config import model_gguf
from plant_config.layout import show
from plant_config.planner import Box, Memory, ModelCosts
from plant_config.schema import Plant, resolve_engine
from plant_config.stage_memory import (
    COORDINATOR_BYTES,
    EMBEDDED_BROKER_BYTES,
    HEADROOM_BYTES,
    IDLE_AGENT_BYTES,
    MIB,
    context_shape,
)

log = logging.getLogger(__name__)


def check_fit(plant: Plant, node_id: str) -> None:
    """Raise EdgebusError if node `node_id` (a llama.cpp node) cannot hold its share here."""
    spec = plant.node(node_id)
    if resolve_engine(spec.engine, spec.weights) != "llamacpp":
        return  # torch and onnxruntime grow their KV as requests come; sized by the planner
    memory = node_memory(plant, node_id, memory_costs(model_gguf(plant.model)))
    shape = context_shape(plant, node_id)
    if memory.unheld_share:
        raise EdgebusError(
            f"{node_id}: kv_budget_mb {spec.kv_budget_mb} holds no request of "
            f"{shape.positions} positions on layers {show(spec.layers)} "
            f"({_mib(memory.unheld_share)} MiB each, reserved up front by llama.cpp): raise "
            "kv_budget_mb, or lower coordinator max_prompt_tokens or max_tokens_limit")
    # This process so far, which the need counts already (the agent process).
    free, source = _free_here(rss_bytes(os.getpid()) or 0)
    if memory.total > free:
        raise EdgebusError(
            f"{node_id} cannot hold layers {show(spec.layers)} on this box: it needs "
            f"{_mib(memory.total)} MiB ({memory.describe()}) and the box has {_mib(free)} MiB "
            f"for it ({source}) — lower "
            "kv_budget_mb or the request limits, give the node fewer layers (`edgebus "
            "plan`), cut a smaller GGUF type, or give the box more memory")
    log.info("%s: this box has %d MiB for the stage, which needs %d MiB (%s)", node_id,
             _mib(free), _mib(memory.total), memory.describe())


def check_plant_fits_here(plant: Plant) -> None:
    """Raise EdgebusError if this machine (its control group's limit, else its available
    memory) cannot hold every agent of a llama.cpp plant at once, as `edgebus up` runs
    them: each stage's share, the broker and the coordinator, headroom once."""
    if any(resolve_engine(s.engine, s.weights) != "llamacpp" for s in plant.stages):
        return
    costs = memory_costs(model_gguf(plant.model))
    needs = {spec.node: node_memory(plant, spec.node, costs) for spec in plant.stages}
    for node_id, memory in needs.items():
        if memory.unheld_share:
            check_fit(plant, node_id)  # says which budget holds no request, and what to do
    shape = costs.llamacpp
    assert shape is not None
    services = ((EMBEDDED_BROKER_BYTES if plant.broker.embedded else 0) + COORDINATOR_BYTES
                + shape.vocabulary_bytes())
    total = (sum(memory.total - memory.headroom for memory in needs.values()) + services
             + HEADROOM_BYTES)
    free, source = _free_here(0)
    if total > free:
        lines = [f"  {node}: {_mib(memory.total - memory.headroom)} MiB "
                 f"({replace(memory, headroom=0).describe()})" for node, memory in needs.items()]
        raise EdgebusError(
            f"this machine cannot hold the plant: its agents need {_mib(total)} MiB and it has "
            f"{_mib(free)} MiB free ({source}):\n" + "\n".join(lines)
            + f"\n  broker and coordinator: {_mib(services)} MiB, headroom "
            f"{_mib(HEADROOM_BYTES)} MiB\n— lower kv_budget_mb or the request limits "
            "(coordinator max_prompt_tokens, max_tokens_limit), cut a smaller GGUF type, or "
            "run the stages on boxes of their own")


def _free_here(own: int) -> tuple[int, str]:
    """What this box can give a process holding `own` bytes so far, and what says so: its
    control group's limit less what the group's other processes hold, or the machine's
    available memory, whichever is less."""
    limit = memory_limit()
    in_group = limit.limit_bytes - limit.others_bytes(own)
    available = available_bytes() + own
    if limit.group is not None and in_group <= available:
        return in_group, f"{limit.source}, less what its other processes hold"
    return available, f"the machine's available memory, MemAvailable, of {limit.source}"


def node_memory(plant: Plant, node_id: str, costs: ModelCosts) -> Memory:
    """What llama.cpp node `node_id` holds, as the planner counts it (nothing beside it)."""
    shape = context_shape(plant, node_id)
    box = Box(node=node_id, memory_bytes=0, speed=1.0, weights="gguf",
              kv_bytes=shape.kv_budget_bytes, positions=shape.positions,
              batch_positions=shape.batch_positions)
    return box.memory(costs, plant.node(node_id).layers)


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
