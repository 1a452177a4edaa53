"""The rehearsal's fixed workload, sent from the host namespace as a PLC gateway would send it,
and what it measures: per request, per box and per link.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import aiomqtt

from edgebus.ask import default_client_id
from edgebus.core.client import BusClient
from edgebus.core.errors import EdgebusError
from edgebus.core.messages import AgentStatus, GenerateRequest, GenerateResponse
from edgebus.core.statuses import StatusReader
from edgebus.rehearse.rehearsal import Rehearsal
from node_agent.cancel import cancel_all
from plant_config import Plant

log = logging.getLogger(__name__)

# Short plant questions: the prompt is not the point, the decode loop is.
PROMPTS = (
    "The hydraulic press on line 3 reports a pressure drop. Likely causes are",
    "Summarise the lockout-tagout procedure for a conveyor motor:",
    "A PLC alarm says 'axis 2 following error'. What should the operator check?",
    "List three ways to reduce compressed-air leaks in a plant:",
)
# Requests per group: oneDNN pads a decode batch of fewer rows to 4 (docs/architecture.md),
# so 4 rows cost what one costs, and the coordinator opens a group for no fewer.
ROWS_PER_GROUP = 4
# Tokens per request: enough decode steps that the per-step times settle.
DEFAULT_TOKENS = 48
# Agents importing torch side by side, each on a fraction of a core, take a while.
ONLINE_TIMEOUT_S = 300.0
_POLL_S = 0.2


@dataclass(frozen=True)
class Workload:
    requests: int
    tokens: int = DEFAULT_TOKENS
    # Prompt text; None: the fixed PROMPTS in turn.
    prompt: str | None = None
    # A prompt file's requests (prompt_file.py), sent in the file's order and again from the
    # first where `requests` is more; they replace `prompt` and PROMPTS.
    file_requests: tuple[GenerateRequest, ...] = ()

    def batch(self, prefix: str) -> list[GenerateRequest]:
        return [self._request(f"{prefix}{i}", i) for i in range(self.requests)]

    def _request(self, request_id: str, i: int) -> GenerateRequest:
        if not self.file_requests:
            return GenerateRequest(id=request_id, prompt=self.prompt or PROMPTS[i % len(PROMPTS)],
                                   max_tokens=self.tokens, ignore_eos=True, stream=True)
        item = self.file_requests[i % len(self.file_requests)]
        # The rehearsal's own knobs where the item sets none: `tokens`, every one of them
        # decoded (ignore_eos), as the prediction counts a request.
        defaults = {name: value for name, value in (("max_tokens", self.tokens),
                                                    ("ignore_eos", True))
                    if name not in item.model_fields_set}
        return item.model_copy(update={**defaults, "id": request_id, "stream": True})

    def mean_tokens(self) -> int:
        """Tokens a request asks for, the mean over the batch: what the prediction counts."""
        return round(statistics.fmean(r.max_tokens for r in self.batch("")))

    def describe(self, source: str | None = None) -> str:
        """The workload in words, for the progress line; `source`: the prompt file's name."""
        if not self.file_requests:
            return f"{self.requests} requests x {self.tokens} tokens"
        held = len(self.file_requests)
        order = ("in turn, again from the first" if self.requests > held
                 else f"the first {self.requests}" if self.requests < held else "each once")
        return (f"{self.requests} requests from {source or 'the prompt file'} ({held} in it, "
                f"{order}), {self.tokens} tokens where an item sets no max_tokens")


@dataclass
class Observer:
    """What the host namespace sees: agents' statuses, responses and stream deltas."""

    plant: Plant
    statuses: dict[str, AgentStatus] = field(default_factory=dict)
    responses: dict[str, GenerateResponse] = field(default_factory=dict)  # the first of each
    answers: dict[str, int] = field(default_factory=dict)  # responses per request id: 1 each
    first_delta: dict[str, float] = field(default_factory=dict)
    done: dict[str, float] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    _status_reader: StatusReader = field(default_factory=lambda: StatusReader(log.warning),
                                         init=False, repr=False)

    def on_message(self, message: aiomqtt.Message) -> None:
        payload = message.payload if isinstance(message.payload, bytes) else b""
        topic = message.topic.value
        now = time.monotonic()
        if (agent := self.plant.topics.agent_of_status_topic(topic)) is not None:
            if (status := self._status_reader.read(agent, payload)) is not None:
                self.statuses[agent] = status
        elif topic.endswith("/stream"):
            self.first_delta.setdefault(topic.split("/")[-2], now)
        else:
            response = GenerateResponse.model_validate_json(payload)
            self.responses.setdefault(response.id, response)
            self.answers[response.id] = self.answers.get(response.id, 0) + 1
            self.done.setdefault(response.id, now)
        self.changed.set()

    async def until(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            self.changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EdgebusError(f"timed out after {timeout:.0f} s waiting for {what}")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(remaining, 1.0)):
                    await self.changed.wait()

    def metric(self, agent: str, name: str) -> float:
        status = self.statuses.get(agent)
        return status.metrics.get(name, 0.0) if status is not None else 0.0


class Client:
    """The rehearsal's gateway (requests, responses) and ops view (statuses), in the host
    namespace, over the bridge."""

    def __init__(self, plant: Plant) -> None:
        self.plant = plant
        self.client_id = default_client_id(plant)
        self.observer = Observer(plant)
        topics = plant.topics
        self.gateway = BusClient(plant.endpoint_for(self.client_id),
                                 f"{plant.plant_id}.{self.client_id}",
                                 subscriptions=[(topics.response_filter(self.client_id), 1)],
                                 persistent=True)
        self.ops = BusClient(plant.ops_endpoint(), plant.ops_client_id("rehearse"),
                             subscriptions=[(topics.status_filter, 1)])
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Client:
        self._tasks = [asyncio.create_task(bus.run(self.observer.on_message))
                       for bus in (self.gateway, self.ops)]
        await self.gateway.wait_connected(30)
        await self.ops.wait_connected(30)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await cancel_all(self._tasks)

    async def send(self, batch: list[GenerateRequest]) -> None:
        for request in batch:
            await self.gateway.publish(self.plant.topics.request(self.client_id),
                                       request.model_dump_json(exclude_none=True), qos=1)

    async def until_answered(self, batch: list[GenerateRequest], timeout: float) -> None:
        await self.observer.until(lambda: all(r.id in self.observer.responses for r in batch),
                                  timeout, f"answers to {len(batch)} requests (got "
                                  f"{sum(r.id in self.observer.responses for r in batch)})")


async def wait_online(rehearsal: Rehearsal, client: Client, *, since: float = 0.0,
                      timeout: float = ONLINE_TIMEOUT_S, agents: list[str] | None = None) -> None:
    """Return once every agent (or those of `agents`) reports "online" from the process the
    rehearsal started."""
    plant = rehearsal.plant
    if agents is None:
        agents = [stage.node for stage in plant.stages] + [plant.coordinator.id]
    deadline = time.monotonic() + timeout
    reported: set[str] = set()
    while True:
        online = {a for a in agents if (s := client.observer.statuses.get(a)) is not None
                  and s.state == "online" and s.pid == rehearsal.pid(a) and s.ts >= since}
        for agent in sorted(online - reported):
            rehearsal.came_online(agent)
            rehearsal.progress(f"  {agent} online")
        reported |= online
        if online == set(agents):
            return
        rehearsal.watch_memory()
        dead = [name for name in rehearsal.dead() if name in agents or name == "broker"]
        if dead:
            raise EdgebusError(f"{rehearsal.describe_exit(dead[0])} before the plant came "
                               f"online:\n{rehearsal.log_tail(dead[0])}")
        if time.monotonic() > deadline:
            missing = ", ".join(sorted(set(agents) - online))
            raise EdgebusError(f"not online after {timeout:.0f} s: {missing}")
        await asyncio.sleep(_POLL_S)


@dataclass(frozen=True)
class BoxSample:
    """A box's counters at one moment."""

    cpu_s: float        # CPU its control group used
    compute_s: float    # its stage's forward passes (status metric)
    steps: float        # its stage's forward passes, counted
    rows: float         # positions its stage has run
    decode_s: float     # its forward passes of decode rows only, which the planner predicts
    decode_steps: float
    verify_frames: float     # decode frames of several positions (a token and its drafts)
    verify_positions: float  # the positions they carried
    major_faults: int   # pages read back from disk (BoxGroup.major_faults)
    bytes_in: int       # over its link
    bytes_out: int


def decode_step_ms(before: BoxSample, after: BoxSample) -> float | None:
    """A box's mean pass of decode rows alone between two samples (None: it ran none)."""
    steps = after.decode_steps - before.decode_steps
    return (after.decode_s - before.decode_s) * 1000 / steps if steps else None


@dataclass(frozen=True)
class Measurement:
    """One workload on one rehearsal: per request and per box."""

    requests: int
    tokens: int                         # tokens answered, all requests together
    prompt_tokens: int                  # per request, the mean (the prompts' own tokenizer)
    wall_s: float                       # first request sent to last answer
    ttft_s: list[float]                 # per request
    decode_tok_s: float                 # all requests, counted per request from its first token
    boxes: dict[str, tuple[BoxSample, BoxSample]]   # before, after
    cpu_cores: dict[str, float]
    errors: list[str]
    # The host's 1-minute load average at the end: above its cores, the boxes' processes
    # queued behind others' for a CPU, and got less than their quotas.
    host_load: float = 0.0
    drafts_proposed: int = 0  # all requests together (their responses' speculation)
    drafts_accepted: int = 0


def sample(rehearsal: Rehearsal, client: Client) -> dict[str, BoxSample]:
    result = {}
    for share in rehearsal.shares:
        box = share.box
        bytes_in, bytes_out = rehearsal.network.links[box].counters()
        group = rehearsal.groups[box]
        result[box] = BoxSample(cpu_s=group.cpu_usage_s(), major_faults=group.major_faults(),
                                compute_s=client.observer.metric(box, "compute_s"),
                                steps=client.observer.metric(box, "steps"),
                                rows=client.observer.metric(box, "rows"),
                                decode_s=client.observer.metric(box, "decode_s"),
                                decode_steps=client.observer.metric(box, "decode_steps"),
                                verify_frames=client.observer.metric(box, "verify_frames"),
                                verify_positions=client.observer.metric(box,
                                                                        "verify_positions"),
                                bytes_in=bytes_in, bytes_out=bytes_out)
    return result


async def fresh_statuses(client: Client, agents: list[str], timeout: float) -> None:
    """Wait until every agent in `agents` has published a status after now."""
    since = time.time()
    await client.observer.until(
        lambda: all((s := client.observer.statuses.get(a)) is not None and s.ts > since
                    for a in agents), timeout, "fresh statuses")


async def measure(rehearsal: Rehearsal, client: Client, workload: Workload,
                  prefix: str) -> Measurement:
    """Send `workload` at once and measure it."""
    stages = [stage.node for stage in rehearsal.plant.stages]
    # Counters come with the heartbeat; wait for one after the last work so
    # "before" holds everything done before this workload.
    heartbeat = rehearsal.plant.liveness.heartbeat_s
    await fresh_statuses(client, stages, heartbeat * 3)
    before = sample(rehearsal, client)
    batch = workload.batch(prefix)
    sent = time.monotonic()
    await client.send(batch)
    await client.until_answered(batch, rehearsal.plant.coordinator.request_timeout_s * 2)
    # CPU and bytes right at the end; the stages' own counters once they have reported them.
    at_end = sample(rehearsal, client)
    await fresh_statuses(client, stages, heartbeat * 3)
    reported = sample(rehearsal, client)
    after = {box: replace(at_end[box], compute_s=reported[box].compute_s,
                          steps=reported[box].steps, rows=reported[box].rows,
                          decode_s=reported[box].decode_s,
                          decode_steps=reported[box].decode_steps,
                          verify_frames=reported[box].verify_frames,
                          verify_positions=reported[box].verify_positions)
             for box in at_end}
    observer = client.observer
    responses = [observer.responses[r.id] for r in batch]
    errors = [f"{r.id}: {r.error.code}: {r.error.message}" for r in responses
              if r.error is not None]
    decode = sum((len(r.tokens) - 1) / (observer.done[r.id] - observer.first_delta[r.id])
                 for r in responses
                 if r.error is None and len(r.tokens) > 1 and r.id in observer.first_delta)
    return Measurement(
        requests=len(batch), tokens=sum(len(r.tokens) for r in responses),
        # A failed request reports no usage: its 0 is not a prompt's length.
        prompt_tokens=round(statistics.fmean(
            [r.usage.prompt_tokens for r in responses if r.error is None] or [0])),
        wall_s=max(observer.done[r.id] for r in batch) - sent,
        ttft_s=[observer.first_delta[r.id] - sent for r in batch if r.id in observer.first_delta],
        decode_tok_s=decode,
        boxes={box: (before[box], after[box]) for box in before},
        cpu_cores={share.box: share.cpu_cores for share in rehearsal.shares},
        errors=errors, host_load=os.getloadavg()[0],
        drafts_proposed=sum(r.speculation.proposed for r in responses if r.speculation),
        drafts_accepted=sum(r.speculation.accepted for r in responses if r.speculation))
