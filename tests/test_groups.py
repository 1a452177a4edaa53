"""The coordinator's outbox: what leaves together, so stages see whole groups as batches."""

from __future__ import annotations

import asyncio

from node_agent.groups import MIN_GROUP_ROWS, Outbox


class _Plant:
    """What the outbox talks to: messages it published, and which requests await a result."""

    def __init__(self, groups: int) -> None:
        self.sent: list[tuple[str, list[bytes]]] = []
        self.stepping: set[int] = set()
        self.outbox = Outbox(groups, self._publish, self.stepping.__contains__, max_frames=64)

    def _publish(self, node: str, message: bytes) -> None:
        # Frames here are 2-byte tags, so a message splits back into its frames.
        self.sent.append((node, [message[i:i + 2] for i in range(0, len(message), 2)]))

    def step(self, seq: int, node: str = "s0") -> None:
        self.stepping.add(seq)
        self.outbox.step(seq, node, b"%02d" % seq)

    async def turn(self) -> list[tuple[str, list[bytes]]]:
        """Let the event loop flush; return what left in that turn."""
        before = len(self.sent)
        await asyncio.sleep(0)
        return self.sent[before:]


async def test_a_groups_steps_in_one_turn_leave_as_one_message_per_node() -> None:
    plant = _Plant(groups=1)
    for seq in (1, 2):  # both join the one group; nothing is in flight, so they leave at once
        plant.step(seq)
    assert await plant.turn() == [("s0", [b"01", b"02"])]
    plant.stepping.clear()  # their results are back
    plant.step(1)
    plant.step(2, node="s0-standby")  # another route's first node
    plant.outbox.send("s0", b"pp")  # a prompt chunk belongs to no group
    assert sorted(await plant.turn()) == [("s0", [b"01"]), ("s0", [b"pp"]),
                                          ("s0-standby", [b"02"])]


async def test_a_new_request_joins_the_smallest_group_and_waits_for_its_next_pass() -> None:
    plant = _Plant(groups=2)
    first = list(range(1, MIN_GROUP_ROWS + 1))
    for seq in first:  # too few for two groups of MIN_GROUP_ROWS: all in group 0
        plant.step(seq)
    assert await plant.turn() == [("s0", [b"%02d" % seq for seq in first])]
    extra, later = MIN_GROUP_ROWS + 1, MIN_GROUP_ROWS + 2
    plant.step(extra)  # opens group 1, with no step in flight: leaves at once
    assert await plant.turn() == [("s0", [b"%02d" % extra])]
    plant.step(later)  # joins group 1, the smaller, whose member has a step in flight
    assert await plant.turn() == []
    plant.stepping.discard(extra)  # its result arrives; its next step carries `later` along
    plant.step(extra)
    assert await plant.turn() == [("s0", [b"%02d" % extra, b"%02d" % later])]
    assert plant.outbox.members == [set(first), {extra, later}]


async def test_a_joiner_does_not_wait_for_a_group_that_stopped_moving() -> None:
    plant = _Plant(groups=1)
    plant.step(1)
    await plant.turn()
    plant.step(2)  # waits for 1's group
    assert await plant.turn() == []
    plant.stepping.discard(1)
    plant.outbox.leave(1)  # 1 finished instead of stepping again
    assert await plant.turn() == [("s0", [b"02"])]
    assert plant.outbox.members == [{2}]


async def test_a_replayed_request_leaves_its_group_and_its_waiting_step_is_dropped() -> None:
    plant = _Plant(groups=1)
    plant.step(1)
    await plant.turn()
    plant.step(2)
    plant.outbox.leave(2)  # its route lost a node before the step left: replayed elsewhere
    plant.stepping.discard(1)
    plant.step(1)
    assert await plant.turn() == [("s0", [b"01"])]
