"""What every agent process shares: its presence on the bus, signals, logging, the serve loop."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Literal

from edgebus.core import sd_notify
from edgebus.core.client import BusClient
from edgebus.core.errors import EdgebusError
from edgebus.core.messages import Plan, PlanStage
from edgebus.core.presence import Presence
from edgebus.core.topics import Topics
from node_agent.cancel import cancel_all
from node_agent.status_payload import StatusPayload
from plant_config import Plant

if TYPE_CHECKING:
    from node_agent.sparkplug import Alive

log = logging.getLogger(__name__)


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
    """Log one warning when the plant has no `security:` section: anyone may use its broker;
    and one when its link is plain MQTT, which carries passwords and prompts in clear."""
    if plant.security is not None:
        warn_if_plain(plant, agent_id, source)
        return
    configure_logging()
    endpoint = plant.broker_of(agent_id).endpoint()
    log.warning(
        "%s: security is off: %s has no security: section, so the broker at %s:%d lets any "
        "client that reaches it read every prompt and answer, forge activation frames and "
        "answers, and fake statuses. Write the plant file with `edgebus init` without "
        "--insecure, or add a security: section (docs/plant-file.md, 'Security and line "
        "brokers').", agent_id, os.fspath(source), endpoint.host, endpoint.port)


def warn_if_plain(plant: Plant, agent_id: str | None, source: str | os.PathLike[str]) -> None:
    """Log one warning when `agent_id`'s link (None: the broker's own) is plain MQTT: TLS is the
    default (`edgebus init`), so plain is what the plant file chose, `tls: off` or an mqtt://
    url, or an older plant file; say what it costs at every start."""
    if not plant.speaks_plain(agent_id):
        return
    configure_logging()
    endpoint = plant.broker_endpoint(plant.broker if agent_id is None
                                     else plant.broker_of(agent_id))
    log.warning(
        "%s: plain MQTT, no TLS: %s has the broker at %s:%d speak it in clear, so anyone who "
        "can read that network reads every password, prompt and answer on it. TLS is the "
        "default: `edgebus init` makes the plant's CA and certificates (docs/securing-the-"
        "broker.md).", agent_id or "broker", os.fspath(source), endpoint.host, endpoint.port)


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


async def serve_until(stop: asyncio.Event, bus: BusClient, handler: Callable[..., None],
                      *workers: Awaitable[None], heartbeat_s: float) -> None:
    """Run the bus loop, the heartbeat and `workers` until `stop` is set, then leave cleanly."""
    if stop.is_set():  # stopped while loading: never connect, so nothing is left half-open
        return
    beat = asyncio.create_task(heartbeat(bus, heartbeat_s))
    tasks = [asyncio.create_task(bus.run(handler)), beat,
             asyncio.create_task(tell_systemd(bus)),
             *map(asyncio.ensure_future, workers)]
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
    sd_notify.notify("STOPPING=1", "STATUS=stopping")
    # No heartbeat may follow the offline status: an online one published while the
    # offline one waits for its PUBACK overwrote it, and the coordinator kept routing to a
    # stopped node until liveness.timeout_s (seen stopping a box for its upgrade).
    await cancel_all([beat])
    await bus.announce_offline()
    await cancel_all([stopper, *tasks])
    for task in done:  # a worker or the bus that died on its own must not exit 0
        if task is not stopper and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
