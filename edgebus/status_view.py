"""`edgebus status PLANT`: the live plant as a table, built from its retained messages.

Every agent keeps its status retained on `{root}/status/{agent_id}` and the
coordinator keeps the partition on `{root}/plan`, so a fresh subscriber gets
all of them at once: the command subscribes, listens until every agent of the
plant file and the plan have reported (or `wait_s` passes), and prints.
It only reads, so it works with an ops identity that may read nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiomqtt
from pydantic import ValidationError

from edgebus.core.client import INFLIGHT_WINDOW, UNACKED_WARN_AT, BusClient
from edgebus.core.errors import EdgebusError
from edgebus.core.messages import AgentStatus, Plan
from edgebus.core.statuses import StatusReader
from plant_config import Plant
from plant_config.certificates import WARN_DAYS, plant_certificates

log = logging.getLogger(__name__)

# How long to listen for agents that have not reported: retained messages
# arrive within milliseconds of subscribing, so this is margin for a remote
# broker; an agent still missing then has never published a status.
DEFAULT_WAIT_S = 2.0
# How long the broker gets to accept the connection before we give up.
CONNECT_TIMEOUT_S = 10.0
# How often the listener checks whether everything expected has arrived.
_POLL_S = 0.02
# A last error longer than this is cut in the table (`--json` has it whole).
_ERROR_CHARS = 48


@dataclass
class ClusterView:
    """The newest status of each agent and the plan, as far as the broker told us."""

    statuses: dict[str, AgentStatus] = field(default_factory=dict)
    plan: Plan | None = None

    def take(self, status: AgentStatus) -> None:
        """Keep `status` unless it belongs to an older MQTT session than one already seen.

        That is the point of bdseq: a Will the broker publishes late, after the
        agent has reconnected, must not make a live agent look dead.
        """
        seen = self.statuses.get(status.agent_id)
        if seen is None or status.bdseq >= seen.bdseq:
            self.statuses[status.agent_id] = status


async def collect(plant: Plant, wait_s: float = DEFAULT_WAIT_S) -> ClusterView:
    """Subscribe to the plant's statuses and plan; return what arrived within `wait_s`."""
    topics = plant.topics
    view = ClusterView()
    statuses = StatusReader(log.warning)

    def on_message(message: aiomqtt.Message) -> None:
        payload = message.payload if isinstance(message.payload, bytes | str) else b""
        try:
            if message.topic.matches(topics.plan):
                view.plan = Plan.model_validate_json(payload)
            elif ((agent := topics.agent_of_status_topic(message.topic.value)) is not None
                  and (status := statuses.read(agent, payload)) is not None):
                view.take(status)
        except ValidationError:
            pass  # not ours (another tool's retained message): nothing to show

    endpoint = plant.ops_endpoint()
    bus = BusClient(endpoint, plant.ops_client_id("status"),
                    subscriptions=[(topics.status_filter, 1), (topics.plan, 1)])
    runner = asyncio.create_task(bus.run(on_message))
    try:
        connected = asyncio.create_task(bus.wait_connected())
        await asyncio.wait([runner, connected], timeout=CONNECT_TIMEOUT_S,
                           return_when=asyncio.FIRST_COMPLETED)
        if runner.done():
            runner.result()  # a refused connection (credentials, ACL) raises here
        if not connected.done():
            connected.cancel()
            raise EdgebusError(f"no answer from the broker at {endpoint.host}:{endpoint.port} "
                               f"within {CONNECT_TIMEOUT_S:.0f} s")
        expected = set(agent_ids(plant))
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not (
                view.plan is not None and expected <= view.statuses.keys()):
            await asyncio.sleep(_POLL_S)
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
    return view


def agent_ids(plant: Plant) -> list[str]:
    """Every agent the plant file names, in pipeline order, the coordinator last."""
    return [*(spec.node for spec in plant.stages), plant.coordinator.id]


def report(plant: Plant, view: ClusterView, now: float | None = None) -> dict[str, Any]:
    """The JSON form: every agent of the plant (and any other that reported), with a verdict.

    `state` is the agent's own word, except "stale" (it says online but has
    missed its heartbeats for liveness.timeout_s: dead, and the broker has not
    yet noticed) and "missing" (no status at all).
    """
    now = time.time() if now is None else now
    known = agent_ids(plant)
    agents = []
    for agent in [*known, *sorted(view.statuses.keys() - set(known))]:
        status = view.statuses.get(agent)
        age = None if status is None else max(0.0, now - status.ts)
        if status is None:
            state = "missing"
        elif status.state == "online" and age is not None and age > plant.liveness.timeout_s:
            state = "stale"
        else:
            state = status.state
        agents.append({"agent_id": agent, "state": state, "age_s": age,
                       "status": None if status is None else status.model_dump()})
    return {"plant_id": plant.plant_id, "topic_root": plant.topic_root,
            "plan": None if view.plan is None else view.plan.model_dump(), "agents": agents,
            "tls": not plant.speaks_plain(), "certificates": certificates(plant)}


def certificates(plant: Plant) -> list[dict[str, Any]]:
    """Each certificate of the plant this box holds (the CA, the broker's, the clients'), with
    the days it has left, and a warning from WARN_DAYS before it expires."""
    rows = []
    for cert in plant_certificates(plant):
        days = cert.days_left()
        warning = None
        if days < 0:
            warning = f"{cert.path} has expired: clients refuse it"
        elif days < WARN_DAYS:
            warning = f"{cert.path} expires in {days} days"
        rows.append({"path": str(cert.path), "subject": cert.subject,
                     "not_after": cert.not_after.isoformat(), "days_left": days,
                     "warning": warning})
    return rows


_COLUMNS = ("AGENT", "ROLE", "STAGE", "LAYERS", "ENGINE", "STATE", "AGE", "TOK/S", "BUSY",
            "QUEUE", "IN FLIGHT", "KV", "RSS", "UPTIME", "DRAFTS", "LAST ERROR")


def table(data: dict[str, Any]) -> str:
    """`report()` as text: a plan line, then one row per agent."""
    lines = [f"plant {data['plant_id']!r}, topic root {data['topic_root']}"]
    plan = data["plan"]
    if plan is None:
        lines.append("plan: none retained (the coordinator publishes it when it starts)")
    else:
        lines.append("plan: " + "  ".join(
            f"{s['index']}: [{s['layers'][0]}, {s['layers'][1]}) {','.join(s['nodes'])}"
            for s in plan["stages"]))
    rows = [_COLUMNS, *(_row(agent) for agent in data["agents"])]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
              .rstrip() for row in rows]
    return "\n".join([*lines, *_tls_lines(data)])


def _tls_lines(data: dict[str, Any]) -> list[str]:
    """The link's TLS and each certificate's days left, warnings last."""
    if not data.get("tls"):
        return ["TLS: off: the plant's broker speaks plain MQTT, passwords and prompts in clear"]
    certs = data.get("certificates", [])
    if not certs:
        return ["TLS: on (no certificate of the plant on this box)"]
    width = max(len(cert["path"]) for cert in certs)
    lines = ["TLS: on; certificates:"]
    lines += [f"  {cert['path']:<{width}}  {cert['days_left']:>5} days left  {cert['subject']}"
              for cert in certs]
    lines += [f"warning: {cert['warning']}: run `edgebus certs renew PLANT` (the CA itself: "
              "docs/securing-the-broker.md)" for cert in certs if cert["warning"]]
    return lines


def _row(agent: dict[str, Any]) -> tuple[str, ...]:
    status = agent["status"]
    if status is None:
        return (agent["agent_id"], "-", "-", "-", "-", agent["state"], *["-"] * 10)
    m = status["metrics"]
    stage = status["role"] == "stage"
    layers = status["layers"]
    error = status["last_error"]
    if error is not None and len(error) > _ERROR_CHARS:
        error = error[:_ERROR_CHARS - 1] + "…"
    return (agent["agent_id"], status["role"],
            _num(status["stage"]), f"[{layers[0]}, {layers[1]})" if layers else "-",
            _engine(status.get("engine")), _state(agent["state"], m), _duration(agent["age_s"]),
            # A stage's rate is rows: one per request per decode step, one per prompt chunk.
            _num(m.get("rows_per_s" if stage else "tokens_per_s"), ".1f"),
            "-" if "busy" not in m else f"{m['busy']:.0%}",
            _queue(m), _num(m.get("requests" if stage else "in_flight")),
            _bytes(m.get("kv_bytes")), _bytes(status["rss_bytes"]),
            _duration(status["uptime_s"]), _drafts(m), error or "-")


def _state(state: str, metrics: dict[str, float]) -> str:
    """The agent's state, flagged while it holds deliveries unacknowledged near the broker's
    in-flight window: at INFLIGHT_WINDOW it receives nothing more."""
    unacked = metrics.get("unacked", 0.0)
    if unacked < UNACKED_WARN_AT:
        return state
    return f"{state}, {unacked:.0f}/{INFLIGHT_WINDOW} unacked"


def _queue(metrics: dict[str, float]) -> str:
    """A stage's inbox, or the coordinator's waiting room with its oldest wait ("12, 8s")."""
    waited = metrics.get("oldest_wait_s")
    if not metrics.get("queue") or waited is None:
        return _num(metrics.get("queue"))
    return f"{metrics['queue']:.0f}, {_duration(waited)}"


def _drafts(metrics: dict[str, float]) -> str:
    """The coordinator's drafts taken of those sent (node_agent/speculation.py)."""
    sent = metrics.get("drafts_proposed")
    if not sent:
        return "-"
    taken = metrics.get("drafts_accepted", 0.0)
    return f"{taken:.0f}/{sent:.0f} ({taken / sent:.0%})"


def _engine(engine: dict[str, Any] | None) -> str:
    """What runs a stage, in a few characters: "onnxruntime int4 x1" (x: its threads)."""
    if not engine:
        return "-"
    return f"{engine.get('engine', '?')} {engine.get('weights', '?')} x{engine.get('threads', '?')}"


def _num(value: float | None, spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 1024:
        return f"{value:.0f}B"
    for unit in ("K", "M"):
        value /= 1024
        if value < 1024:
            return f"{value:.1f}{unit}"
    return f"{value / 1024:.1f}G"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def all_online(plant: Plant, data: dict[str, Any]) -> bool:
    """Whether every agent of the plant file is online (others that reported do not count)."""
    known = set(agent_ids(plant))
    return all(a["state"] == "online" for a in data["agents"] if a["agent_id"] in known)
