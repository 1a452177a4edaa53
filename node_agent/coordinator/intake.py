"""Request intake: a request message parsed, admitted, journaled, generated once, answered.

A request the plant cannot start yet waits in the waiting room
(waiting_room.py), fair across gateways, or is answered `busy` with a retry
time past the room's bound or its deadline. A request is journaled on disk
(node_agent/journal.py) once it is admitted, to start or to wait, and before
it is acknowledged to the broker, and forgotten once its answer has been; a
coordinator that starts answers what its journal holds, in the order the
requests arrived, and the broker delivers again what was never acknowledged.
Answers are remembered by (client, id), so such a redelivery, or a gateway's
retry, gets the first answer again instead of a second generation.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import aiomqtt

from edgebus.core.client import BusClient
from edgebus.core.errors import RequestError
from edgebus.core.messages import (
    CancelRequest,
    ErrorInfo,
    GenerateRequest,
    GenerateResponse,
    parse_request,
    salvage_id,
)
from node_agent.coordinator.delivery import Delivery, ReplyRoute
from node_agent.coordinator.drafting import Drafting
from node_agent.coordinator.generation import Generation
from node_agent.coordinator.routing import Routes
from node_agent.coordinator.token_loop import TokenLoop
from node_agent.coordinator.waiting_room import Place, WaitingRoom
from node_agent.journal import Entry, Journal
from node_agent.reporter import Reporter
from node_agent.text import prompt_ids
from plant_config import Plant
from plant_config.tasks import apply_task

if TYPE_CHECKING:
    from node_agent.text import Tokenizer

log = logging.getLogger(__name__)

# Answers remembered by (client, id), so a QoS 1 redelivery or a gateway's retry
# gets the first answer again instead of a second generation, in bytes of the
# answers (_held_bytes): counted in answers, 4096 answers of 1024 tokens held
# ~200 MB (48.6 KB each, measured with tracemalloc). A gateway sends again within
# seconds, or once the coordinator is back from a restart; 32 MiB hold the last
# ~550 answers of 1024 tokens or ~11000 short ones. Past it the oldest answered
# ids are forgotten first: sent again, such an id is generated again. Ids still
# in flight are never forgotten.
DEDUP_BYTES = 32 * 2**20
# What one remembered answer costs beyond its text and tokens: the key, the
# future and the response's pydantic objects (a short error answer measured
# 2.5 KB in all with tracemalloc, CPython 3.11).
DEDUP_ENTRY_BYTES = 2560
# A token id in a Python list: the pointer and the int object (ids past 256 are
# not shared).
DEDUP_TOKEN_BYTES = 8 + 28
# Errors that ask the gateway to send the request again later: their answers
# are not remembered, so the retry (same id) is served, not answered from memory.
RETRY_LATER = frozenset({"busy", "unavailable", "timeout"})

Key = tuple[str, str]  # (client, request id)


class Answers:
    """The answers of requests by (client, id): in flight, or remembered (DEDUP_BYTES)."""

    def __init__(self) -> None:
        self._futures: collections.OrderedDict[Key, asyncio.Future[GenerateResponse]]
        self._futures = collections.OrderedDict()
        self._bytes: dict[Key, int] = {}  # of answered ones (DEDUP_BYTES)
        self._held = 0  # their sum

    def get(self, key: Key) -> asyncio.Future[GenerateResponse] | None:
        return self._futures.get(key)

    def expect(self, key: Key) -> asyncio.Future[GenerateResponse]:
        """The answer `key` is about to be generated for."""
        answer = self._futures[key] = asyncio.get_running_loop().create_future()
        return answer

    def settle(self, key: Key, answer: asyncio.Future[GenerateResponse],
               response: GenerateResponse) -> None:
        """`answer` is `response`: remembered, unless it asks for a retry."""
        answer.set_result(response)
        if self._futures.get(key) is answer:
            if response.error is not None and response.error.code in RETRY_LATER:
                del self._futures[key]
            else:
                self._remember(key, response)

    def _remember(self, key: Key, response: GenerateResponse) -> None:
        """Count `key`'s answer against DEDUP_BYTES; forget the oldest answers past it."""
        self._bytes[key] = _held_bytes(response)
        self._held += self._bytes[key]
        if self._held <= DEDUP_BYTES:
            return
        for old in list(self._futures):
            if self._held <= DEDUP_BYTES:
                break
            if (size := self._bytes.pop(old, None)) is not None:  # in flight: kept
                del self._futures[old]
                self._held -= size


class Intake:
    """Serves request messages: every one gets an answer, and a request one generation."""

    def __init__(self, plant: Plant, tokenizer: Tokenizer, vocab_size: int, *,
                 journal: Journal, bus: BusClient, delivery: Delivery, routes: Routes,
                 tokens: TokenLoop, drafting: Drafting, active: dict[int, Generation],
                 reporter: Reporter, counters: dict[str, float],
                 track: Callable[[asyncio.Task[None]], asyncio.Task[None]]) -> None:
        """`active`: the requests in flight, by seq; `track(task)` keeps a task among the
        agent's, cancelled when it stops."""
        self.plant = plant
        self.spec = plant.coordinator
        self.topics = plant.topics
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.journal = journal
        self._bus = bus
        self._delivery = delivery
        self._routes = routes
        self._tokens = tokens
        self._drafting = drafting
        self._active = active
        self._reporter = reporter
        self._counters = counters
        self._track = track
        self._answers = Answers()
        # Requests admitted, by key, for cancels: waiting, or in flight.
        self._by_key: dict[Key, tuple[Generation, Place]] = {}
        self.room = WaitingRoom(self.spec.max_in_flight, self.spec.client_limit,
                                self.spec.max_queue)
        # Tokenizing a 256 KiB prompt takes a good fraction of a second: on the event
        # loop it would hold up every other request's step. One thread: requests being
        # admitted are few (the broker's in-flight window) and wait their turn. The
        # loop decodes with the same tokenizer meanwhile: a fast tokenizer without
        # truncation or padding set is only read by both (8 s of both at once with
        # SmolLM2's: no error). A first encode clears what a tokenizer file sets of
        # them, a write, so it happens here, before any thread shares the tokenizer.
        self.tokenizer("")
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="coordinator-tokenize")

    def close(self) -> None:
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)

    def resume(self, entries: Iterable[Entry]) -> None:
        """Serve what a previous run left unanswered in the journal, in the order it arrived:
        requests that were in flight and those that waited take their places in the
        waiting room in that order, the moment the broker connects."""
        for entry in sorted(entries, key=lambda e: e.received or 0.0):
            self._counters["resumed"] += 1
            self._spawn(self.serve_request(entry.client, entry.payload, entry.response_topic,
                                           entry.correlation, ack=_nothing, resumed=entry))

    def on_request(self, message: aiomqtt.Message, bus: BusClient) -> None:
        """Serve a request that came in on `bus` (ours, or a dead peer's session we drain)."""
        client = self.topics.client_of_request_topic(message.topic.value)
        if client is None:
            return
        payload = message.payload if isinstance(message.payload, bytes) else b""
        properties = message.properties
        # Acknowledged once journaled, else when its task ends, whatever its fate.
        self._track(bus.take(message, lambda ack: self.serve_request(
            client, payload, getattr(properties, "ResponseTopic", None) if properties else None,
            getattr(properties, "CorrelationData", None) if properties else None, ack=ack,
            retained=bool(message.retain))))

    def on_cancel(self, client: str, payload: bytes) -> None:
        """End `client`'s request before its next step; its answer says `cancelled`.
        A cancel for a request not in flight (answered, or never seen) has nothing to do."""
        try:
            rid = CancelRequest.model_validate_json(payload).id
        except ValueError as exc:
            self._reporter.report("error", f"bad cancel from {client}: {exc}")
            return
        admitted = self._by_key.get((client, rid))
        if admitted is not None:
            gen, place = admitted
            gen.cancelled = True
            self.room.withdraw(place, RequestError("cancelled", "cancelled by the gateway "
                                                   "while it waited for a slot"))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._track(asyncio.ensure_future(coro))

    async def serve_request(self, client: str, payload: bytes, response_topic: str | None,
                            correlation: bytes | None, *, ack: Callable[[], None],
                            resumed: Entry | None = None, retained: bool = False) -> None:
        """Answer one request message. `ack` acknowledges it to the broker once it is
        journaled (BusClient.take acknowledges it when this ends, if not before);
        `resumed`: its entry, if it comes from the journal; `retained`: the broker
        delivered it as a retained message."""
        received = time.perf_counter()
        try:
            request = apply_task(parse_request(payload), self.plant.tasks)
            if retained:
                # The broker hands a retained message to every new subscription: served,
                # it would be generated again after every restart of the coordinator.
                raise RequestError("retained", f"request {request.id} was published retained, "
                                   "so the broker delivers it again on every subscription: "
                                   "publish requests with retain false, and clear this one "
                                   "with an empty retained message to "
                                   f"{self.topics.request(client)}")
        except RequestError as exc:
            rid = salvage_id(payload)
            self._reporter.report("error", f"bad request from {client}: {exc.message}", rid)
            if rid is not None:
                reply, _ = self._reply_route(client, rid, response_topic, correlation)
                await self._refuse(reply, _error_response(rid, exc), resumed)
            elif resumed is not None:  # no id to answer: still, never again
                await asyncio.to_thread(self.journal.remove, resumed.client, resumed.request_id)
            return
        reply, refused = self._reply_route(client, request.id, request.reply_to or response_topic,
                                           correlation)
        if refused is not None:
            self._reporter.report("error", f"request {request.id} from {client}: "
                                  f"{refused.message}", request.id)
            await self._refuse(reply, _error_response(request.id, refused), resumed)
            return
        key = (client, request.id)
        answer = self._answers.get(key)
        if answer is not None:
            # Sent again (QoS 1, a gateway's retry, or the broker's copy of a
            # journaled request): one generation, one answer. Once answered,
            # the same answer again, for a gateway that may have missed it.
            if answer.done():
                self._delivery.respond(reply, answer.result())
            return
        answer = self._answers.expect(key)
        # The seed is journaled with the request: a resumed request that samples
        # draws the same tokens again, so the deltas a gateway has already
        # streamed stay a prefix of its answer (docs/failover.md).
        seed = (request.seed if request.seed is not None
                else resumed.seed if resumed is not None and resumed.seed is not None
                else secrets.randbits(63))
        entry = Entry(client, request.id, payload, response_topic, correlation, seed,
                      received=time.time())
        journaled = False

        async def admitted() -> None:
            nonlocal journaled
            journaled = await self._journal(request, entry, ack, resumed=resumed is not None)

        if resumed:  # requests came in while the broker is still out of reach
            await self._bus.wait_connected()
        try:
            response = await self._generate(request, reply, received, admitted, key, seed,
                                            resumed=resumed is not None)
        except RequestError as exc:
            if exc.code == "cancelled":  # the gateway's wish, not a fault
                self._counters["cancelled"] += 1
            else:
                self._reporter.report("error", f"request {request.id} from {client}: "
                                      f"{exc.message}", request.id)
            response = _error_response(request.id, exc)
        except Exception as exc:  # a bug must still answer the gateway, never leave it waiting
            log.exception("request %s from %s failed", request.id, client)
            response = _error_response(request.id, RequestError(
                "internal", f"the coordinator failed: {type(exc).__name__}: {exc}"))
        self._answers.settle(key, answer, response)
        await self._delivery.deliver(reply, response)
        if journaled or resumed:
            # Only now: killed before the answer was out, the next run answers it.
            await asyncio.to_thread(self.journal.remove, client, request.id)

    async def _refuse(self, reply: ReplyRoute, response: GenerateResponse,
                      resumed: Entry | None) -> None:
        """Answer a request refused before it was admitted.

        A resumed one (its task renamed, or security turned on, since it was
        journaled) would be refused again at every start: it is answered once,
        delivered, then removed from the journal.
        """
        if resumed is None:
            self._delivery.respond(reply, response)
            return
        await self._bus.wait_connected()
        await self._delivery.deliver(reply, response)
        await asyncio.to_thread(self.journal.remove, resumed.client, resumed.request_id)

    async def _journal(self, request: GenerateRequest, entry: Entry, ack: Callable[[], None], *,
                       resumed: bool) -> bool:
        """Journal an admitted request, then acknowledge it; return whether it was journaled.

        A journal that cannot be written (a full or read-only disk) does not
        stop the request: it is served, and an error says it would not survive
        a restart.
        """
        if resumed:
            return False
        try:
            await asyncio.to_thread(self.journal.add, entry)
        except OSError as exc:
            self._reporter.report("error", f"request {request.id} is served but not journaled "
                                  f"({exc}): it would be lost if the coordinator died. Make "
                                  f"{self.journal.directory} writable (EDGEBUS_HOME)", request.id)
            return False
        finally:
            ack()
        return True

    def _reply_route(self, client: str, request_id: str, asked: str | None,
                     correlation: bytes | None) -> tuple[ReplyRoute, RequestError | None]:
        """Where to answer: the topic the request asked for, else the client's own.

        With `security:` on, the broker lets the coordinator publish answers only
        under the client's response topics; an answer sent elsewhere would be
        dropped by the broker without a word, so such a request is refused instead.
        """
        own = self.topics.response(client, request_id)
        mine = self.topics.response_filter(client).removesuffix("#")
        if asked is not None and self.plant.security is not None and not asked.startswith(mine):
            return ReplyRoute(own, correlation), RequestError(
                "reply_to", f"with broker security on, answers can only go to topics under "
                f"{mine}: leave reply_to and the MQTT 5 response topic unset")
        return ReplyRoute(asked or own, correlation), None

    async def _generate(self, request: GenerateRequest, reply: ReplyRoute, received: float,
                        admitted: Callable[[], Awaitable[None]], key: Key,
                        seed: int, *, resumed: bool = False) -> GenerateResponse:
        """Check the request against the plant's limits, take a place in the waiting room,
        `await admitted()` (journaled, acknowledged), wait for its turn, then generate.

        A resumed request (from the journal) was accepted before the restart: it takes
        its place past the room's bound, and waits as long as it takes. The journal does
        not say whether it had started, and one that had streamed tokens must not be
        refused now.
        """
        spec = self.spec
        if request.max_tokens > spec.max_tokens_limit:
            raise RequestError("max_tokens", f"max_tokens {request.max_tokens} exceeds this "
                               f"plant's limit of {spec.max_tokens_limit}")
        if request.top_k > self.vocab_size:
            raise RequestError("top_k", f"top_k {request.top_k} exceeds the model's vocabulary "
                               f"of {self.vocab_size} tokens: use at most {self.vocab_size}, "
                               "or 0 for no top-k cut")
        wait_s = self._wait_s(request)
        if not resumed:  # before tokenizing: a refused prompt costs nothing
            self.room.check(key[0])
        ids = await asyncio.get_running_loop().run_in_executor(
            self._tokenizer_thread, prompt_ids, self.tokenizer, request)
        if not ids or len(ids) > spec.max_prompt_tokens:
            raise RequestError("prompt_length", f"prompt is {len(ids)} tokens; it must be "
                               f"1..{spec.max_prompt_tokens}")
        gen = Generation(request, reply, history=list(ids), max_len=len(ids) + request.max_tokens,
                         prompt_len=len(ids))
        self._routes.check_fits(gen)
        # Started at once when a slot is free and its KV fits (claimed, routed), else waiting.
        place = self.room.enter(key[0], functools.partial(self._routes.claim, gen),
                                wait_s=None if resumed else wait_s, bounded=not resumed)
        self._by_key[key] = (gen, place)
        try:
            await admitted()
            await self.room.wait(place)
            if spec.speculation.drafts:
                gen.drafts = self._drafting.start()
            self._active[gen.seq] = gen
            try:
                return await self._tokens.generate(gen, seed, received)
            finally:
                del self._active[gen.seq]
        finally:
            del self._by_key[key]
            self._routes.unroute(gen)  # KV claimed for a start that never came
            self.room.leave(place)

    def _wait_s(self, request: GenerateRequest) -> float:
        """How long `request` may wait for a slot: what it asked, within the plant's limit."""
        limit = self.spec.max_wait_s
        if request.max_wait_s is None:
            return limit
        if request.max_wait_s > limit:
            raise RequestError("max_wait", f"max_wait_s {request.max_wait_s:g} exceeds this "
                               f"plant's coordinator.max_wait_s of {limit:g} s: ask for at most "
                               "that, or leave it out to wait as long as the plant allows")
        return request.max_wait_s


def _nothing() -> None:
    """The acknowledgement of a request that needs none (resumed from the journal)."""


def _held_bytes(response: GenerateResponse) -> int:
    """About what remembering `response` costs in memory (DEDUP_BYTES): a character
    takes up to 4 bytes in a Python str."""
    text = len(response.text) + (len(response.error.message) if response.error else 0)
    return DEDUP_ENTRY_BYTES + 4 * text + DEDUP_TOKEN_BYTES * len(response.tokens)


def _error_response(request_id: str, exc: RequestError) -> GenerateResponse:
    return GenerateResponse(id=request_id, finish_reason="error",
                            error=ErrorInfo(code=exc.code, message=exc.message,
                                            retry_after_s=exc.retry_after_s))
