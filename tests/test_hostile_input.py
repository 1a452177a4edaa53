"""Hostile and unlucky input: fuzzed frames and requests, duplicates, floods, full budgets.

The agents run in this process over a real Mosquitto; everything reaches them
as MQTT messages from a plain aiomqtt client, as it would from a broken or
malicious box on the plant network. Valid requests running at the same time
must stay token-exact, and every request gets an answer.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import struct
import zlib
from pathlib import Path

import aiomqtt
import torch
from brokers import BrokerHandle
from hypothesis import given, settings
from hypothesis import strategies as st
from pipeline import plant_for, reference_tokens, running
from transformers import AutoConfig

from edgebus import frames
from edgebus.errors import RequestError
from edgebus.frames import HEADER_SIZE, Header, Kind
from edgebus.messages import (
    MAX_REQUEST_BYTES,
    AgentStatus,
    GenerateRequest,
    GenerateResponse,
    parse_request,
)
from node_agent.kv_cache import kv_bytes_per_token
from node_agent.stage import SWEEP_INTERVAL_S

FUZZ_MESSAGES = 10_000
# Publishes in flight at once: enough to flood the agents, few enough that
# the broker's per-client queue (mosquitto: 1000 QoS 1 messages) never drops.
FUZZ_WINDOW = 200
WAIT_S = 120.0
HIDDEN = 64  # the tiny llama's width


# -- the request parser, property-based -------------------------------------------

_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                     lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
_FIELDS = st.sampled_from(["id", "prompt", "messages", "max_tokens", "temperature", "top_k",
                           "top_p", "seed", "stop", "ignore_eos", "stream", "reply_to", "extra"])


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=300))
def test_any_bytes_parse_or_raise_request_error(payload: bytes) -> None:
    try:
        parse_request(payload)
    except RequestError as exc:
        assert exc.code and exc.message


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(_FIELDS, _JSON, max_size=8))
def test_any_json_object_parses_or_raises_request_error(data: dict[str, object]) -> None:
    try:
        request = parse_request(json.dumps(data).encode())
    except RequestError as exc:
        assert exc.code == "invalid_request" and exc.message
    else:  # whatever passes is a request the coordinator can serve as is
        assert request.max_tokens >= 1 and (request.prompt is None) != (request.messages is None)


# -- live fuzzing -----------------------------------------------------------------


def _valid_frame(rng: random.Random, *, kind: Kind = Kind.HIDDEN) -> bytes:
    count = rng.randint(1, 4)
    tensor = (torch.randint(0, 100, (1, count)) if kind == Kind.TOKENS
              else torch.randn(1, count, HIDDEN, dtype=torch.float16))
    return frames.encode(kind, tensor, Header(rng.getrandbits(63), 0, rng.randint(1, 9),
                                              (0, 0, 0)), start=rng.randint(1, 50))


def _recrc(data: bytearray) -> bytes:
    """Fix the checksum (it covers the header, then the route and payload after it)."""
    crc = zlib.crc32(bytes(data[HEADER_SIZE:]), zlib.crc32(bytes(data[:HEADER_SIZE - 4])))
    data[HEADER_SIZE - 4:HEADER_SIZE] = crc.to_bytes(4, "little")
    return bytes(data)


def fuzz_frame(rng: random.Random) -> bytes:
    """One hostile activation message: each kind of damage the issue names."""
    valid = bytearray(_valid_frame(rng))
    choice = rng.randrange(10)
    if choice == 0:
        return rng.randbytes(rng.randint(0, 300))
    if choice == 1:
        return bytes(valid[:rng.randint(0, len(valid) - 1)])  # truncated
    if choice == 2:
        return b"XXXX" + bytes(valid[4:])  # wrong magic
    if choice == 3:
        valid[4] = rng.choice([0, 1, 3, 255])  # wrong version
        return _recrc(valid)
    if choice == 4:  # wrong shape: a hidden width the model does not have
        return frames.encode(Kind.HIDDEN, torch.zeros(1, 1, HIDDEN + 1), Header(1, 0, 1, (0,) * 3),
                             start=1)
    if choice == 5:  # wrong dtype: token ids where hidden states belong
        return _valid_frame(rng, kind=Kind.TOKENS)
    if choice == 6:  # NaN/Inf
        bad = torch.full((1, 1, HIDDEN), math.nan if rng.random() < 0.5 else math.inf)
        return frames.encode(Kind.HIDDEN, bad, Header(2, 0, 1, (0, 0, 0)), start=3)
    if choice == 7:  # oversized: a header claiming a huge tensor
        valid[36:48] = struct.pack("<3I", 1, 2**20, 2**12)
        return _recrc(valid)
    if choice == 8:  # random bytes flipped, checksum fixed so deeper checks run
        for _ in range(rng.randint(1, 4)):
            valid[rng.randrange(len(valid))] = rng.randrange(256)
        return _recrc(valid)
    return bytes(valid)  # well-formed, for a request nobody started


def fuzz_request(rng: random.Random) -> bytes:
    """One hostile request: every kind is invalid by construction."""
    choice = rng.randrange(8)
    base: dict[str, object] = {"id": f"f{rng.getrandbits(32)}", "prompt": "x", "max_tokens": 2}
    if choice == 0:
        return rng.randbytes(rng.randint(0, 200))
    if choice == 1:
        return b"\xff\xfe" + json.dumps(base).encode()  # not UTF-8
    if choice == 2:
        return b'{"id": "x", "prompt": '  # malformed JSON
    if choice == 3:
        return json.dumps({**base, "unknown_field": rng.random()}).encode()
    if choice == 4:
        return json.dumps({**base, "max_tokens": 10**9}).encode()  # over the plant's limit
    if choice == 5:
        return json.dumps({**base, "temperature": "hot", "top_p": -1}).encode()
    if choice == 6:
        return json.dumps({**base, "id": "a/b#"}).encode()  # cannot be a topic level
    return b"[" * rng.randint(1, 5000)  # deep nesting


async def test_ten_thousand_fuzzed_messages_crash_nothing(
        tiny_llama: Path, mosquitto_broker: BrokerHandle) -> None:
    plant = plant_for(tiny_llama, mosquitto_broker, [(0, 2), (2, 4), (4, 6)])
    root = plant.topic_root
    rng = random.Random(4711)
    valid = [GenerateRequest(id=f"ok{i}", prompt=f"Valve {i} reports", max_tokens=12,
                             ignore_eos=True) for i in range(4)]
    messages = [(f"{root}/act/stage-{rng.randrange(3)}", fuzz_frame(rng))
                if i % 2 else (f"{root}/llm/request/fuzz{rng.randrange(5)}", fuzz_request(rng))
                for i in range(FUZZ_MESSAGES - 3)]
    # And the oversized ones: a request past the size limit, a frame of 2 MB.
    messages += [(f"{root}/llm/request/fuzz0", b'{"id": "big", "prompt": "' + b"a" *
                  MAX_REQUEST_BYTES + b'"}'),
                 (f"{root}/act/stage-1", os.urandom(2 * 2**20)),
                 (f"{root}/act/stage-0", _valid_frame(rng)[:HEADER_SIZE] + os.urandom(2**20))]
    frame_messages = sum(topic.startswith(f"{root}/act/") for topic, _ in messages)
    async with running(plant), aiomqtt.Client(
            mosquitto_broker.host, mosquitto_broker.port) as client:
        await client.subscribe(f"{root}/llm/response/gw/#", qos=1)
        await client.subscribe(f"{root}/events", qos=1)
        for request in valid:
            await client.publish(f"{root}/llm/request/gw", request.model_dump_json(), qos=1)
        for offset in range(0, len(messages), FUZZ_WINDOW):
            await asyncio.gather(*(client.publish(topic, payload, qos=1)
                                   for topic, payload in messages[offset:offset + FUZZ_WINDOW]))
        responses: dict[str, GenerateResponse] = {}
        flagged = 0  # events from stages: every fuzzed frame message must raise one

        async def collect() -> None:
            nonlocal flagged
            async for message in client.messages:
                assert isinstance(message.payload, bytes)
                if message.topic.value == f"{root}/events":
                    event = json.loads(message.payload)
                    if event["agent_id"].startswith("stage-"):  # a summary stands for held_back
                        flagged += event["held_back"] or 1
                else:
                    response = GenerateResponse.model_validate_json(message.payload)
                    responses[response.id] = response
                if len(responses) == len(valid) and flagged >= frame_messages:
                    return

        try:
            await asyncio.wait_for(collect(), WAIT_S)
        except TimeoutError:
            raise AssertionError(f"{len(responses)} of {len(valid)} valid requests answered and "
                                 f"{flagged} of {frame_messages} fuzzed frame messages flagged "
                                 f"within {WAIT_S:.0f} s") from None
    for request in valid:
        assert responses[request.id].tokens == reference_tokens(tiny_llama, request)


# -- duplicates, admission, budgets ---------------------------------------------------


async def test_a_request_sent_twice_is_generated_and_answered_once_then_again_on_request(
        tiny_llama: Path, mosquitto_broker: BrokerHandle) -> None:
    plant = plant_for(tiny_llama, mosquitto_broker, [(0, 3), (3, 6)])
    request = GenerateRequest(id="dup", prompt="Conveyor 2 stopped because", max_tokens=6,
                              ignore_eos=True)
    root = plant.topic_root
    # Sent a third time once answered, asking for its answer on another topic: the
    # answer there tells that the coordinator has handled every copy before it.
    again = request.model_copy(update={"reply_to": f"{root}/llm/response/gw/dup-again"})
    async with running(plant), aiomqtt.Client(mosquitto_broker.host,
                                              mosquitto_broker.port) as client:
        await client.subscribe(f"{root}/llm/response/gw/+", qos=1)
        for _ in range(2):  # QoS 1 may deliver twice
            await client.publish(f"{root}/llm/request/gw", request.model_dump_json(), qos=1)
        got: dict[str, list[GenerateResponse]] = {"dup": [], "dup-again": []}
        async with asyncio.timeout(WAIT_S):
            async for message in client.messages:
                assert isinstance(message.payload, bytes)
                topic = message.topic.value.rsplit("/", 1)[-1]
                got[topic].append(GenerateResponse.model_validate_json(message.payload))
                if topic == "dup":
                    await client.publish(f"{root}/llm/request/gw", again.model_dump_json(), qos=1)
                if got["dup-again"]:
                    break
    # One answer for the two copies in flight: a second would have left with the
    # first, long before the third copy was sent.
    assert len(got["dup"]) == 1
    # Timings are measured per generation: equal timings mean one generation.
    assert got["dup-again"] == got["dup"]
    assert got["dup"][0].tokens == reference_tokens(tiny_llama, request)


async def test_past_the_admission_limit_requests_get_busy_and_none_is_lost(
        tiny_llama: Path, mosquitto_broker: BrokerHandle) -> None:
    plant = plant_for(tiny_llama, mosquitto_broker, [(0, 3), (3, 6)], max_in_flight=2)
    batch = [GenerateRequest(id=f"b{i}", prompt=f"Sensor {i} drift", max_tokens=40,
                             ignore_eos=True) for i in range(12)]
    async with running(plant), aiomqtt.Client(mosquitto_broker.host,
                                              mosquitto_broker.port) as client:
        await client.subscribe(f"{plant.topic_root}/llm/response/gw/+", qos=1)
        await asyncio.gather(*(client.publish(f"{plant.topic_root}/llm/request/gw",
                                              r.model_dump_json(), qos=1) for r in batch))
        responses: dict[str, GenerateResponse] = {}
        async with asyncio.timeout(WAIT_S):
            async for message in client.messages:
                assert isinstance(message.payload, bytes)
                response = GenerateResponse.model_validate_json(message.payload)
                responses[response.id] = response
                if len(responses) == len(batch):
                    break
    busy = [r for r in responses.values() if r.error is not None]
    assert busy and all(r.error is not None and r.error.code == "busy" for r in busy)
    assert len(busy) < len(batch)
    for request in batch:
        if responses[request.id].error is None:
            assert responses[request.id].tokens == reference_tokens(tiny_llama, request)


async def test_kv_budgets_refuse_with_a_reason(tiny_llama: Path,
                                               mosquitto_broker: BrokerHandle) -> None:
    plant = plant_for(tiny_llama, mosquitto_broker, [(0, 3), (3, 6)])
    plant = plant.model_copy(update={"stages": [
        s.model_copy(update={"kv_budget_mb": 1}) for s in plant.stages]})
    fits = 2**20 // kv_bytes_per_token(AutoConfig.from_pretrained(tiny_llama), (0, 3))
    too_long = GenerateRequest(id="long", prompt="valve " * fits, max_tokens=8)
    chunk = plant.coordinator.prefill_chunk
    root = plant.topic_root
    async with running(plant), aiomqtt.Client(mosquitto_broker.host,
                                              mosquitto_broker.port) as client:
        await client.subscribe(f"{root}/llm/response/gw/long", qos=1)
        await client.subscribe(f"{root}/act/{plant.coordinator.id}", qos=1)
        await client.publish(f"{root}/llm/request/gw", too_long.model_dump_json(), qos=1)
        # A prefill straight to a stage, in legal chunks, past what its budget holds.
        for start in range(0, fits + 1, chunk):
            flood = frames.encode(Kind.TOKENS, torch.ones(1, min(chunk, fits + 1 - start),
                                                          dtype=torch.long),
                                  Header(77, 1, 0, (0, 0)), start=start, prefill=True)
            await client.publish(f"{root}/act/stage-0", flood, qos=1)
        seen: dict[str, str] = {}
        async with asyncio.timeout(WAIT_S):
            async for message in client.messages:
                assert isinstance(message.payload, bytes)
                if message.topic.matches(f"{root}/act/+"):
                    frame = frames.decode(message.payload)
                    if frame.kind == Kind.ERROR and frame.request == 77:
                        seen["stage"] = frame.text()
                else:
                    seen["coordinator"] = message.payload.decode()
                if len(seen) == 2:
                    break
    response = GenerateResponse.model_validate_json(seen["coordinator"])
    assert response.error is not None and response.error.code == "too_long"
    assert "kv_budget_mb" in response.error.message
    assert "KV budget of node stage-0 is full" in seen["stage"]


async def test_caches_of_abandoned_requests_are_evicted(tiny_llama: Path,
                                                        mosquitto_broker: BrokerHandle) -> None:
    # A coordinator that gives up on a step after 1 s: a cache idle longer is abandoned.
    plant = plant_for(tiny_llama, mosquitto_broker, [(0, 3), (3, 6)], request_timeout_s=1.0)
    root = plant.topic_root

    def prefill(request: int) -> bytes:  # well formed, from a coordinator that then vanished
        return frames.encode(Kind.TOKENS, torch.ones(1, 5, dtype=torch.long),
                             Header(request, 1, 0, (0, 0)), start=0, prefill=True, candidates=1)

    async with running(plant) as stages, aiomqtt.Client(mosquitto_broker.host,
                                                        mosquitto_broker.port) as client:
        await client.publish(f"{root}/act/stage-0", prefill(55), qos=1)
        async with asyncio.timeout(WAIT_S):
            while not all(55 in stage.caches for stage in stages):
                await asyncio.sleep(0.05)
        await asyncio.sleep(SWEEP_INTERVAL_S + 0.5)
        await client.publish(f"{root}/act/stage-0", prefill(56), qos=1)  # work wakes the sweep
        async with asyncio.timeout(WAIT_S):
            while not all(56 in stage.caches for stage in stages):
                await asyncio.sleep(0.05)
        assert all(55 not in stage.caches for stage in stages)
        assert all(stage.metrics["evicted"] == 1 for stage in stages)


async def test_a_late_will_of_an_old_session_does_not_kill_a_live_node(
        tiny_llama: Path, mosquitto_broker: BrokerHandle) -> None:
    plant = plant_for(tiny_llama, mosquitto_broker, [(0, 3), (3, 6)])
    root = plant.topic_root
    request = GenerateRequest(id="after-will", prompt="Pump 4 vibration", max_tokens=4)

    def death(bdseq: int) -> str:
        return AgentStatus(state="offline", role="stage", agent_id="stage-0", pid=1, host="h",
                           version="x", bdseq=bdseq).model_dump_json()

    async with running(plant) as stages, aiomqtt.Client(mosquitto_broker.host,
                                                        mosquitto_broker.port) as client:
        current = stages[0].bus.presence.bdseq  # type: ignore[union-attr]
        await client.subscribe(f"{root}/events", qos=1)
        await client.subscribe(f"{root}/llm/response/gw/+", qos=1)
        # The Will of the node's previous session, delivered after its new birth.
        await client.publish(f"{root}/status/stage-0", death(current - 1), qos=1, retain=True)
        await client.publish(f"{root}/llm/request/gw", request.model_dump_json(), qos=1)
        leaves: list[str] = []
        async with asyncio.timeout(WAIT_S):
            async for message in client.messages:
                assert isinstance(message.payload, bytes)
                if message.topic.value == f"{root}/events":
                    event = json.loads(message.payload)
                    if event["kind"] == "leave":
                        leaves.append(event["message"])
                    if leaves:  # the control case below
                        break
                else:
                    response = GenerateResponse.model_validate_json(message.payload)
                    assert response.error is None, response.error
                    assert not leaves
                    # Control: a death of the current session does count.
                    await client.publish(f"{root}/status/stage-0", death(current), qos=1)
    assert len(leaves) == 1 and "stage-0" in leaves[0]
