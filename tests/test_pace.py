"""How long the coordinator waits for a step before it takes the step for lost
(node_agent/coordinator/token_loop.py, Pace): never less than the work queued ahead of it."""

from __future__ import annotations

import pytest

from node_agent.coordinator.token_loop import STALL_FACTOR, STALL_MIN_S, Pace


def paced(decode_s: float, prompt_s: float, prompt_positions: int) -> Pace:
    pace = Pace()
    pace.record(1, decode_s)
    pace.record(prompt_positions, prompt_s)
    return pace


def test_a_step_alone_is_lost_after_a_few_times_its_own_pace() -> None:
    pace = paced(decode_s=1.0, prompt_s=12.0, prompt_positions=24)
    assert pace.stall_after(1) == pytest.approx(STALL_FACTOR * 1.0)
    assert pace.stall_after(24) == pytest.approx(STALL_FACTOR * (1.0 + 12.0))
    assert Pace().stall_after(1) is None  # nothing timed yet: the request's timeout rules


def test_a_step_behind_other_requests_prompts_is_waited_for_as_long_as_they_take() -> None:
    # Llama-3-8B on 0.3 of a core: a decode step of 1 s, a 24-position prompt of 12 s. The
    # first decode step of the first of 8 requests sent at once is behind 7 prompts.
    pace = paced(decode_s=1.0, prompt_s=12.0, prompt_positions=24)
    behind = pace.stall_after(1, ahead=7 * 24)
    assert behind is not None and behind >= 7 * 12.0  # it was taken for lost after 3.7 s
    assert pace.stall_after(24, ahead=7 * 24) == pytest.approx(
        STALL_FACTOR * (1.0 + 12.0 + 7 * 12.0))


def test_positions_ahead_count_as_decode_steps_before_any_prompt_is_timed() -> None:
    pace = Pace()
    pace.record(1, 0.5)
    assert pace.stall_after(1, ahead=10) == pytest.approx(
        max(STALL_MIN_S, STALL_FACTOR * 0.5 * 11))
