"""`edgebus http PLANT`: the OpenAI HTTP API, served by a plain MQTT gateway of the plant.

    HTTP client --POST /v1/chat/completions--> gateway --GenerateRequest--> coordinator
                <--JSON or SSE chunks---------         <--StreamDelta...,
                                                          GenerateResponse--

The gateway holds no state beyond the requests in flight: each becomes a
`GenerateRequest` with a random id under the gateway's identity, so several
gateway processes can share one identity side by side, each reading only
the answers to its own ids. It always asks the coordinator to stream, so it
hears of progress token by token: its timeout is then a time without word
from the plant, and a long answer is never cut short for being long.

When an HTTP client goes away before its answer is complete, the gateway
publishes a cancel for the request, and the coordinator ends it and frees
its KV caches on every stage.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiomqtt
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send

from broker.exposure import is_loopback
from edgebus.core.client import BusClient
from edgebus.core.errors import BusError, EdgebusError, PlantConfigError
from edgebus.core.messages import (
    MAX_REQUEST_BYTES,
    ErrorInfo,
    GenerateRequest,
    GenerateResponse,
    StreamDelta,
    describe,
    unbounded_number,
)
from edgebus.core.statuses import StatusReader
from edgebus.gateways.api_keys import ApiKeys, read_api_key
from edgebus.gateways.openai_schema import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    Completion,
    CompletionChoice,
    CompletionRequest,
    ErrorBody,
    ErrorResponse,
    ModelCard,
    ModelList,
    UsageOut,
    finish_reason,
)
from plant_config import Plant
from plant_config.loader import DEFAULT_HTTP_GATEWAY

log = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:8000"
# An HTTP body becomes one MQTT request of about its size, which the
# coordinator refuses past MAX_REQUEST_BYTES: a bigger body is refused here,
# before it is read whole.
MAX_BODY_BYTES = MAX_REQUEST_BYTES
# What a 429 of this gateway's own limit asks a client to wait. A request on an edge
# plant takes seconds, so a second or two frees a slot; OpenAI's clients honour it and
# back off. The coordinator's `busy` says how long itself (retry_after_s).
RETRY_AFTER_S = 2
# How long start-up waits for the broker connection before serving anyway
# (requests get 503 until it is up): a broker restarting takes a second or two.
CONNECT_WAIT_S = 10.0
# How long a request waits for the coordinator's retained status when the
# gateway has not seen it yet: the broker sends it right after subscribing.
STATUS_WAIT_S = 5.0
# Messages a request may have waiting beyond one per token and its answer:
# QoS 1 duplicates after a reconnect, dropped here if they ever pile up.
QUEUE_SLACK = 16
# Connections and requests uvicorn serves at once beyond the gateway's requests in
# flight (--max-in-flight): idle keep-alive connections, /v1/models and 429s
# answered on the spot. Past max_in_flight plus this, uvicorn answers 503 at once,
# before reading the request: without a bound every connection of a client that
# opens them in a loop costs a task and a socket.
EXTRA_CONNECTIONS = 64
# Coordinator error codes that mean the request itself must change.
_CLIENT_ERRORS = frozenset({"too_large", "not_utf8", "invalid_json", "invalid_request", "top_k",
                            "reply_to", "max_tokens", "prompt_length", "too_long",
                            "max_wait"})
# The others that have a status of their own; any other code is the plant failing (502).
_PLANT_STATUS = {"busy": 429, "unavailable": 503, "timeout": 504}
_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error"}

_Model = TypeVar("_Model", bound=BaseModel)


class HttpError(Exception):
    """An error answer: its status, and OpenAI's error object."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = ErrorBody(message=message, code=code, param=param,
                              type=_ERROR_TYPE.get(status, "server_error"))
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.body).model_dump(), self.status,
                            headers=self.headers)


def busy(message: str, code: str = "busy", retry_after_s: float = RETRY_AFTER_S) -> HttpError:
    # Retry-After counts whole seconds: rounded up, so a client never comes back too early.
    return HttpError(429, message, code=code,
                     headers={"Retry-After": str(math.ceil(retry_after_s))})


def plant_error(error: ErrorInfo) -> HttpError:
    """The HTTP answer to the coordinator's error response."""
    if error.code == "busy":
        return busy(error.message, retry_after_s=error.retry_after_s or RETRY_AFTER_S)
    status = 400 if error.code in _CLIENT_ERRORS else _PLANT_STATUS.get(error.code, 502)
    return HttpError(status, error.message, code=error.code)


@dataclass
class Pending:
    """One request in flight: the plant's messages for it, in order, once each."""

    request: GenerateRequest
    queue: asyncio.Queue[StreamDelta | GenerateResponse]
    index: int = -1  # the last delta's index: QoS 1 may deliver one twice
    sent: list[str] = field(default_factory=list)  # the text handed out so far
    answered: bool = False

    def put(self, item: StreamDelta | GenerateResponse) -> None:
        if isinstance(item, StreamDelta):
            if item.index <= self.index:
                return
            self.index = item.index
        try:
            self.queue.put_nowait(item)
        except asyncio.QueueFull:
            log.warning("request %s: more messages than it has tokens; dropped one",
                        self.request.id)

    async def next(self, timeout: float) -> str | GenerateResponse:
        """The next text delta, or the answer; HttpError 504 after `timeout` s without word."""
        try:
            async with asyncio.timeout(timeout):
                item = await self.queue.get()
        except TimeoutError:
            raise HttpError(504, f"no word from the plant for {timeout:.0f} s on request "
                                 f"{self.request.id}: is the coordinator running?",
                            code="timeout") from None
        if isinstance(item, StreamDelta):
            self.sent.append(item.delta)
            return item.delta
        self.answered = True
        return item

    async def answer(self, timeout: float) -> GenerateResponse:
        while not isinstance(item := await self.next(timeout), GenerateResponse):
            pass
        return item

    def rest(self, response: GenerateResponse) -> str:
        """The answer's text not yet handed out (deltas lost on a reconnect).

        HttpError (code `stream_diverged`) if the text handed out is not where
        the answer begins: a request served again from the start (a restarted
        coordinator) that drew other tokens. The client must not get two runs
        stitched into one text.
        """
        sent = "".join(self.sent)
        if response.text.startswith(sent):
            return response.text[len(sent):]
        log.warning("request %s: streamed text is not a prefix of the answer", self.request.id)
        raise HttpError(502, f"request {self.request.id} was served again from the start and "
                             "gave another text than the one streamed so far: send it again",
                        code="stream_diverged")


class Gateway:
    """The plant's MQTT side: requests out, answers routed back to their HTTP requests."""

    def __init__(self, plant: Plant, client_id: str, *, timeout_s: float,
                 max_in_flight: int) -> None:
        self.plant = plant
        self.client_id = client_id
        self.timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        self.topics = plant.topics
        self.pending: dict[str, Pending] = {}
        self._prefix = self.topics.response_filter(client_id).removesuffix("#")
        self._status_topic = self.topics.status(plant.coordinator.id)
        # With several coordinator instances each has a status of its own,
        # which a gateway's ACL does not let it read: then it does not check.
        self._check_coordinator = not plant.coordinator.instances
        self._coordinator: str | None = None  # its last state, once seen
        self._status_seen = asyncio.Event()
        self._statuses = StatusReader(log.warning)
        # The MQTT client id is this process's own: gateways sharing an
        # identity must not take each other's connection.
        self.bus = BusClient(plant.endpoint_for(client_id),
                             f"{plant.plant_id}.{client_id}.{secrets.token_hex(4)}",
                             subscriptions=[(self.topics.response_filter(client_id), 1),
                                            (self._status_topic, 1)])

    async def run(self) -> None:
        await self.bus.run(self._on_message)

    def _on_message(self, message: aiomqtt.Message) -> None:
        payload = message.payload if isinstance(message.payload, bytes) else b""
        topic = message.topic.value
        try:
            if topic == self._status_topic:
                status = self._statuses.read(self.plant.coordinator.id, payload, "coordinator")
                if status is not None:
                    self._coordinator = status.state
                    self._status_seen.set()
                return
            rid, _, tail = topic.removeprefix(self._prefix).partition("/")
            pending = self.pending.get(rid)
            if pending is None:  # another gateway's, or one whose client left
                return
            if tail == "stream":
                pending.put(StreamDelta.model_validate_json(payload))
            elif not tail:
                pending.put(GenerateResponse.model_validate_json(payload))
        except ValidationError as exc:
            log.warning("ignoring a malformed message on %s: %s", topic, exc)

    async def submit(self, request: GenerateRequest) -> Pending:
        """Send `request`; the caller must `release` what it returns."""
        if len(self.pending) >= self.max_in_flight:
            raise busy(f"{len(self.pending)} requests in flight at this gateway, its limit "
                       "(edgebus http --max-in-flight): retry later")
        pending = Pending(request, asyncio.Queue(request.max_tokens + QUEUE_SLACK))
        self.pending[request.id] = pending  # before any await: the in-flight count holds
        try:
            await self._check_plant()
            await self.bus.publish(self.topics.request(self.client_id),
                                   request.model_dump_json(exclude_none=True), qos=1)
        except BusError as exc:
            self.pending.pop(request.id, None)
            raise HttpError(503, f"no connection to the plant's broker: {exc}",
                            code="unavailable") from None
        except BaseException:
            self.pending.pop(request.id, None)
            raise
        return pending

    async def _check_plant(self) -> None:
        if not self.bus.connected:
            raise HttpError(503, f"the gateway is not connected to the broker at "
                                 f"{self.bus.endpoint.host}:{self.bus.endpoint.port}; it keeps "
                                 "trying: retry later", code="unavailable")
        if not self._check_coordinator:
            return
        if not self._status_seen.is_set():
            with suppress(TimeoutError):
                async with asyncio.timeout(STATUS_WAIT_S):
                    await self._status_seen.wait()
        if self._coordinator != "online":
            raise HttpError(503, f"coordinator {self.plant.coordinator.id!r} is not online "
                                 f"(its status at {self._status_topic} is "
                                 f"{self._coordinator or 'missing'}): start the plant "
                                 "(`edgebus up PLANT`)", code="unavailable")

    def release(self, pending: Pending) -> None:
        """Forget `pending`, and cancel it at the coordinator unless it was answered.

        Synchronous, so it runs whole even in a task being cancelled by a client's disconnect.
        """
        if self.pending.pop(pending.request.id, None) is None or pending.answered:
            return
        log.info("request %s ended here before its answer (the HTTP client left, or no word "
                 "in time); cancelling it", pending.request.id)
        self.bus.send(self.topics.cancel(self.client_id),
                      json.dumps({"id": pending.request.id}), qos=1)


class _Stream(EventSourceResponse):
    """An SSE response that runs `close` however it ends: done, failed or disconnected."""

    def __init__(self, content: AsyncIterator[str], close: Callable[[], None]) -> None:
        super().__init__(content, sep="\n")
        self._close = close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._close()


async def _disconnected(request: Request) -> None:
    """Return once the HTTP client has gone (call after the body is read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, work: Awaitable[Any]) -> Any:
    """`await work`, or raise HttpError 499 (nginx's "client closed request", which nobody
    will read) once the client disconnects."""
    job, gone = asyncio.ensure_future(work), asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({job, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (job, gone):
            task.cancel()
        await asyncio.gather(job, gone, return_exceptions=True)
    if not job.done() or job.cancelled():
        raise HttpError(499, "the HTTP client disconnected", code="cancelled")
    return job.result()


def _invalid(exc: ValidationError) -> HttpError:
    """A 400 that says what to fix, naming the first field (OpenAI's `param`)."""
    errors = exc.errors()
    first = ".".join(str(p) for p in errors[0]["loc"]) if errors else ""
    return HttpError(400, describe(exc, whole="body"), code="invalid_request",
                     param=first or None)


def _parse(model: type[_Model], body: bytes) -> _Model:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        # pydantic's JSON parser names only the column of a number too large for it.
        if any(err["type"] == "json_invalid" for err in exc.errors()) and (
                found := unbounded_number(body)) is not None:
            raise HttpError(400, f"{found[0]}: {found[1]}", code="invalid_request",
                            param=found[0]) from None
        raise _invalid(exc) from None


def _usage(response: GenerateResponse) -> UsageOut:
    usage = response.usage
    return UsageOut(prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens,
                    total_tokens=usage.prompt_tokens + usage.completion_tokens)


class _Shape:
    """How one endpoint's answers and stream chunks look."""

    def __init__(self, chat: bool, rid: str, model: str) -> None:
        self.chat, self.id, self.model = chat, f"{'chatcmpl' if chat else 'cmpl'}-{rid}", model
        self.created = int(time.time())

    def answer(self, response: GenerateResponse) -> BaseModel:
        finish = finish_reason(response.finish_reason)
        if self.chat:
            return ChatCompletion(
                id=self.id, created=self.created, model=self.model, usage=_usage(response),
                choices=[ChatChoice(message=AssistantMessage(content=response.text),
                                    finish_reason=finish)])
        return Completion(id=self.id, created=self.created, model=self.model,
                          usage=_usage(response),
                          choices=[CompletionChoice(text=response.text, finish_reason=finish)])

    def chunk(self, text: str | None, *, finish: GenerateResponse | None = None,
              role: bool = False) -> str:
        reason = None if finish is None else finish_reason(finish.finish_reason)
        chunk: BaseModel
        if self.chat:
            delta = ChatDelta(role="assistant" if role else None, content=text)
            chunk = ChatCompletionChunk(
                id=self.id, created=self.created, model=self.model,
                choices=[ChatChunkChoice(delta=delta, finish_reason=reason)])
        else:
            chunk = Completion(id=self.id, created=self.created, model=self.model,
                               choices=[CompletionChoice(text=text or "", finish_reason=reason)])
        return chunk.model_dump_json(exclude_none=self.chat)

    def usage_chunk(self, response: GenerateResponse) -> str:
        chunk: BaseModel
        if self.chat:
            chunk = ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                        choices=[], usage=_usage(response))
        else:
            chunk = Completion(id=self.id, created=self.created, model=self.model, choices=[],
                               usage=_usage(response))
        return chunk.model_dump_json()


def create_app(plant: Plant, gateway: Gateway, keys: ApiKeys) -> FastAPI:
    """The ASGI app: OpenAI's endpoints over `gateway`; `keys` empty admits anyone."""
    model_name = plant.model.name
    models = {model_name, plant.plant_id}
    app = FastAPI(title=f"edgebus {plant.plant_id}", docs_url=None, redoc_url=None,
                  openapi_url=None)

    @app.exception_handler(HttpError)
    async def _http_error(_: Request, exc: HttpError) -> Response:
        return exc.response()

    @app.exception_handler(HTTPException)
    async def _starlette_error(_: Request, exc: HTTPException) -> Response:
        return HttpError(exc.status_code, str(exc.detail)).response()

    def authorize(request: Request) -> None:
        if not keys:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not keys.admits(key.strip()):
            raise HttpError(401, "a valid API key is required: send `Authorization: Bearer KEY` "
                                 "with a key from the plant's credentials directory "
                                 "(security.api_keys)", code="invalid_api_key")

    async def body(request: Request) -> bytes:
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            raise HttpError(413, f"the request body is {length} bytes; the limit is "
                                 f"{MAX_BODY_BYTES}", code="too_large")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_BODY_BYTES:
                raise HttpError(413, f"the request body is over the limit of {MAX_BODY_BYTES} "
                                     "bytes", code="too_large")
        return bytes(data)

    def check_model(name: str | None) -> None:
        if name is not None and name not in models:
            raise HttpError(404, f"model {name!r} is not served here: this plant serves "
                                 f"{model_name!r} (GET /v1/models)", code="model_not_found",
                            param="model")

    async def complete(request: Request, asked: ChatCompletionRequest | CompletionRequest,
                       chat: bool) -> Response:
        check_model(asked.model)
        rid = secrets.token_hex(12)  # 96 bits: unique across every gateway of the identity
        try:
            generate = asked.to_generate(rid)
        except ValidationError as exc:
            raise _invalid(exc) from None
        shape = _Shape(chat, rid, model_name)
        pending = await gateway.submit(generate)
        try:
            if not asked.stream:
                response = await _unless_gone(request, pending.answer(gateway.timeout_s))
                if response.error is not None:
                    raise plant_error(response.error)
                return JSONResponse(shape.answer(response).model_dump(mode="json"))
            # The status line waits for the plant's first word, so that a request it
            # refuses gets its own status, not a 200 with an error inside.
            first = await _unless_gone(request, pending.next(gateway.timeout_s))
            if isinstance(first, GenerateResponse) and first.error is not None:
                raise plant_error(first.error)
        except BaseException:
            gateway.release(pending)
            raise
        return _Stream(_events(pending, shape, first, asked.include_usage, gateway.timeout_s),
                       lambda: gateway.release(pending))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        return await complete(request, _parse(ChatCompletionRequest, await body(request)), True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        return await complete(request, _parse(CompletionRequest, await body(request)), False)

    @app.get("/v1/models")
    async def list_models(request: Request) -> Response:
        authorize(request)
        card = ModelCard(id=model_name, created=int(plant.model.stat().st_mtime),
                         owned_by=plant.plant_id)
        return JSONResponse(ModelList(data=[card]).model_dump())

    return app


async def _events(pending: Pending, shape: _Shape, first: str | GenerateResponse,
                  include_usage: bool, timeout: float) -> AsyncIterator[str]:
    """The SSE data lines of one stream, ending in [DONE]. A failure after the status line
    is out goes as an error object in the stream, which OpenAI's clients raise."""
    if shape.chat:  # OpenAI's streams open with the role
        yield shape.chunk("", role=True)
    item = first
    try:
        while isinstance(item, str):
            if item:
                yield shape.chunk(item)
            item = await pending.next(timeout)
    except HttpError as exc:
        yield ErrorResponse(error=exc.body).model_dump_json()
        return
    if item.error is not None:
        yield ErrorResponse(error=plant_error(item.error).body).model_dump_json()
        return
    try:
        rest = pending.rest(item)
    except HttpError as exc:
        yield ErrorResponse(error=exc.body).model_dump_json()
        return
    if rest:
        yield shape.chunk(rest)
    yield shape.chunk(None, finish=item)
    if include_usage:
        yield shape.usage_chunk(item)
    yield "[DONE]"


def parse_listen(listen: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets) as (host, port)."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise EdgebusError(f"--listen {listen!r}: give HOST:PORT, e.g. {DEFAULT_LISTEN}")
    return host.removeprefix("[").removesuffix("]"), int(port)


def load_keys(plant: Plant) -> ApiKeys:
    """The API keys requests must present: none without `security:`, else at least one."""
    security = plant.security
    if security is None:
        return ApiKeys([])
    if not security.api_keys:
        raise PlantConfigError(
            "security: is on, so the HTTP gateway admits only requests with an API key, but "
            "security.api_keys names none — add `api_keys: [http-1]` under security: and make "
            "its key file: (umask 077 && head -c 32 /dev/urandom | base64 > "
            f"{security.credentials}/http-1.api-key)")
    return ApiKeys(read_api_key(security.credentials, name) for name in security.api_keys)


class HttpGateway:
    """`edgebus http`: checks the plant and the listen address, then serves until stopped."""

    def __init__(self, plant: Plant, *, listen: str = DEFAULT_LISTEN,
                 client_id: str | None = None, timeout_s: float | None = None,
                 max_in_flight: int | None = None) -> None:
        self.host, self.port = parse_listen(listen)
        if plant.security is None and not is_loopback(self.host):
            raise EdgebusError(
                f"the HTTP gateway would listen on {self.host or '*'}:{self.port}, beyond this "
                "box's loopback, with no API key required: the plant file has no security: "
                "section, so anyone who reaches the port could use the model. Refusing to "
                "start. To fix it, give the plant file a security: section with api_keys "
                "(`edgebus init` writes one unless it is given --insecure; docs/http.md), or "
                f"listen on the loopback: --listen {DEFAULT_LISTEN}")
        self.keys = load_keys(plant)
        self.client_id = client_id or DEFAULT_HTTP_GATEWAY
        if plant.security is not None and self.client_id not in plant.security.gateways:
            raise PlantConfigError(
                f"gateway identity {self.client_id!r} is not in the plant's security.gateways "
                f"({', '.join(plant.security.gateways) or 'none'}): add it there, give it a "
                "password (`edgebus broker mosquitto-config PLANT OUTDIR`) and restart the "
                "broker, or pass --client with a gateway that is listed")
        self.plant = plant
        # The coordinator answers within these itself (`busy` after max_wait_s in its
        # waiting room, `unavailable` after stage_wait_s, a step's `timeout` after
        # request_timeout_s), so the gateway's own 504 is for a coordinator that says
        # nothing at all.
        timeout = timeout_s or (plant.coordinator.max_wait_s + plant.coordinator.request_timeout_s
                                + plant.liveness.stage_wait_s)
        # More than the coordinator starts from one gateway and its waiting room holds
        # would only be refused there; fewer would turn away what the plant could serve.
        limit = max_in_flight or plant.coordinator.client_limit + plant.coordinator.max_queue
        self.gateway = Gateway(plant, self.client_id, timeout_s=timeout, max_in_flight=limit)
        self.server = uvicorn.Server(uvicorn.Config(
            create_app(plant, self.gateway, self.keys), host=self.host, port=self.port,
            log_config=None, access_log=False, lifespan="off",
            limit_concurrency=limit + EXTRA_CONNECTIONS))

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    async def serve(self) -> None:
        """Connect to the broker, then serve HTTP until `stop` (or SIGINT/SIGTERM)."""
        runner = asyncio.create_task(self.gateway.run())
        try:
            connected = asyncio.ensure_future(self.gateway.bus.wait_connected())
            await asyncio.wait({runner, connected}, timeout=CONNECT_WAIT_S,
                               return_when=asyncio.FIRST_COMPLETED)
            connected.cancel()
            if runner.done():  # the broker refused us (BusError says why)
                runner.result()
            if not self.gateway.bus.connected:
                endpoint = self.gateway.bus.endpoint
                log.warning("broker %s:%d not reachable yet; requests get 503 until it is",
                            endpoint.host, endpoint.port)
            log.info("serving the OpenAI API of plant %r (model %r) at %s as gateway %r; %s",
                     self.plant.plant_id, self.plant.model.name, self.url, self.client_id,
                     "an API key is required" if self.keys else "no API key (no security:)")
            await self.server.serve()
        finally:
            runner.cancel()
            with suppress(asyncio.CancelledError):
                await runner

    def stop(self) -> None:
        self.server.should_exit = True
