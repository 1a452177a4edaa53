"""The OpenAI HTTP gateway, driven by the official `openai` client against a running plant.

Agents run in-process over a real broker (tests/pipeline.py); the gateway
serves on a real port, in-process (`HttpGateway`) or as the `edgebus http`
command. Greedy answers must match `generate` token for token; errors must
carry the status OpenAI's clients act on.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import openai
import pytest
from brokers import BrokerHandle
from pipeline import plant_for, reference_tokens, running, stage_model, tokenizer

from edgebus.core.messages import ChatMessage, GenerateRequest, GenerateResponse, StreamDelta
from edgebus.core.processes import LOOPBACK, free_port
from edgebus.gateways.api_keys import ensure_api_keys, key_path
from edgebus.gateways.http import EXTRA_CONNECTIONS, HttpGateway, Pending, _events, _Shape
from node_agent.coordinator.agent import Coordinator
from node_agent.coordinator.waiting_room import UNMEASURED_RETRY_S
from node_agent.stage import StageAgent
from plant_config import Plant
from plant_config.broker_section import Security
from plant_config.credentials import ensure_passwords
from plant_config.loader import write_plant
from plant_config.schema import Liveness

# Up to the first answer of a cold plant on 2 busy cores; a hung test fails, not hangs.
WAIT_S = 120.0
# Tokens per answer: enough to show a mismatch, few enough to keep the tests fast.
TOKENS = 12
PROMPT = "The hydraulic press on line 3 reports a pressure drop. Likely causes are"


def _decode(model: Path, tokens: list[int]) -> str:
    return str(tokenizer(model).decode(tokens, skip_special_tokens=True))


@asynccontextmanager
async def serving(plant: Plant, **options: object) -> AsyncIterator[HttpGateway]:
    """`HttpGateway` on a free loopback port in this event loop, until the block ends."""
    gateway = HttpGateway(plant, listen=f"{LOOPBACK}:{free_port(LOOPBACK)}",
                          **options)  # type: ignore[arg-type]
    task = asyncio.create_task(gateway.serve())
    try:
        async with asyncio.timeout(WAIT_S):
            while not gateway.server.started:
                assert not task.done(), task.exception()
                await asyncio.sleep(0.05)
        yield gateway
    finally:
        gateway.stop()
        await asyncio.wait_for(task, WAIT_S)


def client(gateway: HttpGateway, key: str = "none") -> openai.AsyncOpenAI:
    # No retries: a test must see each status as the gateway sent it.
    return openai.AsyncOpenAI(base_url=gateway.url, api_key=key, max_retries=0, timeout=WAIT_S)


async def test_chat_is_token_exact_against_generate(smollm2_dir: Path,
                                                    mosquitto_broker: BrokerHandle) -> None:
    """SmolLM2 through its chat template, non-streamed and streamed, over two stages."""
    plant = plant_for(smollm2_dir, mosquitto_broker, [(0, 15), (15, 30)])
    question = "What does a PLC do in a factory?"
    expected = reference_tokens(smollm2_dir, GenerateRequest(
        id="ref", messages=[ChatMessage(role="user", content=question)], max_tokens=TOKENS))
    async with running(plant), serving(plant) as gateway:
        api = client(gateway)
        models = await api.models.list()
        assert [m.id for m in models.data] == [smollm2_dir.name]
        answer = await api.chat.completions.create(
            model=smollm2_dir.name, messages=[{"role": "user", "content": question}],
            max_completion_tokens=TOKENS, temperature=0)
        stream = await api.chat.completions.create(
            model=smollm2_dir.name, messages=[{"role": "user", "content": question}],
            max_tokens=TOKENS, temperature=0, stream=True)
        chunks = [chunk async for chunk in stream]
    assert answer.choices[0].message.content == _decode(smollm2_dir, expected)
    assert answer.choices[0].message.role == "assistant"
    assert answer.usage is not None and answer.usage.completion_tokens == len(expected)
    assert answer.choices[0].finish_reason == ("length" if len(expected) == TOKENS else "stop")
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == answer.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == answer.choices[0].finish_reason


async def test_completion_streams_what_it_answers(tiny_llama: Path,
                                                  mosquitto_broker: BrokerHandle) -> None:
    """Text completion token-exact; its stream adds up to the answer; include_usage; stop."""
    plant = plant_for(tiny_llama, mosquitto_broker, [(0, 3), (3, 6)])
    expected = reference_tokens(tiny_llama, GenerateRequest(
        id="ref", prompt=PROMPT, max_tokens=TOKENS, ignore_eos=True))
    text = _decode(tiny_llama, expected)
    async with running(plant), serving(plant) as gateway:
        api = client(gateway)
        answer = await api.completions.create(model=tiny_llama.name, prompt=PROMPT,
                                              max_tokens=TOKENS, extra_body={"ignore_eos": True})
        stream = await api.completions.create(
            model=tiny_llama.name, prompt=PROMPT, max_tokens=TOKENS, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = [chunk async for chunk in stream]
        # A stop string cuts the answer where it first appears, as OpenAI's do.
        stop = text[len(text) // 2:len(text) // 2 + 3]
        stopped = await api.completions.create(model=tiny_llama.name, prompt=PROMPT,
                                               max_tokens=TOKENS, stop=[stop],
                                               extra_body={"ignore_eos": True})
    assert answer.choices[0].text == text
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None
    assert (answer.usage.completion_tokens, answer.usage.total_tokens) == \
        (TOKENS, TOKENS + answer.usage.prompt_tokens)
    *content, last = chunks
    assert "".join(c.choices[0].text for c in content) == text
    assert content[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage == answer.usage
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[:text.index(stop)]


async def test_eight_concurrent_streams_each_equal_their_answer(
        tiny_llama: Path, mosquitto_broker: BrokerHandle) -> None:
    plant = plant_for(tiny_llama, mosquitto_broker, [(0, 3), (3, 6)])
    prompts = [f"{PROMPT} (case {i})" for i in range(8)]
    async with running(plant), serving(plant) as gateway:
        api = client(gateway)

        async def streamed(prompt: str) -> str:
            stream = await api.chat.completions.create(
                model=tiny_llama.name, messages=[{"role": "user", "content": prompt}],
                max_tokens=TOKENS, stream=True, extra_body={"ignore_eos": True})
            return "".join([c.choices[0].delta.content or "" async for c in stream])

        texts = await asyncio.gather(*(streamed(p) for p in prompts))
        for prompt, text in zip(prompts, texts, strict=True):
            expected = reference_tokens(tiny_llama, GenerateRequest(
                id="ref", messages=[ChatMessage(role="user", content=prompt)],
                max_tokens=TOKENS, ignore_eos=True))
            assert text == _decode(tiny_llama, expected), prompt
    assert len(set(texts)) > 1  # eight different answers, not one repeated


async def _raw(url: str, body: bytes | None = None) -> tuple[int, Any]:
    """POST `body` (or GET) with no client library in between: status and JSON answer."""
    def call() -> tuple[int, Any]:
        request = urllib.request.Request(url, data=body,
                                         headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=WAIT_S) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())
    return await asyncio.to_thread(call)


async def _status(call: Awaitable[object]) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        await call
    return caught.value


async def test_bad_input_is_400_with_openais_error_object(tiny_llama: Path,
                                                          mosquitto_broker: BrokerHandle) -> None:
    plant = plant_for(tiny_llama, mosquitto_broker, [(0, 6)], max_tokens_limit=64)
    async with running(plant), serving(plant) as gateway:
        api = client(gateway)
        chat = api.chat.completions
        cases: dict[str, Callable[[], Awaitable[object]]] = {
            # caught by the gateway's own schema
            "temperature": lambda: chat.create(model=tiny_llama.name, temperature=3,
                                               messages=[{"role": "user", "content": "hi"}]),
            "messages": lambda: chat.create(model=tiny_llama.name, messages=[]),
            "tools": lambda: chat.create(
                model=tiny_llama.name, messages=[{"role": "user", "content": "hi"}],
                tools=[{"type": "function", "function": {"name": "f"}}]),
            # caught by the coordinator: over the plant's max_tokens_limit
            "max_tokens": lambda: chat.create(model=tiny_llama.name, max_tokens=65,
                                              messages=[{"role": "user", "content": "hi"}]),
        }
        for name, call in cases.items():
            error = await _status(call())
            assert error.status_code == 400, (name, error)
            assert name in error.message, (name, error.message)
        assert (await _status(chat.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}]))).status_code == 404
        big = await _raw(f"{gateway.url}/completions", b"x" * (300 * 1024))
        garbage = await _raw(f"{gateway.url}/completions", b"{not json")
        # Numbers past any field's bound, named by their field.
        digits = await _raw(f"{gateway.url}/completions",
                            b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}")
        stop = await _raw(f"{gateway.url}/completions",
                          b'{"prompt": "x", "stop": ["' + b"s" * 300 + b'"]}')
        # Still serving after all that.
        ok = await api.completions.create(model=tiny_llama.name, prompt=PROMPT, max_tokens=2)
    assert big[0] == 413 and big[1]["error"]["code"] == "too_large"
    assert garbage[0] == 400
    assert set(garbage[1]["error"]) == {"message", "type", "param", "code"}
    assert digits[0] == 400 and digits[1]["error"]["param"] == "max_tokens"
    assert digits[1]["error"]["message"].startswith("max_tokens: a number of 5000 characters")
    assert stop[0] == 400 and stop[1]["error"]["param"] == "stop.0"
    assert ok.choices[0].finish_reason in ("stop", "length")


@asynccontextmanager
async def coordinator_only(plant: Plant) -> AsyncIterator[Coordinator]:
    """The coordinator of `plant` with none of its stages running."""
    stop = asyncio.Event()
    coordinator = Coordinator(plant, tokenizer=tokenizer(plant.model))
    task = asyncio.create_task(coordinator.serve(stop))
    try:
        yield coordinator
    finally:
        stop.set()
        await task


async def _until(condition: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(WAIT_S):
        while not condition():
            await asyncio.sleep(0.05)
    assert condition(), what


# The test lasts STAGE_WAIT_S (the 503 ends it). The 429s come while the hasty gateway's
# request waits: two HTTP calls in this process, within its HASTY_TIMEOUT_S. From the first
# request to the second 429 took 0.11-0.28 s with the box's two cores busy with other
# tests: the timeout leaves 3.5 times the slowest. Its 504 fires half a second before the
# coordinator would answer it 503: both timers run in this event loop, so a loaded box
# delays them alike and their order holds.
STAGE_WAIT_S = 1.5
HASTY_TIMEOUT_S = 1.0


async def test_busy_unavailable_and_timeout_statuses(tiny_llama: Path,
                                                     mosquitto_broker: BrokerHandle) -> None:
    """429 (the coordinator's limit and the gateway's own), 503 and 504, with no stage up.

    Two gateways share the identity `http`, as two `edgebus http` processes may.
    """
    # Both gateways are `http`: its share of max_in_flight is the whole here. No waiting
    # room (max_queue 0): the third request is refused at once.
    plant = plant_for(tiny_llama, mosquitto_broker, [(0, 6)], max_in_flight=2,
                      max_in_flight_per_client=2, max_queue=0)
    # The hasty gateway gives up (504) before the coordinator stops waiting for a stage
    # (503), and both waits bound the test's time: short, with room for the 429s between.
    plant = plant.model_copy(update={"liveness": Liveness(stage_wait_s=STAGE_WAIT_S)})
    messages = [{"role": "user", "content": "hi"}]
    async with coordinator_only(plant) as coordinator, serving(plant) as patient, \
            serving(plant, timeout_s=HASTY_TIMEOUT_S, max_in_flight=1) as hasty:
        slow, fast = client(patient), client(hasty)
        started = time.monotonic()
        # Both wait for a stage: the coordinator's two slots are taken.
        unavailable = asyncio.ensure_future(_status(slow.chat.completions.create(
            model=tiny_llama.name, messages=messages)))  # type: ignore[arg-type]
        timeout = asyncio.ensure_future(_status(fast.chat.completions.create(
            model=tiny_llama.name, messages=messages, stream=True)))  # type: ignore[arg-type]
        await _until(lambda: len(coordinator._active) == 2, "two requests admitted")
        busy = await _status(slow.chat.completions.create(
            model=tiny_llama.name, messages=messages))  # type: ignore[arg-type]
        full = await _status(fast.chat.completions.create(
            model=tiny_llama.name, messages=messages))  # type: ignore[arg-type]
        timed_out, gone = await timeout, await unavailable
        elapsed = time.monotonic() - started
        # The gateway that gave up cancelled its request: the coordinator lets it go.
        await _until(lambda: not coordinator._active, "every request ended")
    assert busy.status_code == 429 and busy.code == "busy"
    # Nothing has finished yet to measure a rate by: the coordinator's default retry time.
    assert busy.response.headers["retry-after"] == str(math.ceil(UNMEASURED_RETRY_S))
    assert "2 requests in flight" in busy.message
    assert full.status_code == 429 and "1 requests in flight at this gateway" in full.message
    assert full.response.headers["retry-after"] == "2"
    assert timed_out.status_code == 504 and timed_out.code == "timeout"
    assert gone.status_code == 503 and gone.code == "unavailable"
    assert "no live node" in gone.message
    assert elapsed >= STAGE_WAIT_S


async def test_past_its_connection_bound_uvicorn_answers_503_at_once(
        tiny_llama: Path, mosquitto_broker: BrokerHandle) -> None:
    """uvicorn's limit_concurrency is --max-in-flight plus EXTRA_CONNECTIONS: a request on
    a connection past it (its own counted) gets 503 before it is read, and one on a
    connection within it is served."""
    plant = plant_for(tiny_llama, mosquitto_broker, [(0, 6)])
    limit = 1 + EXTRA_CONNECTIONS

    def status() -> int:
        try:
            with urllib.request.urlopen(f"{gateway.url}/models", timeout=WAIT_S) as response:
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    async with serving(plant, max_in_flight=1) as gateway:
        connections = gateway.server.server_state.connections
        idle = [await asyncio.open_connection(gateway.host, gateway.port)
                for _ in range(limit - 1)]
        try:
            await _until(lambda: len(connections) == limit - 1, "the idle connections open")
            at_bound = await asyncio.to_thread(status)
            idle.pop()[1].close()
            await _until(lambda: len(connections) == limit - 2, "one idle connection closed")
            within = await asyncio.to_thread(status)
        finally:
            for _, writer in idle:
                writer.close()
    assert at_bound == 503
    assert within == 200


@asynccontextmanager
async def agents(plant: Plant) -> AsyncIterator[tuple[list[StageAgent], Coordinator]]:
    """Like tests/pipeline.py's `running`, but the coordinator is shown too."""
    stop = asyncio.Event()
    stages = [StageAgent(plant, s.node, model=stage_model(plant.model, *s.layers))
              for s in plant.stages]
    coordinator = Coordinator(plant, tokenizer=tokenizer(plant.model))
    everyone: list[StageAgent | Coordinator] = [*stages, coordinator]
    tasks = [asyncio.create_task(agent.serve(stop)) for agent in everyone]
    try:
        await asyncio.wait_for(coordinator._ready.wait(), WAIT_S)
        yield stages, coordinator
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def test_a_client_that_leaves_mid_stream_frees_the_kv_caches(
        tiny_llama: Path, mosquitto_broker: BrokerHandle) -> None:
    # Far more than it can make before the cancel lands: a stage of this 64-wide model steps
    # in well under a millisecond, and 2000 tokens were once all made first on a loaded box.
    asked = 20_000
    plant = plant_for(tiny_llama, mosquitto_broker, [(0, 3), (3, 6)],
                      max_tokens_limit=asked + 48)
    async with agents(plant) as (stages, coordinator), serving(plant) as gateway:
        api = client(gateway)
        stream = await api.completions.create(model=tiny_llama.name, prompt=PROMPT,
                                              max_tokens=asked, stream=True,
                                              extra_body={"ignore_eos": True})
        got = 0
        async for chunk in stream:
            got += bool(chunk.choices[0].text)
            if got == 5:
                break
        assert all(s._metrics()["kv_bytes"] > 0 for s in stages)
        await stream.close()
        await _until(lambda: not coordinator._active, "the coordinator ended the request")
        await _until(lambda: all(s._metrics()["kv_bytes"] == 0 for s in stages),
                     "every stage freed the request's KV cache")
        assert not gateway.gateway.pending
        assert coordinator.counters["cancelled"] == 1
        # A client waiting for a whole (non-streamed) answer hangs up mid-generation.
        body = json.dumps({"prompt": PROMPT, "max_tokens": asked, "ignore_eos": True}).encode()
        _, writer = await asyncio.open_connection(gateway.host, gateway.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        await _until(lambda: all(s._metrics()["kv_bytes"] > 0 for s in stages),
                     "the second request is generating")
        writer.close()
        await writer.wait_closed()
        await _until(lambda: all(s._metrics()["kv_bytes"] == 0 for s in stages)
                     and not coordinator._active, "the second request was cancelled too")
    assert coordinator.counters["cancelled"] == 2
    assert coordinator.counters["tokens"] < 2 * asked


def _secured(plant: Plant, home: Path) -> Plant:
    """`plant` with security: on (identities, passwords, one API key), as its file on disk.

    The test broker admits anyone; what is checked here is the gateway's key.
    """
    security = Security(credentials=home / "credentials", gateways=["http"],
                        api_keys=["editor"])
    ensure_passwords(security.credentials,
                     [*(s.node for s in plant.stages), plant.coordinator.id, "http"])
    ensure_api_keys(security.credentials, security.api_keys)
    return plant.model_copy(update={"security": security})


async def test_edgebus_http_asks_for_an_api_key(tiny_llama: Path, mosquitto_broker: BrokerHandle,
                                                tmp_path: Path) -> None:
    """The real command, with security on: no key or a wrong one is 401, the key answers."""
    plant = _secured(plant_for(tiny_llama, mosquitto_broker, [(0, 6)]), tmp_path)
    path = tmp_path / "plant.yaml"
    write_plant(plant, path)
    assert plant.security is not None
    key = key_path(plant.security.credentials, "editor").read_text().strip()
    port = free_port(LOOPBACK)
    log = tmp_path / "http.log"
    expected = reference_tokens(tiny_llama, GenerateRequest(
        id="ref", messages=[ChatMessage(role="user", content="hi")], max_tokens=TOKENS,
        ignore_eos=True))
    async with running(plant):
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "edgebus", "http", str(path), "--listen",
                 f"{LOOPBACK}:{port}"], stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, "HF_HUB_OFFLINE": "1"})
        try:
            url = f"http://{LOOPBACK}:{port}/v1"
            await _until(lambda: "serving the OpenAI API" in log.read_text()
                         or proc.poll() is not None, "edgebus http started")
            assert proc.poll() is None, log.read_text()
            assert url in log.read_text()
            api = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=WAIT_S)
            wrong = openai.AsyncOpenAI(base_url=url, api_key=key[:-1] + "x", max_retries=0)
            denied = await _status(wrong.models.list())
            keyless = await _raw(f"{url}/models")
            answer = await api.chat.completions.create(
                model=tiny_llama.name, messages=[{"role": "user", "content": "hi"}],
                max_tokens=TOKENS, extra_body={"ignore_eos": True})
        finally:
            proc.terminate()
            proc.wait(WAIT_S)
    assert denied.status_code == 401 and denied.code == "invalid_api_key"
    assert keyless[0] == 401
    assert keyless[1]["error"]["type"] == "authentication_error"
    assert answer.choices[0].message.content == _decode(tiny_llama, expected)


def test_without_security_it_listens_on_the_loopback_only(tiny_llama: Path,
                                                          mosquitto_broker: BrokerHandle) -> None:
    plant = plant_for(tiny_llama, mosquitto_broker, [(0, 6)])
    with pytest.raises(Exception, match=r"beyond this box's loopback.*--listen 127\.0\.0\.1"):
        HttpGateway(plant, listen="0.0.0.0:8000")


async def test_a_stream_served_again_with_other_text_ends_in_an_error_not_a_stitch() -> None:
    # A restarted coordinator serves a journaled request again from index 0; a
    # run that drew other tokens must not be glued onto the deltas already out.
    request = GenerateRequest(id="r", prompt="p", stream=True)
    pending = Pending(request, asyncio.Queue(8))
    pending.put(StreamDelta(id="r", index=0, delta="Check the"))
    pending.put(GenerateResponse(id="r", text="Replace the seal", finish_reason="length"))
    first = await pending.next(1)
    lines = [line async for line in _events(pending, _Shape(True, "r", "m"), first, False, 1)]
    assert "Replace" not in "".join(lines) and "[DONE]" not in lines
    assert json.loads(lines[-1])["error"]["code"] == "stream_diverged"
    # The same text again, as a resumed request with its journaled seed gives it: no error.
    pending = Pending(request, asyncio.Queue(8))
    pending.put(StreamDelta(id="r", index=0, delta="Check the"))
    pending.put(GenerateResponse(id="r", text="Check the seal", finish_reason="length"))
    first = await pending.next(1)
    lines = [line async for line in _events(pending, _Shape(True, "r", "m"), first, False, 1)]
    assert lines[-1] == "[DONE]" and " seal" in "".join(lines)


async def test_a_wait_for_an_answer_ends_when_cancelled_as_a_delta_arrives() -> None:
    # Python 3.11's asyncio.wait_for returned the inner result when a cancel met a get that
    # had just completed, so a client's hang-up was lost and the request ran to its end
    # (it failed CI once, at 20,000 tokens). The delta and the cancel land in one loop turn.
    request = GenerateRequest(id="r", prompt="p")
    pending = Pending(request, asyncio.Queue(8))
    waiting = asyncio.create_task(pending.answer(WAIT_S))
    await asyncio.sleep(0)  # now parked in queue.get()
    pending.put(StreamDelta(id="r", index=0, delta="Check"))
    waiting.cancel()
    done, _ = await asyncio.wait({waiting}, timeout=WAIT_S)
    assert done and waiting.cancelled()
