"""The gateway contract as a PLC gateway meets it: plain MQTT clients, JSON in and out.

Requests go in with `mosquitto_pub` or a bare aiomqtt client, never through
edgebus code, so these tests check the wire contract the README documents.
Bad input must come back as an error response (when a reply topic can be
derived) plus an event, and must not disturb anything else.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import aiomqtt
import numpy as np
from brokers import BrokerHandle
from paho.mqtt.properties import Properties
from pipeline import plant_for, reference_tokens, running

from edgebus.core import frames
from edgebus.core.frames import Header, Kind
from edgebus.core.messages import GenerateRequest, GenerateResponse

WAIT_S = 60.0


def _expected(model_dir: Path, request: dict[str, object]) -> list[int]:
    return reference_tokens(model_dir, GenerateRequest.model_validate(request))


async def test_mosquitto_pub_and_sub_speak_the_contract(tiny_llama: Path,
                                                        mosquitto_broker: BrokerHandle) -> None:
    plant = plant_for(tiny_llama, mosquitto_broker, [(0, 3), (3, 6)])
    request = {"id": "job-7", "prompt": "Alarm 4711 on press 3 means", "max_tokens": 8,
               "ignore_eos": True}
    broker = ["-h", mosquitto_broker.host, "-p", str(mosquitto_broker.port)]
    # A gateway with a persistent session, as a PLC's should be: subscribed once
    # (-E: until the broker acknowledges it), the answer waits for it from then on.
    session = [*broker, "-i", "plc-1-test", "-c", "-q", "1",
               "-t", f"{plant.topic_root}/llm/response/plc-1/job-7"]
    async with running(plant):
        subscribe = await asyncio.create_subprocess_exec("mosquitto_sub", *session, "-E")
        assert await asyncio.wait_for(subscribe.wait(), WAIT_S) == 0
        sub = await asyncio.create_subprocess_exec(
            "mosquitto_sub", *session, "-C", "1", "-W", str(int(WAIT_S)),
            stdout=asyncio.subprocess.PIPE)
        pub = await asyncio.create_subprocess_exec(
            "mosquitto_pub", *broker, "-q", "1", "-t", f"{plant.topic_root}/llm/request/plc-1",
            "-m", json.dumps(request))
        assert await pub.wait() == 0
        out, _ = await asyncio.wait_for(sub.communicate(), WAIT_S)
    response = json.loads(out)
    assert response["id"] == "job-7"
    assert response["error"] is None
    assert response["finish_reason"] == "length"
    assert response["tokens"] == _expected(tiny_llama, request)
    assert response["usage"]["completion_tokens"] == 8
    assert set(response["timings"]) == {"ttft_ms", "total_ms"}


async def test_mqtt5_response_topic_and_correlation_data(tiny_llama: Path,
                                                         mosquitto_broker: BrokerHandle) -> None:
    plant = plant_for(tiny_llama, mosquitto_broker, [(0, 6)])
    request = {"id": "q1", "prompt": "Conveyor speed", "max_tokens": 4, "ignore_eos": True}
    async with running(plant), _client(mosquitto_broker, mqtt5=True) as client:
        await client.subscribe("scada/answers/line-2", qos=1)
        pub = await asyncio.create_subprocess_exec(
            "mosquitto_pub", "-h", mosquitto_broker.host, "-p", str(mosquitto_broker.port),
            "-V", "mqttv5", "-q", "1", "-t", f"{plant.topic_root}/llm/request/scada",
            "-D", "publish", "response-topic", "scada/answers/line-2",
            "-D", "publish", "correlation-data", "corr-42", "-m", json.dumps(request))
        assert await pub.wait() == 0
        message = await asyncio.wait_for(anext(aiter(client.messages)), WAIT_S)
    assert isinstance(message.properties, Properties)
    assert message.properties.CorrelationData == b"corr-42"  # type: ignore[attr-defined]
    response = GenerateResponse.model_validate_json(message.payload)
    assert response.tokens == _expected(tiny_llama, request)


async def test_stream_deltas_add_up_to_the_response(tiny_llama: Path,
                                                    amqtt_broker: BrokerHandle) -> None:
    plant = plant_for(tiny_llama, amqtt_broker, [(0, 2), (2, 6)])
    base = f"{plant.topic_root}/llm/response/gw/s1"
    request = {"id": "s1", "prompt": "Motor bearing", "max_tokens": 12, "stream": True,
               "ignore_eos": True}
    async with running(plant), _client(amqtt_broker) as client:
        filters = await _subscribe(client, f"{base}/#")  # "#" matches {base} itself too
        await client.publish(f"{plant.topic_root}/llm/request/gw", json.dumps(request), qos=1)
        deltas: list[dict[str, object]] = []
        async for message in _messages(client, filters):
            if message.topic.value == base:
                response = GenerateResponse.model_validate_json(message.payload)
                break
            deltas.append(json.loads(message.payload))
    assert response.tokens == _expected(tiny_llama, request)
    assert "".join(str(d["delta"]) for d in deltas) == response.text
    assert [d["index"] for d in deltas] == sorted(d["index"] for d in deltas)  # type: ignore[type-var]


BAD_REQUESTS = [
    # (payload, request id an answer goes to or None, error code, words the message must hold)
    (b'{"id": "b1", "prompt": "x", "bogus": 1}', "b1", "invalid_request", ["bogus", "unknown"]),
    (b'{"id": "b2", "max_tokens": 5}', "b2", "invalid_request", ["prompt", "messages"]),
    (b'{"id": "b3", "prompt": "x", "max_tokens": 100000}', "b3", "max_tokens", ["limit"]),
    (b'{"id": "b4", "prompt": "x", "temperature": "hot"}', "b4", "invalid_request",
     ["temperature"]),
    (b'{"id": "b5", "prompt": "' + b"x" * 300_000 + b'"}', "b5", "too_large", ["limit"]),
    # No id can be read from these: only an event tells of them. Events carry no
    # code, so the words are what the event for each must say, and no other does.
    (b"{not json", None, "invalid_json", ["not JSON"]),
    (b'\xff\xfe{"id": "b7"}', None, "not_utf8", ["not UTF-8"]),
    (b'["id", "b8"]', None, "invalid_request", ["must be a JSON object"]),
]


async def test_bad_requests_get_clear_errors_and_the_agent_keeps_serving(
        tiny_llama: Path, amqtt_broker: BrokerHandle) -> None:
    plant = plant_for(tiny_llama, amqtt_broker, [(0, 3), (3, 6)], max_tokens_limit=64)
    root = plant.topic_root
    async with running(plant), _client(amqtt_broker) as client:
        filters = await _subscribe(client, f"{root}/llm/response/plc/#", f"{root}/events")
        for payload, *_ in BAD_REQUESTS:
            await client.publish(f"{root}/llm/request/plc", payload, qos=1)
        good = {"id": "good", "prompt": "Pump 2 vibration", "max_tokens": 6, "ignore_eos": True}
        await client.publish(f"{root}/llm/request/plc", json.dumps(good), qos=1)
        responses, events = await _collect(client, filters, root, until_id="good",
                                           events_wanted=len(BAD_REQUESTS))
    assert responses["good"].tokens == _expected(tiny_llama, good)
    for _, rid, code, words in BAD_REQUESTS:
        if rid is None:
            told = [e for e in events if all(word in e["message"] for word in words)]
            assert len(told) == 1, (code, [e["message"] for e in events])
            assert told[0]["request_id"] is None and told[0]["message"].startswith(
                "bad request from plc: "), told[0]
            continue
        error = responses[rid].error
        assert responses[rid].finish_reason == "error"
        assert error is not None and error.code == code, (rid, error)
        for word in words:
            assert word in error.message, (rid, error.message)
    assert len(events) >= len(BAD_REQUESTS)
    assert all(e["kind"] == "error" for e in events)


async def test_garbage_frames_are_dropped_and_requests_stay_exact(
        tiny_llama: Path, amqtt_broker: BrokerHandle) -> None:
    plant = plant_for(tiny_llama, amqtt_broker, [(0, 2), (2, 4), (4, 6)])
    root = plant.topic_root
    hidden = frames.encode(Kind.HIDDEN, np.zeros((1, 1, 64), dtype=np.float32),
                           Header(123, 0, 5), start=9)
    garbage = [os.urandom(100), b"", hidden[:-4], hidden,  # unknown request
               frames.encode(Kind.TOKENS, np.array([[1, 2]]), Header(9, 0, 0),
                             start=0)]  # tokens into a middle stage
    request = {"id": "r", "prompt": "Hydraulic oil temperature", "max_tokens": 10,
               "ignore_eos": True}
    async with running(plant), _client(amqtt_broker) as client:
        filters = await _subscribe(client, f"{root}/llm/response/plc/#", f"{root}/events")
        for payload in garbage:
            await client.publish(f"{root}/act/stage-1", payload, qos=1)
        await client.publish(f"{root}/llm/request/plc", json.dumps(request), qos=1)
        responses, events = await _collect(client, filters, root, until_id="r",
                                           events_wanted=len(garbage))
    assert responses["r"].tokens == _expected(tiny_llama, request)
    assert len(events) == len(garbage)
    assert all(e["agent_id"] == "stage-1" for e in events)


# -- helpers ---------------------------------------------------------------------


def _client(broker: BrokerHandle, *, mqtt5: bool = False) -> aiomqtt.Client:
    return aiomqtt.Client(broker.host, broker.port, identifier=f"test-{secrets.token_hex(3)}",
                          protocol=aiomqtt.ProtocolVersion.V5 if mqtt5
                          else aiomqtt.ProtocolVersion.V311)


async def _subscribe(client: aiomqtt.Client, *filters: str) -> list[str]:
    for topic_filter in filters:
        await client.subscribe(topic_filter, qos=1)
    return list(filters)


async def _messages(client: aiomqtt.Client, filters: list[str]
                    ) -> AsyncIterator[aiomqtt.Message]:
    """Yield what matches `filters`.

    amqtt 0.12.1 also hands a new client retained messages that match other
    clients' subscriptions; a gateway has to ignore those, and so do we.
    """
    iterator = aiter(client.messages)
    while True:
        message = await asyncio.wait_for(anext(iterator), WAIT_S)
        if any(message.topic.matches(f) for f in filters):
            yield message


async def _collect(client: aiomqtt.Client, filters: list[str], root: str, *, until_id: str,
                   events_wanted: int
                   ) -> tuple[dict[str, GenerateResponse], list[dict[str, str]]]:
    responses: dict[str, GenerateResponse] = {}
    events: list[dict[str, str]] = []
    async for message in _messages(client, filters):
        if message.topic.value == f"{root}/events":
            events.append(json.loads(message.payload))
        else:
            response = GenerateResponse.model_validate_json(message.payload)
            responses[response.id] = response
        if until_id in responses and len(events) >= events_wanted:
            return responses, events
    raise AssertionError("unreachable")

