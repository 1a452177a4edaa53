"""What every agent process shares: status payloads, events, signals, logging."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any, Literal

from edgebus import sd_notify
from edgebus.client import BusClient, Presence
from edgebus.errors import EdgebusError
from edgebus.messages import AgentStatus, Plan, PlanStage
from edgebus.topics import Topics
from plant_config import Plant

if TYPE_CHECKING:
    from node_agent.sparkplug import Alive

log = logging.getLogger(__name__)

try:
    VERSION = version("edgebus")
except PackageNotFoundError:  # running from a source tree that was never installed
    VERSION = "0+unknown"


# Counters whose per-second rate each status also carries, under the rate's
# name: a chart of a rate reads at a glance, one of an ever-growing counter
# does not. `tokens` are the coordinator's generated tokens, `rows` the
# request rows a stage computed, `compute_s` a stage's seconds of compute (so
# its rate is the fraction of time the stage was busy).
RATES = {"tokens": "tokens_per_s", "rows": "rows_per_s", "compute_s": "busy"}

# How long a shutdown waits for a cancelled task before cancelling it again.
CANCEL_RETRY_S = 0.5

# Uptime counts from here: agents import this module first thing, before loading layers.
_STARTED = time.monotonic()


@dataclass
class StatusPayload:
    """Builds one agent's status payloads; remembers its last error and its last counters."""

    agent_id: str
    role: Literal["stage", "coordinator"]
    stage: int | None = None
    layers: tuple[int, int] | None = None
    metrics: Callable[[], dict[str, float]] | None = None
    engine: dict[str, str | int | float] | None = None
    last_error: str | None = None
    last_error_ts: float | None = None
    _previous: tuple[float, dict[str, float]] | None = field(default=None, init=False)
    # The last online status built: what the Sparkplug edge node reports (node_agent/sparkplug.py).
    latest: AgentStatus | None = field(default=None, init=False)

    def __call__(self, state: Literal["online", "offline"], bdseq: int) -> bytes:
        now = time.monotonic()
        metrics = dict(self.metrics()) if self.metrics else {}  # a copy: rates are added
        if state == "online":  # a death (the Will is built at connect time) carries no rates
            metrics.update(self._rates(now, metrics))
        status = AgentStatus(state=state, role=self.role, agent_id=self.agent_id,
                             stage=self.stage, layers=list(self.layers) if self.layers else None,
                             pid=os.getpid(), host=socket.gethostname(), version=VERSION,
                             bdseq=bdseq, rss_bytes=rss_bytes(),
                             uptime_s=round(now - _STARTED, 1), last_error=self.last_error,
                             last_error_ts=self.last_error_ts, metrics=metrics, engine=self.engine)
        if state == "online":
            self.latest = status
        return status.model_dump_json().encode()

    def _rates(self, now: float, metrics: dict[str, float]) -> dict[str, float]:
        """RATES over the time since the previous online payload (none for the first)."""
        previous, self._previous = self._previous, (now, dict(metrics))
        if previous is None or now <= previous[0]:
            return {}
        then, before = previous
        return {rate: (metrics[name] - before[name]) / (now - then)
                for name, rate in RATES.items() if name in metrics and name in before}


def rss_bytes() -> int | None:
    """This process's resident memory now (Linux /proc); None where there is no /proc."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def presence(topics: Topics, agent_id: str, role: Literal["stage", "coordinator"], *,
             stage: int | None = None, layers: tuple[int, int] | None = None,
             metrics: Callable[[], dict[str, float]] | None = None,
             engine: dict[str, str | int | float] | None = None) -> Presence:
    """Birth/death payloads for `{root}/status/{agent_id}`."""
    return Presence(topics.status(agent_id),
                    StatusPayload(agent_id, role, stage, layers, metrics, engine))


def sparkplug_node(plant: Plant, agent_id: str, bus: BusClient, *, identity: str | None = None,
                   health: Mapping[str, Alive] | None = None) -> list[Awaitable[None]]:
    """This agent's Sparkplug B edge node (node_agent/sparkplug.py) as workers for
    `serve_until`: none unless the plant file has `ops.sparkplug`. `identity`: whom it logs
    in as (default: `agent_id`); `health`: the coordinator's stage nodes, for the plant device.
    """
    if plant.ops is None or plant.ops.sparkplug is None:
        return []
    try:
        from node_agent.sparkplug import EdgeNode  # needs pysparkplug, installed on its own
    except ModuleNotFoundError as exc:
        if exc.name != "pysparkplug":
            raise
        raise EdgebusError(
            "the plant file turns Sparkplug B on (ops.sparkplug), and pysparkplug is not "
            "installed: run `pip install --no-deps pysparkplug==0.6.1` (docs/sparkplug.md says "
            "why --no-deps), or remove ops.sparkplug") from None
    return [EdgeNode(plant, agent_id, bus, identity=identity or agent_id, health=health).run()]


def configure_logging() -> None:
    """Log to stderr (the journal, under systemd) at $EDGEBUS_LOG (default INFO); once."""
    logging.basicConfig(level=os.environ.get("EDGEBUS_LOG", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def warn_if_insecure(plant: Plant, agent_id: str, source: str | os.PathLike[str]) -> None:
    """Log one warning when the plant has no `security:` section: anyone may use its broker."""
    if plant.security is not None:
        return
    configure_logging()
    endpoint = plant.broker_of(agent_id).endpoint()
    log.warning(
        "%s: security is off: %s has no security: section, so the broker at %s:%d lets any "
        "client that reaches it read every prompt and answer, forge activation frames and "
        "answers, and fake statuses. Write the plant file with `edgebus init` without "
        "--insecure, or add a security: section (docs/plant-file.md, 'Security and line "
        "brokers').", agent_id, os.fspath(source), endpoint.host, endpoint.port)


def run_agent(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop)` until it returns; SIGINT/SIGTERM set `stop` for a clean exit."""
    configure_logging()

    async def wrapper() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    asyncio.run(wrapper())
    # The agent is done: what is left is the interpreter tearing down millions of
    # objects (a model's modules, tokenizer tables), which took ~1 s of garbage
    # collection per agent after a clean stop (0.2 s frozen). systemd and `up`
    # wait for that exit before they restart the agent.
    gc.freeze()


async def heartbeat(bus: BusClient, interval_s: float) -> None:
    """Refresh the retained status (the plant's liveness.heartbeat_s) while connected."""
    while True:
        await asyncio.sleep(interval_s)
        await bus.refresh_presence()


async def tell_systemd(bus: BusClient) -> None:
    """READY once connected (layers are loaded by then), WATCHDOG only while connected.

    Runs until cancelled; outside systemd it does nothing.
    """
    broker = f"the broker at {bus.endpoint.host}:{bus.endpoint.port}"
    sd_notify.notify(f"STATUS=connecting to {broker}")
    await bus.wait_connected()
    sd_notify.notify("READY=1", f"STATUS=connected to {broker}")
    await sd_notify.watchdog(lambda: bus.connected, healthy_status=f"connected to {broker}",
                             unhealthy_status=f"lost {broker}; reconnecting")


async def publish_plan(bus: BusClient, plant: Plant) -> None:
    """Retain the plant's partition on `{root}/plan` as soon as `bus` is connected."""
    plan = Plan(plant_id=plant.plant_id, coordinator=plant.coordinator.id,
                stages=[PlanStage(index=stage.index, layers=list(stage.layers),
                                  nodes=stage.node_ids) for stage in plant.pipeline])
    await bus.wait_connected()
    await bus.publish(plant.topics.plan, plan.model_dump_json(), qos=1, retain=True)


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


async def serve_until(stop: asyncio.Event, bus: BusClient, handler: Callable[..., None],
                      *workers: Awaitable[None], heartbeat_s: float) -> None:
    """Run the bus loop, the heartbeat and `workers` until `stop` is set, then leave cleanly."""
    if stop.is_set():  # stopped while loading: never connect, so nothing is left half-open
        return
    tasks = [asyncio.create_task(bus.run(handler)),
             asyncio.create_task(heartbeat(bus, heartbeat_s)),
             asyncio.create_task(tell_systemd(bus)),
             *map(asyncio.ensure_future, workers)]
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
    sd_notify.notify("STOPPING=1", "STATUS=stopping")
    await bus.announce_offline()
    await cancel_all([stopper, *tasks])
    for task in done:  # a worker or the bus that died on its own must not exit 0
        if task is not stopper and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
