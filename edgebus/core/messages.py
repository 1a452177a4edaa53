"""The JSON messages of the gateway contract and of the ops view (pydantic).

A gateway (PLC/SCADA bridge) publishes `GenerateRequest` to
`{root}/llm/request/{client_id}` and reads `GenerateResponse` from
`{root}/llm/response/{client_id}/{id}`. Agents publish `AgentStatus`, retained,
to `{root}/status/{agent_id}` and `Event` to `{root}/events`.
"""

from __future__ import annotations

import json
import math
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from edgebus.core.errors import RequestError
from edgebus.core.topics import check_level

# A request is a prompt plus knobs; 256 KiB holds a ~60k-token prompt, far past
# any edge model's context, and bounds what one gateway can make us parse.
MAX_REQUEST_BYTES = 256 * 1024
# The contract says request ids are <= 64 chars: they become a topic level.
MAX_ID_CHARS = 64
MAX_STOP_STRINGS = 16
# The text generator holds back as much of the output as the longest stop string
# (it could be that string's start), and checks each step against it: a stop
# string is a marker such as "</answer>" or "\n\n", and 256 characters leave room
# for any such marker while keeping that work per token small.
MAX_STOP_CHARS = 256
# The largest top_k the frame header can carry (a 16-bit field, edgebus/core/frames.py);
# the coordinator also refuses one above its model's vocabulary.
MAX_TOP_K = 2**16 - 1
# Characters of one JSON number. A 64-bit integer is 20 with its sign and a double's
# shortest form 24; 40 leaves room for the trailing zeros a PLC's formatter adds.
# Longer numbers are refused before Python converts them: an integer of more than
# 4300 digits makes json.loads raise a plain ValueError, and converting a long one
# costs time quadratic in its length.
MAX_NUMBER_CHARS = 40
# A task's variables are a PLC's tag values: a handful, never a table.
MAX_TASK_VARS = 64
# The longest wait for a start a request can ask for (a day): the plant's own
# coordinator.max_wait_s bounds it further; this keeps the number a plain one anywhere.
MAX_WAIT_S = 86400.0

# A task variable's value, as JSON gives it (plant_config/tasks.py checks its declared type).
# parse_request bounds its numbers (MAX_NUMBER_CHARS, finite).
VarValue = str | int | float | bool
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ChatMessage(_Strict):
    role: str = Field(min_length=1, max_length=32)
    content: str


class GenerateRequest(_Strict):
    id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    # A PLC task: a template of the plant file, filled in with `vars`.
    task: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    vars: dict[str, VarValue] | None = Field(default=None, max_length=MAX_TASK_VARS)
    # The plant's max_tokens_limit is checked by the coordinator (code `max_tokens`);
    # this bound only keeps the number a 32-bit one wherever it travels.
    max_tokens: int = Field(default=128, ge=1, lt=2**31)
    temperature: float = Field(default=0.0, ge=0.0, le=10.0)
    top_k: int = Field(default=0, ge=0, le=MAX_TOP_K)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: list[StopString] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    ignore_eos: bool = False
    stream: bool = False
    reply_to: str | None = Field(default=None, min_length=1, max_length=512)
    # Seconds it may wait for the plant to start it, at most the plant's
    # coordinator.max_wait_s (a longer one is refused, code `max_wait`); past it, `busy`.
    # 0: answered `busy` at once if it cannot start. None: the plant's.
    max_wait_s: float | None = Field(default=None, ge=0.0, le=MAX_WAIT_S)

    @field_validator("id")
    @classmethod
    def _id_is_topic_level(cls, value: str) -> str:
        return check_level(value, "id")

    @field_validator("reply_to")
    @classmethod
    def _reply_to_is_topic(cls, value: str | None) -> str | None:
        if value is not None and ("+" in value or "#" in value or "\x00" in value):
            raise ValueError("reply_to must be a topic name, without '+' or '#' wildcards")
        return value

    @model_validator(mode="after")
    def _one_kind_of_prompt(self) -> GenerateRequest:
        given = [self.prompt, self.messages, self.task]
        if sum(value is not None for value in given) != 1:
            raise ValueError("give exactly one of 'prompt' (text used verbatim), 'messages' "
                             "(a chat, formatted with the model's chat template) or 'task' "
                             "(a template of the plant file, filled in with 'vars')")
        if self.vars is not None and self.task is None:
            raise ValueError("'vars' fill in a task's template: give 'task' with them")
        return self


class CancelRequest(_Strict):
    """Published to `{root}/llm/cancel/{client_id}`: end that client's request `id`."""

    id: str = Field(min_length=1, max_length=MAX_ID_CHARS)


class ErrorInfo(BaseModel):
    code: str
    message: str
    # With `busy`: seconds to wait before sending the request again (same id).
    retry_after_s: float | None = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int


class Timings(BaseModel):
    ttft_ms: float | None
    total_ms: float


FinishReason = Literal["stop", "length", "error"]


class SpeculationUsage(BaseModel):
    """What drafting did for one request (node_agent/speculation.py)."""

    proposed: int  # drafts sent
    accepted: int  # drafts that were the next token
    rejected: int  # drafts thrown away: rolled back, or never reached
    runs: int  # tokens sent as fresh frames while drafting; each started a run of drafts
    from_cache: int = 0  # of the proposed, drafts from the plant's recent answers

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


class GenerateResponse(BaseModel):
    id: str
    text: str = ""
    tokens: list[int] = Field(default_factory=list)
    finish_reason: FinishReason
    usage: Usage = Usage(prompt_tokens=0, completion_tokens=0)
    timings: Timings = Timings(ttft_ms=None, total_ms=0.0)
    error: ErrorInfo | None = None
    # Set where the plant drafts (coordinator.speculation.drafts > 0).
    speculation: SpeculationUsage | None = None


class StreamDelta(BaseModel):
    id: str
    index: int
    delta: str


class AgentStatus(BaseModel):
    state: Literal["online", "offline"]
    role: Literal["stage", "coordinator"]
    agent_id: str
    stage: int | None = None
    layers: list[int] | None = None
    pid: int
    host: str
    version: str
    ts: float = Field(default_factory=time.time)
    # Birth/death sequence (Sparkplug's bdSeq): one more on every (re)connect,
    # and a Will carries its birth's. A new bdseq means a new MQTT session.
    bdseq: int = 0
    rss_bytes: int | None = None  # resident memory; None off Linux
    uptime_s: float | None = None  # since the agent process started, loading included
    last_error: str | None = None  # the last error event this agent published
    last_error_ts: float | None = None
    # Counters an operator can chart in MQTT Explorer, e.g. compute_s, rows, in_flight.
    metrics: dict[str, float] = Field(default_factory=dict)
    # A stage's engine as it runs: engine, weights, device, threads and the kernel
    # options it measured and chose on this box (node_agent/engines/).
    engine: dict[str, str | int | float] | None = None


class PlanStage(BaseModel):
    index: int
    layers: list[int]  # [first, last + 1)
    nodes: list[str]  # the nodes that can run it: replicas, in the plant file's order


class Plan(BaseModel):
    """The active partition, retained on `{root}/plan` by the coordinator."""

    plant_id: str
    coordinator: str
    stages: list[PlanStage]
    ts: float = Field(default_factory=time.time)


class Event(BaseModel):
    kind: Literal["join", "leave", "error", "warning"]
    agent_id: str
    message: str
    request_id: str | None = None
    ts: float = Field(default_factory=time.time)
    # 0: an event of its own. N > 0: a summary of N events the agent did not
    # publish, past its rate limit (node_agent/reporter.py); its log has each.
    held_back: int = 0


def parse_request(payload: bytes, *, max_bytes: int = MAX_REQUEST_BYTES) -> GenerateRequest:
    """Parse a gateway request, raising RequestError with a message that says what to fix."""
    if len(payload) > max_bytes:
        raise RequestError("too_large",
                           f"request is {len(payload)} bytes; the limit is {max_bytes}")
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError("not_utf8", f"request is not UTF-8 ({exc.reason} at byte "
                                       f"{exc.start}): send JSON encoded as UTF-8") from None
    try:
        data = json.loads(text, parse_int=_bounded_int, parse_float=_bounded_float,
                          parse_constant=_Unbounded)
    except json.JSONDecodeError as exc:
        raise RequestError("invalid_json", f"request is not JSON: {exc.msg} at line "
                                           f"{exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise RequestError("invalid_json", "request nests arrays or objects deeper than the "
                                           "JSON parser follows: send a flat request object"
                           ) from None
    if not isinstance(data, dict):
        raise RequestError("invalid_request", "request must be a JSON object")
    if (unbounded := _find_unbounded(data)) is not None:
        where, number = unbounded
        raise RequestError("invalid_request", f"{where}: {number.why}")
    try:
        return GenerateRequest.model_validate(data)
    except ValidationError as exc:
        raise RequestError("invalid_request", describe(exc)) from None


class _Unbounded:
    """A JSON number past what a request may hold, kept as its text until
    _find_unbounded names the field it is in."""

    def __init__(self, text: str) -> None:
        self.text = text

    @property
    def why(self) -> str:
        if len(self.text) > MAX_NUMBER_CHARS:
            return (f"a number of {len(self.text)} characters; numbers here have at most "
                    f"{MAX_NUMBER_CHARS}")
        return f"{self.text} is not a finite number: send one within the field's range"


def _bounded_int(text: str) -> int | _Unbounded:
    return int(text) if len(text) <= MAX_NUMBER_CHARS else _Unbounded(text)


def _bounded_float(text: str) -> float | _Unbounded:
    if len(text) > MAX_NUMBER_CHARS:
        return _Unbounded(text)
    value = float(text)
    return value if math.isfinite(value) else _Unbounded(text)  # 1e999 parses as inf


def _find_unbounded(data: object) -> tuple[str, _Unbounded] | None:
    """The first number _bounded_int or _bounded_float refused, with where it is
    (`vars.code`, `stop.1`). A loop, not recursion: json.loads nests up to its own
    recursion limit, which a recursive walk from here would pass."""
    todo: list[tuple[str, object]] = [("", data)]
    while todo:
        where, value = todo.pop()
        if isinstance(value, _Unbounded):
            return where or "request", value
        items = (value.items() if isinstance(value, dict)
                 else enumerate(value) if isinstance(value, list) else ())
        todo.extend((f"{where}.{key}" if where else str(key), item) for key, item in items)
    return None


def unbounded_number(payload: bytes) -> tuple[str, str] | None:
    """Where the JSON `payload` holds a number past MAX_NUMBER_CHARS or not finite, and
    why; None if it holds none (or is not JSON). For parsers that can only say at
    which column a number was too large (pydantic's)."""
    try:
        data = json.loads(payload, parse_int=_bounded_int, parse_float=_bounded_float,
                          parse_constant=_Unbounded)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    found = _find_unbounded(data)
    return None if found is None else (found[0], found[1].why)


def salvage_id(payload: bytes) -> str | None:
    """The id of a request that failed validation, if it can name a reply topic."""
    try:
        data: Any = json.loads(payload, parse_int=_bounded_int, parse_float=_bounded_float,
                               parse_constant=_Unbounded)
        rid = data.get("id") if isinstance(data, dict) else None
        if isinstance(rid, str) and len(rid) <= MAX_ID_CHARS:
            return check_level(rid, "id")
    except (ValueError, UnicodeDecodeError, RecursionError):
        pass
    return None


def describe(exc: ValidationError, whole: str = "request") -> str:
    """A validation error as one message that says what to fix, field by field; `whole`
    names the object itself where an error concerns no one field."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or whole
        what = ("unknown field: remove it" if err["type"] == "extra_forbidden"
                else err["msg"].removeprefix("Value error, "))
        parts.append(f"{where}: {what}")
    return "; ".join(parts)
