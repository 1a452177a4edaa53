"""The waiting room: requests the plant cannot start yet wait here, bounded, fair across gateways.

A plant starts at most `coordinator.max_in_flight` requests at once, a gateway
at most its share of them (`max_in_flight_per_client`), and a request only once
its route has KV room. A request past these waits for a slot instead of being
refused: an alarm storm of PLCs that rarely retry is served, not answered
`busy`. Each gateway (MQTT client id) has a FIFO of its own, and a freed slot
goes to the gateways in turn (round robin), so one gateway's burst of hundreds
does not push another's single request to the end.

Two limits turn a wait into `busy`, with a retry time: the room holds at most
`coordinator.max_queue` requests (past it a request is refused at once), and a
request waits at most `coordinator.max_wait_s`, or the shorter `max_wait_s` it
asked for. The retry time is how long the requests waiting now will take to
start, at the rate requests have been finishing.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from edgebus.core.errors import RequestError

# Finishes the rate of finishing is measured over: enough to smooth one long request
# among short ones, few enough that the rate follows a plant whose load changed
# within a minute or so (16 rows a step on SmolLM2 finish ~64 requests in seconds).
RATE_WINDOW = 64
# The retry time asked before any request has finished in this run (a storm that
# meets a coordinator just started): a short request on an edge plant takes seconds.
UNMEASURED_RETRY_S = 10.0
# The shortest retry time asked: Retry-After counts whole seconds, and a PLC's
# timers rarely run finer.
MIN_RETRY_S = 1.0


@dataclass(eq=False)
class Place:
    """One request's place in the room: waiting for its turn, or holding a slot."""

    client: str
    arrived: float  # the room's clock
    deadline: float | None  # the room's clock; None: waits as long as it takes
    claim: Callable[[], bool]  # take what the request needs to start; False: not yet
    turn: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop()
                                       .create_future())

    @property
    def started(self) -> bool:
        return self.turn.done() and not self.turn.cancelled() and self.turn.exception() is None


class WaitingRoom:
    """Slots for requests in flight, and the requests waiting for one."""

    def __init__(self, max_in_flight: int, client_limit: int, bound: int, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`bound`: requests that may wait (coordinator.max_queue); 0: none waits."""
        self.max_in_flight = max_in_flight
        self.client_limit = client_limit
        self.bound = bound
        self._clock = clock
        # Per gateway, its waiting requests in arrival order; a dict's order is the
        # round robin's, a gateway served moving to its end.
        self._waiting: dict[str, collections.deque[Place]] = {}
        self._length = 0
        self.running: collections.Counter[str] = collections.Counter()  # slots per gateway
        self._finished: collections.deque[float] = collections.deque(maxlen=RATE_WINDOW)

    def __len__(self) -> int:
        """Requests waiting."""
        return self._length

    @property
    def in_flight(self) -> int:
        return self.running.total()

    def oldest_wait_s(self) -> float:
        """How long the request waiting longest has waited (0 with none waiting)."""
        heads = [queue[0].arrived for queue in self._waiting.values()]
        return self._clock() - min(heads) if heads else 0.0

    def check(self, client: str) -> None:
        """Refuse at once, before any work is spent on it, a request that could neither
        start nor wait."""
        if not self._can_start(client) and self._length >= self.bound:
            raise self._busy(client)

    def enter(self, client: str, claim: Callable[[], bool], *, wait_s: float | None,
              bounded: bool = True) -> Place:
        """A place for `client`'s request: started at once if a slot is free and `claim()`
        takes what it needs, else waiting, its turn to come within `wait_s` (None: no limit).

        Raises RequestError `busy` if it cannot start and the room is full (`bounded`)
        or it may not wait. `bounded` False: a request accepted before a restart, which
        the room takes past its bound.
        """
        now = self._clock()
        place = Place(client, now, None if wait_s is None else now + wait_s, claim)
        # After every change the room has started whatever could start: a waiting request
        # is never one that could take this free slot.
        if self._can_start(client) and claim():
            self._start(place)
            return place
        if wait_s == 0:
            raise self._busy(client, "it asked not to wait (max_wait_s 0)")
        if bounded and self._length >= self.bound:
            raise self._busy(client)
        self._waiting.setdefault(client, collections.deque()).append(place)
        self._length += 1
        return place

    async def wait(self, place: Place) -> None:
        """Until `place`'s turn; past its deadline it leaves the room, refused `busy`."""
        if place.deadline is None:
            await asyncio.shield(place.turn)
            return
        try:
            async with asyncio.timeout(max(0.0, place.deadline - self._clock())):
                await asyncio.shield(place.turn)
        except TimeoutError:
            if place.started:  # its turn came as the deadline passed
                return
            self.leave(place)
            waited = self._clock() - place.arrived
            retry = self.retry_after_s()
            raise RequestError("busy", f"waited {waited:.0f} s for a slot, as long as its "
                               f"max_wait_s allows, with {self._length} requests still "
                               f"waiting: retry in {retry:.0f} s", retry_after_s=retry) from None

    def withdraw(self, place: Place, error: RequestError) -> None:
        """End `place`'s wait with `error` (a cancel from its gateway); a started one is
        left to run."""
        if not place.turn.done():
            self.leave(place)
            place.turn.set_exception(error)

    def leave(self, place: Place) -> None:
        """`place` is done with: its slot, if it held one, goes to the next in turn."""
        if place.started:
            self.running[place.client] -= 1
            if self.running[place.client] <= 0:
                del self.running[place.client]
            self._finished.append(self._clock())
            if not self.running and not self._length:
                # Idle: the next storm's rate is measured afresh, not averaged with a gap.
                self._finished.clear()
            self.dispatch()
            return
        queue = self._waiting.get(place.client)
        if queue is not None and place in queue:
            queue.remove(place)
            self._length -= 1
            if not queue:
                del self._waiting[place.client]

    def dispatch(self) -> None:
        """Start waiting requests while slots are free: the gateways in turn, each its
        oldest first; a gateway at its share, or whose oldest has no KV room yet, is
        passed over."""
        progress = True
        while progress and self._length and self.in_flight < self.max_in_flight:
            progress = False
            for client in list(self._waiting):
                queue = self._waiting[client]
                if self.in_flight >= self.max_in_flight:
                    break
                if self.running[client] >= self.client_limit or not queue[0].claim():
                    continue
                place = queue.popleft()
                self._length -= 1
                # Served: to the end of the round, behind the gateways not served yet.
                del self._waiting[client]
                if queue:
                    self._waiting[client] = queue
                self._start(place)
                progress = True

    def retry_after_s(self) -> float:
        """When a request refused now should come again: the time the requests waiting
        take to start, at the rate requests have finished since the plant was last idle
        (up to RATE_WINDOW of them; a plant that stalls since slows the rate)."""
        if len(self._finished) < 2:
            return UNMEASURED_RETRY_S
        span = self._clock() - self._finished[0]
        rate = (len(self._finished) - 1) / span if span > 0 else float("inf")
        return round(max(MIN_RETRY_S, (self._length + 1) / rate), 1)

    def _can_start(self, client: str) -> bool:
        return self.in_flight < self.max_in_flight and self.running[client] < self.client_limit

    def _start(self, place: Place) -> None:
        self.running[place.client] += 1
        if not place.turn.done():
            place.turn.set_result(None)

    def _busy(self, client: str, also: str | None = None) -> RequestError:
        """`busy` for `client`'s request that cannot start: why, and when to come again;
        `also`: why it cannot wait either, if not the room's bound."""
        retry = self.retry_after_s()
        if self.in_flight >= self.max_in_flight:
            why = (f"{self.in_flight} requests in flight, the limit is {self.max_in_flight} "
                   "(coordinator.max_in_flight)")
        elif self.running[client] >= self.client_limit:
            why = (f"gateway {client} has {self.running[client]} requests in flight, its "
                   f"share of the plant's max_in_flight {self.max_in_flight} is "
                   f"{self.client_limit} (coordinator.max_in_flight_per_client)")
        else:
            why = (f"{self.in_flight} requests in flight hold the KV budget of the stages' "
                   "nodes (kv_budget_mb)")
        if also is not None:
            why += f", and {also}"
        elif self.bound:
            why += (f", and {self._length} wait for a slot, the bound is {self.bound} "
                    "(coordinator.max_queue)")
        return RequestError("busy", f"{why}: retry in {retry:.0f} s", retry_after_s=retry)
