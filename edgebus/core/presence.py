"""An agent's retained status topic: its birth and death payloads, and the session number
they carry, so MQTT Explorer shows the cluster and a late Will is told from a fresh one."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal


@dataclass
class Presence:
    """Retained status topic with the payloads for birth and death.

    `payload(state, bdseq)` builds either. `bdseq` numbers the MQTT sessions
    (Sparkplug's birth/death sequence): a Will is fixed at connect time, so
    BusClient starts a new number before each connect, and that connection's
    Will and births carry it. A consumer can then tell the late Will of an old
    connection from the death of the current one.
    """

    topic: str
    payload: Callable[[Literal["online", "offline"], int], bytes]
    bdseq: int = 0

    def next_session(self) -> None:
        # The first number is the wall clock in ms, so numbers keep rising
        # across process restarts too: a restarted agent must not reuse a
        # number that its predecessor's Will may still carry.
        self.bdseq = self.bdseq + 1 if self.bdseq else time.time_ns() // 1_000_000

    def online(self) -> bytes:
        return self.payload("online", self.bdseq)

    def offline(self) -> bytes:
        return self.payload("offline", self.bdseq)
