"""What waits at a stage agent, and how much may: the bound on its inbox.

Frames waiting at a stage (messages in its inbox, prompt chunks waiting for a
pass: node_agent/stage.py) take memory before any KV cache does. They are
counted in bytes, their overhead included, against `waiting_limit`: what the
node's KV budget can ever hold of prompts. A message past it is refused, not
queued.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from edgebus.core.frames import Frame, Peek
from plant_config import Plant

# Bytes a waiting frame costs beyond its payload: the Frame, its views and
# the tensor it becomes are Python objects of about this size. Counting it
# bounds a flood of tiny frames as the payload bytes bound one of big frames.
FRAME_OVERHEAD_BYTES = 1024
# Headroom of `waiting_limit` over what the KV budget holds: a replayed or
# ended request's frames may still wait while its successor, reserved against
# the same budget, arrives.
WAITING_HEADROOM = 2


def waiting_limit(plant: Plant, node_id: str, hidden: int, kv_per_token: int,
                  first: bool) -> int:
    """Bytes of frames that may wait at `node_id`: more is refused.

    The coordinator routes to a node only the positions its KV budget can
    hold (each request reserves prompt plus max_tokens), and never more than
    max_in_flight requests of at most max_prompt_tokens + max_tokens_limit
    positions; a position travels as one token id into the first stage, as
    `hidden` float32 values into the others.
    """
    spec, coordinator = plant.node(node_id), plant.coordinator
    kv_positions = spec.kv_budget_mb * 2**20 // max(kv_per_token, 1)
    legit = min(WAITING_HEADROOM * kv_positions, coordinator.max_in_flight
                * (coordinator.max_prompt_tokens + coordinator.max_tokens_limit))
    per_position = 4 if first else hidden * 4
    return legit * (per_position + FRAME_OVERHEAD_BYTES)


@dataclass
class InboxMessage:
    """One message in the inbox: its frames' headers, and the frames once decoded."""

    peeks: list[Peek]
    frames: list[Frame] | asyncio.Future[list[Frame]]
    topic: str


def waiting_bytes(frame: Frame | Peek) -> int:
    """Bytes a frame holds while it waits: its wire bytes, its decompressed copy, overhead."""
    raw = frame.raw_bytes if isinstance(frame, Peek) else len(frame.payload)
    return frame.wire_bytes + (raw if frame.compressed else 0) + FRAME_OVERHEAD_BYTES
