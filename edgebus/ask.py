"""`edgebus ask`: a gateway in a few lines: publish one request, print the answer.

It is also the reference client for the contract in the README: what it does
is what a PLC gateway does.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable

import aiomqtt

from edgebus.core.client import BusClient
from edgebus.core.errors import EdgebusError
from edgebus.core.messages import GenerateRequest, GenerateResponse, StreamDelta
from edgebus.core.statuses import StatusReader
from plant_config import Plant

log = logging.getLogger(__name__)

# How long to wait for the coordinator's retained "online" status. A request
# published before it subscribes would be lost (no persistent session yet).
COORDINATOR_WAIT_S = 30.0
# How long the coordinator's status may take before `ask` says it is waiting for it: a
# retained status comes within milliseconds of subscribing, so past this the coordinator is
# not online, and a person should not sit through COORDINATOR_WAIT_S in silence.
QUIET_WAIT_S = 1.0
# How long to wait for the broker itself: the client retries after 0.25, 0.5, 1 and
# 2 s, so a broker that is starting up is caught, and one that is not there is
# reported as such within seconds, not blamed on the coordinator half a minute later.
BROKER_WAIT_S = 5.0


def default_client_id(plant: Plant) -> str:
    """The gateway id `ask` uses: the plant's first gateway identity, else a random one."""
    if plant.security is not None and plant.security.gateways:
        return plant.security.gateways[0]
    return f"ask-{secrets.token_hex(4)}"


async def ask(plant: Plant, request: GenerateRequest, *, client_id: str | None = None,
              on_delta: Callable[[str], None] | None = None,
              on_wait: Callable[[str], None] | None = None,
              timeout: float | None = None) -> GenerateResponse:
    """Send `request` as gateway `client_id` and return the coordinator's response.
    `on_wait` is told, once, when the coordinator is not online within QUIET_WAIT_S."""
    topics = plant.topics
    client_id = client_id or default_client_id(plant)
    endpoint = plant.endpoint_for(client_id)
    response_topic = topics.response(client_id, request.id)
    status_topic = topics.status(plant.coordinator.id)
    online = asyncio.Event()
    last_state: list[str] = []  # the coordinator's state as its newest status says
    done: asyncio.Future[GenerateResponse] = asyncio.get_running_loop().create_future()
    statuses = StatusReader(log.warning)

    def on_message(message: aiomqtt.Message) -> None:
        payload = message.payload if isinstance(message.payload, bytes) else b""
        topic = message.topic.value
        if topic == status_topic:
            status = statuses.read(plant.coordinator.id, payload, "coordinator")
            if status is not None:
                last_state[:] = [status.state]
                if status.state == "online":
                    online.set()
        elif topic == response_topic and not done.done():
            done.set_result(GenerateResponse.model_validate_json(payload))
        elif topic == f"{response_topic}/stream" and on_delta is not None:
            on_delta(StreamDelta.model_validate_json(payload).delta)

    # A client id of its own: several `ask` may run at once as one gateway, and a broker
    # ends (Mosquitto) or strips of its subscriptions (amqtt 0.12.1) the connection whose
    # client id a newcomer takes, which then waited 30 s for a status that never came.
    bus = BusClient(endpoint, f"{plant.plant_id}.{client_id}.{secrets.token_hex(4)}",
                    subscriptions=[(status_topic, 1), (response_topic, 1),
                                   (f"{response_topic}/stream", 1)])
    runner = asyncio.create_task(bus.run(on_message))
    try:
        await _connected(bus, runner, f"{endpoint.host}:{endpoint.port}")
        try:
            async with asyncio.timeout(QUIET_WAIT_S):
                await online.wait()
        except TimeoutError:
            if on_wait is not None:
                on_wait(f"coordinator {plant.coordinator.id!r} is not online (its status at "
                        f"{status_topic} {_said(last_state)}): waiting up to "
                        f"{COORDINATOR_WAIT_S:.0f} s for it to come up")
        try:
            async with asyncio.timeout(COORDINATOR_WAIT_S - QUIET_WAIT_S):
                await online.wait()
        except TimeoutError:
            raise EdgebusError(
                f"coordinator {plant.coordinator.id!r} is not online on {endpoint.host}:"
                f"{endpoint.port} (its status at {status_topic} {_said(last_state)}). Start the "
                "plant with `edgebus up PLANT.yaml`.") from None
        # Only the fields the caller set: a task's template supplies the rest.
        payload = request.model_dump_json(exclude_unset=True, exclude_none=True)
        await bus.publish(topics.request(client_id), payload, qos=1)
        timeout = timeout or plant.coordinator.request_timeout_s * 2
        try:
            async with asyncio.timeout(timeout):
                return await done
        except TimeoutError:
            raise EdgebusError(f"no response to request {request.id} within {timeout:.0f} s") \
                from None
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


def _said(last_state: list[str]) -> str:
    return f"says {last_state[0]}" if last_state else "is not there"


async def _connected(bus: BusClient, runner: asyncio.Task[None], address: str) -> None:
    """Return once `bus` is connected; raise what is wrong if it does not connect."""
    waiting = asyncio.create_task(bus.wait_connected())
    await asyncio.wait({waiting, runner}, timeout=BROKER_WAIT_S,
                       return_when=asyncio.FIRST_COMPLETED)
    if waiting.done():
        return
    waiting.cancel()
    refused = runner.exception() if runner.done() else None
    if refused is not None:
        raise refused  # the broker refused us (credentials, ACL): it says why
    raise EdgebusError(f"no MQTT broker answers at {address} (the plant file's broker.url). "
                       "Start the plant with `edgebus up PLANT.yaml`, or start its broker.")
