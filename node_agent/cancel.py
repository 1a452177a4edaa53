"""Ending an agent's asyncio tasks for sure, on Python 3.11 too."""

from __future__ import annotations

import asyncio
from typing import Any

# How long a shutdown waits for a cancelled task before cancelling it again.
CANCEL_RETRY_S = 0.5


async def cancel_all(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel `tasks` and wait for them, cancelling again any that swallowed the cancel.

    On Python 3.11 a cancel that lands as the awaited operation completes is
    lost inside `asyncio.wait_for` (which aiomqtt uses for connects and QoS 1
    publishes): the task runs on, and a plain gather would wait forever.
    """
    pending = [task for task in tasks if not task.done()]
    while pending:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=CANCEL_RETRY_S)
        pending = [task for task in pending if not task.done()]
    await asyncio.gather(*tasks, return_exceptions=True)
