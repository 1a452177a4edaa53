"""Agents' statuses as read off the bus: a status speaks only for the agent its topic names.

Whose status a message is comes from its topic (`Topics.agent_of_status_topic`):
a secured broker lets each identity write only `{root}/status/<itself>`
(broker/acl.py), while the JSON says whatever its sender wrote, and on an open
broker any client writes any topic. A payload whose `agent_id`, or `role`,
contradicts its topic is therefore malformed: every reader drops it, and it
changes nothing (no agent marked offline, no request replayed). Taking it as
the topic's agent's own status instead let a client publishing
`{"agent_id": "stage-1", "state": "offline"}` on stage-0's topic every 0.3 s
take stage-0 down and replay its requests, again and again.

Each drop is counted, and warned about at a bounded rate: a spoof repeated
every 0.3 s must not become a log line or an event every 0.3 s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import ValidationError

from edgebus.core.messages import AgentStatus

# At most one warning per status topic this often. A minute shows a spoof that
# goes on (each warning counts the drops since the last) without burying the log.
WARN_EVERY_S = 60.0

Role = Literal["stage", "coordinator"]


@dataclass
class _Drops:
    unreported: int = 0  # dropped since the last warning
    warned: float | None = None  # time.monotonic() of the last warning


class StatusReader:
    """Parses statuses; drops, counts and warns about (`warn`) those that contradict their topic."""

    def __init__(self, warn: Callable[[str], None]) -> None:
        self._warn = warn
        self._drops: dict[str, _Drops] = {}
        self.dropped = 0  # in all, for an agent's metrics

    def read(self, agent: str, payload: bytes | str,
             role: Role | None = None) -> AgentStatus | None:
        """The status in `payload`, published on `agent`'s status topic, or None.

        None for a payload that is no status (another tool's retained message:
        nothing to say) and for one that names another agent, or another role
        than `role` when the reader knows the agent's role (dropped, warned about).
        """
        try:
            status = AgentStatus.model_validate_json(payload)
        except ValidationError:
            return None
        claims = [f"agent_id {status.agent_id!r}"] if status.agent_id != agent else []
        if role is not None and status.role != role:
            claims.append(f"role {status.role!r} ({agent} is a {role})")
        if not claims:
            return status
        self._drop(agent, " and ".join(claims))
        return None

    def _drop(self, agent: str, claims: str) -> None:
        self.dropped += 1
        drops = self._drops.setdefault(agent, _Drops())
        drops.unreported += 1
        now = time.monotonic()
        if drops.warned is not None and now - drops.warned < WARN_EVERY_S:
            return
        since = f" in {now - drops.warned:.0f} s" if drops.warned is not None else ""
        count, drops.unreported, drops.warned = drops.unreported, 0, now
        self._warn(
            f"dropped {count} status message(s){since} on the status topic of {agent} that "
            f"claim {claims}: a status speaks only for the agent its topic names, so these "
            "changed nothing. Some client other than the agent publishes there: find it in "
            "the broker's log, and secure the broker (the plant file's `security:`) so that "
            "each agent may write only its own status")
