"""The coordinator's outbox, and the request groups it keeps.

A stage runs the decode rows of one message as one batched forward pass and
sends their outputs on as one message, so what the coordinator puts into one
message travels as one batch through every stage: a *group*. The coordinator
keeps a fixed number of groups (by default one per stage: while one stage
computes one group, the other stages compute the others, and no box idles).

- Frames queued in one event-loop turn leave as one message per (node, group).
  A group's results arrive in one message, every member's task samples its
  token in that turn, so the members' next steps leave together again.
- A request joins the smallest group when its prompt is in, among as many
  groups as give each at least MIN_GROUP_ROWS rows: splitting fewer requests
  gains nothing (a step of a few rows costs what one row costs) and adds a
  message per group. Its first decode step then waits for the group's next
  pass, to leave in the same message as the members' steps; if the group has
  no step in flight, it leaves at once.
  Sent alone, it would travel as a batch of its own, and the groups would
  splinter into many small batches: measured on 2 cores, 1 stage and 4
  requests, they settled into two alternating batches of ~2 rows.
- Prompt chunks and releases belong to no group; they leave in a message of
  their own per node.
- No message carries more than `max_frames` frames (the plant's frame limit,
  edgebus/core/frames.py): more leave as several messages, in order.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Callable

# Fewest decode rows worth a group of their own. A decode step reads every
# weight of its stage whatever its batch, so a few rows cost what one costs
# (measured, the whole SmolLM2 on one thread: 50 ms for 1 row, 49 for 4, 65
# for 8); with 4 requests, 2 pinned stages ran 0.78x one stage when each
# group had 2 rows.
MIN_GROUP_ROWS = 4


class Outbox:
    """Gathers frames per event-loop turn into one message per (node, group)."""

    def __init__(self, groups: int, publish: Callable[[str, bytes], None],
                 stepping: Callable[[int], bool], *, max_frames: int) -> None:
        """`publish(node, message)` sends; `stepping(seq)` tells whether request
        `seq` has a decode step in flight (its result not back yet); a message
        carries at most `max_frames` frames."""
        self.max_frames = max_frames
        self.members: list[set[int]] = [set() for _ in range(max(1, groups))]
        self._group: dict[int, int] = {}  # request seq -> its group
        self._joining: dict[int, tuple[str, bytes]] = {}  # seq -> (node, first decode frame)
        self._queued: dict[tuple[str, int | None], list[bytes]] = collections.defaultdict(list)
        self._scheduled = False
        self._publish = publish
        self._stepping = stepping

    def send(self, node: str, frame: bytes) -> None:
        """Queue a frame outside any group: a prompt chunk, a release."""
        self._queued[(node, None)].append(frame)
        self._schedule()

    def step(self, seq: int, node: str, frame: bytes) -> None:
        """Queue request `seq`'s decode step with its group's, joining a group first."""
        group = self._group.get(seq)
        if group is None:
            grouped = len(self._group) + 1
            open_groups = min(len(self.members), math.ceil(grouped / MIN_GROUP_ROWS))
            group = min(range(open_groups), key=lambda g: len(self.members[g]))
            self.members[group].add(seq)
            self._group[seq] = group
            self._joining[seq] = (node, frame)
        else:
            self._queued[(node, group)].append(frame)
        self._schedule()

    def leave(self, seq: int) -> None:
        """Request `seq` leaves its group: it ended, or is replayed down a new route."""
        group = self._group.pop(seq, None)
        if group is None:
            return
        self.members[group].discard(seq)
        self._joining.pop(seq, None)
        self._schedule()  # the group may have stopped moving: its joiners need not wait

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        passing = {group for _, group in self._queued if group is not None}
        # Decided before any joiner is released: a released joiner is in flight too.
        ready = {group for group, members in enumerate(self.members)
                 if group in passing or not any(self._stepping(seq) for seq in members
                                                if seq not in self._joining)}
        for seq, (node, frame) in list(self._joining.items()):
            group = self._group[seq]
            if group in ready:
                del self._joining[seq]
                self._queued[(node, group)].append(frame)
        for (node, _), parts in self._queued.items():
            for first in range(0, len(parts), self.max_frames):
                self._publish(node, b"".join(parts[first:first + self.max_frames]))
        self._queued.clear()
