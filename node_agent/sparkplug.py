"""Publishes one agent as a Sparkplug B edge node, so a SCADA host application finds the plant.

    spBv1.0/{group}/NBIRTH/{agent}          every metric, with its datatype, and bdSeq
    spBv1.0/{group}/NDATA/{agent}           only the metrics that changed since
    spBv1.0/{group}/NDEATH/{agent}          the MQTT Will: the NBIRTH's bdSeq
    spBv1.0/{group}/NCMD/{agent}            `Node Control/Rebirth`: publish NBIRTH again
    spBv1.0/{group}/DBIRTH|DDATA/{coordinator}/plant   the plant's health, from the coordinator

The metrics are the agent's own status (`{root}/status/{agent}`, built by
`StatusPayload` at every heartbeat): the edge node publishes the latest one
each heartbeat, so it never calls into the token path or waits on it.

The edge node has an MQTT connection of its own, because MQTT gives a
connection one Will and the agent's connection already has one (its retained
offline status). Every (re)connect starts a new bdSeq, 0-255 as the
specification has it, and that connection's NDEATH Will and NBIRTHs carry
it, so a host application can tell the late Will of an old connection from
the death of the current one. The payloads are pysparkplug's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

import aiomqtt
from google.protobuf.message import DecodeError
from pysparkplug import (
    DataType,
    DBirth,
    DData,
    MessageType,
    Metric,
    MetricValue,
    NBirth,
    NCmd,
    NData,
    NDeath,
    Topic,
    get_current_timestamp,
)

from edgebus.core.client import BusClient
from edgebus.core.errors import EdgebusError
from edgebus.core.messages import AgentStatus
from node_agent.cancel import cancel_all
from node_agent.status_payload import RATES, StatusPayload
from plant_config import Plant

log = logging.getLogger(__name__)

# The device under the coordinator's edge node that stands for the whole plant.
PLANT_DEVICE = "plant"
# Metric names the specification gives a meaning.
BD_SEQ = "bdSeq"
REBIRTH = "Node Control/Rebirth"
# bdSeq and seq are numbered modulo 256 (Sparkplug B 3.0).
SEQ_MODULO = 256
# Status metrics that are fractions even when a sample happens to be whole, so
# their datatype never flips (a flip costs a rebirth): the rates. Times in
# seconds (`*_s`) are too; any other metric is an Int64 until it shows a fraction.
FRACTIONS = frozenset(RATES.values())

# A metric's datatype and value; None: null (e.g. no last_error yet).
Value = tuple[DataType, MetricValue | None]


class Alive(Protocol):
    """What the coordinator knows of a stage node, as far as the plant's health goes."""

    alive: bool


@dataclass
class _EdgeBus(BusClient):
    """A BusClient whose Will is the edge node's NDEATH, new for every connection."""

    will: Callable[[], tuple[str, bytes]] | None = None

    def _make_client(self) -> aiomqtt.Client:
        client = super()._make_client()
        if self.will is not None:
            topic, payload = self.will()
            # Not retained: a host application learns of a node from its births.
            client._client.will_set(topic, payload, qos=1, retain=False)  # the paho client
        return client


class EdgeNode:
    """One agent as a Sparkplug B edge node; the coordinator's also has the plant device."""

    def __init__(self, plant: Plant, agent_id: str, agent_bus: BusClient, *, identity: str,
                 health: Mapping[str, Alive] | None = None) -> None:
        sparkplug = plant.ops.sparkplug if plant.ops is not None else None
        status = agent_bus.presence.payload if agent_bus.presence is not None else None
        if sparkplug is None or not isinstance(status, StatusPayload):
            raise EdgebusError(f"{agent_id}: a Sparkplug edge node needs ops.sparkplug in the "
                               "plant file and an agent connection that announces a status")
        self.group = sparkplug.group
        self.agent_id = agent_id
        self.agent_bus = agent_bus
        self.status = status
        self.interval_s = plant.liveness.heartbeat_s
        self.pipeline = plant.pipeline
        self.health = health
        # Where a restarted agent starts: a number its predecessor's Will is unlikely to carry.
        self.bd_seq = secrets.randbelow(SEQ_MODULO)
        self.seq = 0
        self._born: dict[str, Value] = {}  # the node's metrics as last published
        self._birth_payload: NBirth | None = None  # the last NBIRTH
        self._device_born: dict[str, Value] = {}
        self._fractions: set[str] = set(FRACTIONS)
        self._started: datetime | None = None
        self._rebirth = asyncio.Event()
        self._unreadable = 0  # NCMD payloads that were no Sparkplug payload, since last logged
        self.bus = _EdgeBus(
            plant.endpoint_for(identity), f"{plant.plant_id}.{agent_id}.sparkplug",
            subscriptions=[(self.topic(MessageType.NCMD), 1)], on_connect=[self._birth],
            will=self._next_session)

    def topic(self, kind: MessageType, device: str | None = None) -> str:
        return str(Topic(group_id=self.group, message_type=kind, edge_node_id=self.agent_id,
                         device_id=device))

    async def run(self) -> None:
        """Connect, be born, publish what changed every heartbeat; NDEATH on the way out."""
        await self.agent_bus.wait_connected()  # its status has been built once by then
        connection = asyncio.create_task(self.bus.run(self._on_command))
        try:
            while not connection.done():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.interval_s):
                        await self._rebirth.wait()
                if self._unreadable:
                    log.warning("%s: ignored %d NCMD messages that are no Sparkplug B payload",
                                self.agent_id, self._unreadable)
                    self._unreadable = 0
                if not self.bus.connected:
                    continue  # the births on the reconnect say it all
                if self._rebirth.is_set():
                    self._rebirth.clear()
                    self._birth()
                else:
                    self._publish_changes()
            # The connection loop ends only on an error that retrying cannot fix (a BusError:
            # refused credentials); raise it.
            connection.result()
        finally:
            if self.bus.connected:  # a clean disconnect discards the Will: say it ourselves
                self.bus.send(self.topic(MessageType.NDEATH), self._death(will=False), qos=1)
            await cancel_all([connection])

    # -- births, data, death --------------------------------------------------------

    def _next_session(self) -> tuple[str, bytes]:
        """A new bdSeq for the connection about to be made, and its NDEATH Will."""
        self.bd_seq = (self.bd_seq + 1) % SEQ_MODULO
        return self.topic(MessageType.NDEATH), self._death(will=True)

    def _death(self, *, will: bool) -> bytes:
        # A Will is written at connect time, so it has no honest timestamp to carry.
        stamp = None if will else get_current_timestamp()
        return NDeath(timestamp=stamp, bd_seq_metric=Metric(
            timestamp=stamp, name=BD_SEQ, datatype=DataType.UINT64, value=self.bd_seq)).encode()

    def _birth(self) -> None:
        """NBIRTH (seq 0) with every metric, then the plant device's DBIRTH."""
        latest = self.status.latest
        assert latest is not None  # run() waited for the agent's first status
        now = get_current_timestamp()
        self.seq = 0
        self._born = self._node_metrics(latest)
        metrics = [Metric(timestamp=now, name=BD_SEQ, datatype=DataType.UINT64,
                          value=self.bd_seq),
                   Metric(timestamp=now, name=REBIRTH, datatype=DataType.BOOLEAN, value=False),
                   *_metrics(self._born, _stamp(latest))]
        self._birth_payload = NBirth(timestamp=now, seq=self.seq, metrics=tuple(metrics))
        self.bus.send(self.topic(MessageType.NBIRTH), self._birth_payload.encode(), qos=0)
        if self.health is not None:
            self._device_born = self._device_metrics(self._born)
            self.bus.send(self.topic(MessageType.DBIRTH, PLANT_DEVICE),
                          DBirth(timestamp=now, seq=self._next_seq(),
                                 metrics=tuple(_metrics(self._device_born, now))).encode(), qos=0)

    def _publish_changes(self) -> None:
        """NDATA and DDATA with what changed; a rebirth when a metric came or went.

        Each metric keeps its datatype (optional in data messages), so a host
        application that joined after the birth can read values before its rebirth.
        """
        latest = self.status.latest
        assert latest is not None  # set before the connection that called _birth
        node = self._node_metrics(latest)
        device = self._device_metrics(node) if self.health is not None else {}
        if _shape(node) != _shape(self._born) or _shape(device) != _shape(self._device_born):
            self._birth()  # a host application learns a metric's name and type from a birth
            return
        now = get_current_timestamp()
        changed = _changed(self._born, node)
        if changed:
            self._born = node
            self.bus.send(self.topic(MessageType.NDATA), NData(
                timestamp=now, seq=self._next_seq(),
                metrics=tuple(_metrics(changed, _stamp(latest)))).encode(include_dtypes=True),
                qos=0)
        changed = _changed(self._device_born, device)
        if changed:
            self._device_born = device
            self.bus.send(self.topic(MessageType.DDATA, PLANT_DEVICE), DData(
                timestamp=now, seq=self._next_seq(),
                metrics=tuple(_metrics(changed, now))).encode(include_dtypes=True), qos=0)

    def _next_seq(self) -> int:
        self.seq = (self.seq + 1) % SEQ_MODULO
        return self.seq

    def _on_command(self, message: aiomqtt.Message) -> None:
        payload = message.payload if isinstance(message.payload, bytes) else b""
        try:  # with the birth: a command may leave out the datatype the birth gave
            command = NCmd.decode(payload, birth=self._birth_payload)
        except (DecodeError, ValueError, KeyError, NotImplementedError):
            # Not protobuf, no timestamp, a metric the birth does not name, or a
            # datatype pysparkplug does not read.
            self._unreadable += 1
            return
        if any(m.name == REBIRTH and m.value is True for m in command.metrics):
            self._rebirth.set()

    # -- metrics ------------------------------------------------------------------

    def _node_metrics(self, status: AgentStatus) -> dict[str, Value]:
        """The agent's status as Sparkplug metrics: what it is under Properties/, then its
        memory, last error and counters."""
        if self._started is None and status.uptime_s is not None:
            # Fixed once: the uptime is rounded, so a start time worked out afresh would
            # wobble and turn every heartbeat into an NDATA.
            self._started = datetime.fromtimestamp(status.ts - status.uptime_s, UTC)
        error_ts = (datetime.fromtimestamp(status.last_error_ts, UTC)
                    if status.last_error_ts is not None else None)
        metrics: dict[str, Value] = {
            "Properties/role": (DataType.STRING, status.role),
            "Properties/host": (DataType.STRING, status.host),
            "Properties/version": (DataType.STRING, status.version),
            "Properties/pid": (DataType.INT64, status.pid),
            "Properties/started": (DataType.DATETIME, self._started),
            "rss_bytes": (DataType.INT64, status.rss_bytes),
            "last_error": (DataType.STRING, status.last_error),
            "last_error_ts": (DataType.DATETIME, error_ts),
        }
        if status.stage is not None:
            metrics["Properties/stage"] = (DataType.INT64, status.stage)
        if status.layers is not None:
            first, end = status.layers
            metrics["Properties/layers"] = (DataType.STRING, f"[{first}, {end})")
        for key, setting in (status.engine or {}).items():
            metrics[f"Properties/engine/{key}"] = (
                (DataType.STRING, setting) if isinstance(setting, str)
                else self._number(f"engine/{key}", setting))
        for name, value in status.metrics.items():
            metrics[name] = self._number(name, value)
        for counter, rate in RATES.items():  # the first status has no rates yet: born null
            if counter in status.metrics and rate not in status.metrics:
                metrics[rate] = (DataType.DOUBLE, None)
        return metrics

    def _device_metrics(self, node: Mapping[str, Value]) -> dict[str, Value]:
        """The plant's health: stages and nodes online, and the coordinator's load (from its
        node's metrics `node`)."""
        assert self.health is not None
        online = {node for node, health in self.health.items() if health.alive}
        stages_online = sum(any(node in online for node in stage.node_ids)
                            for stage in self.pipeline)
        metrics: dict[str, Value] = {
            "ready": (DataType.BOOLEAN, stages_online == len(self.pipeline)),
            "stages_total": (DataType.INT64, len(self.pipeline)),
            "stages_online": (DataType.INT64, stages_online),
            "nodes_total": (DataType.INT64, len(self.health)),
            "nodes_online": (DataType.INT64, len(online)),
        }
        for name in ("in_flight", "tokens", "tokens_per_s", "requests_done"):
            if name in node:
                metrics[name] = node[name]
        return metrics

    def _number(self, name: str, value: float) -> Value:
        """Int64 for a count, Double for a fraction; once a fraction, always a Double."""
        if name in self._fractions or name.endswith("_s") or not float(value).is_integer():
            self._fractions.add(name)
            return DataType.DOUBLE, float(value)
        return DataType.INT64, int(value)


def _shape(metrics: Mapping[str, Value]) -> dict[str, DataType]:
    return {name: datatype for name, (datatype, _) in metrics.items()}


def _changed(before: Mapping[str, Value], now: dict[str, Value]) -> dict[str, Value]:
    return {name: value for name, value in now.items() if before.get(name) != value}


def _stamp(status: AgentStatus) -> int:
    """A status's time, in Sparkplug's milliseconds since the epoch."""
    return int(status.ts * 1000)


def _metrics(values: Mapping[str, Value], timestamp: int) -> list[Metric]:
    return [Metric(timestamp=timestamp, name=name, datatype=datatype, value=value)
            for name, (datatype, value) in values.items()]
