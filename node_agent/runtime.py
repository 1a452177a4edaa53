"""What every agent process shares: status payloads, events, signals, logging."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Literal

from edgebus.client import BusClient, Presence
from edgebus.messages import AgentStatus, Event
from edgebus.topics import Topics

log = logging.getLogger(__name__)

try:
    VERSION = version("edgebus")
except PackageNotFoundError:  # running from a source tree that was never installed
    VERSION = "0+unknown"


# How often an agent refreshes its retained status (heartbeat timestamp and
# metrics): often enough for a live chart, rare enough to cost nothing.
STATUS_INTERVAL_S = 2.0


def presence(topics: Topics, agent_id: str, role: Literal["stage", "coordinator"], *,
             stage: int | None = None, layers: tuple[int, int] | None = None,
             metrics: Callable[[], dict[str, float]] | None = None) -> Presence:
    """Birth/death payloads for `{root}/status/{agent_id}`."""

    def payload(state: Literal["online", "offline"]) -> bytes:
        return AgentStatus(state=state, role=role, agent_id=agent_id, stage=stage,
                           layers=list(layers) if layers else None, pid=os.getpid(),
                           host=socket.gethostname(), version=VERSION,
                           metrics=metrics() if metrics else {}
                           ).model_dump_json().encode()

    return Presence(topics.status(agent_id), lambda: payload("online"),
                    lambda: payload("offline"))


async def publish_event(bus: BusClient, topics: Topics, event: Event) -> None:
    """Best effort: an event that cannot be published is logged, never raised."""
    log.log(logging.ERROR if event.kind == "error" else logging.INFO, "%s %s: %s",
            event.agent_id, event.kind, event.message)
    with contextlib.suppress(Exception):
        await bus.publish(topics.events, event.model_dump_json(), qos=0)


def run_agent(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop)` until it returns; SIGINT/SIGTERM set `stop` for a clean exit."""
    logging.basicConfig(level=os.environ.get("EDGEBUS_LOG", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def wrapper() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    asyncio.run(wrapper())


async def heartbeat(bus: BusClient) -> None:
    """Refresh the retained status every STATUS_INTERVAL_S while connected."""
    while True:
        await asyncio.sleep(STATUS_INTERVAL_S)
        await bus.refresh_presence()


async def serve_until(stop: asyncio.Event, bus: BusClient,
                      handler: Callable[..., None], *workers: Awaitable[None]) -> None:
    """Run the bus loop, the heartbeat and `workers` until `stop` is set, then leave cleanly."""
    if stop.is_set():  # stopped while loading: never connect, so nothing is left half-open
        return
    tasks = [asyncio.create_task(bus.run(handler)), asyncio.create_task(heartbeat(bus)),
             *map(asyncio.ensure_future, workers)]
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
    await bus.announce_offline()
    for task in [stopper, *tasks]:
        task.cancel()
    await asyncio.gather(stopper, *tasks, return_exceptions=True)
    for task in done:  # a worker or the bus that died on its own must not exit 0
        if task is not stopper and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
