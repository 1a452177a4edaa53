"""What an agent's status says: the payload `{root}/status/{agent_id}` carries.

Built at every heartbeat by the bus client's `Presence` (node_agent/runtime.py
makes it), and read again by the Sparkplug B edge node (node_agent/sparkplug.py),
which reports the latest one.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from edgebus.core import frames, versions
from edgebus.core.messages import AgentStatus

# Counters whose per-second rate each status also carries, under the rate's
# name: a chart of a rate reads at a glance, one of an ever-growing counter
# does not. `tokens` are the coordinator's generated tokens, `rows` the
# request rows a stage computed, `compute_s` a stage's seconds of compute (so
# its rate is the fraction of time the stage was busy).
RATES = {"tokens": "tokens_per_s", "rows": "rows_per_s", "compute_s": "busy"}

# Uptime counts from here: agents import this module (through node_agent/runtime.py) first
# thing, before loading layers.
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
                             pid=os.getpid(), host=socket.gethostname(),
                             version=versions.EDGEBUS, frame_version=frames.VERSION,
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
