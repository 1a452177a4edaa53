"""PLC task templates and gateway cancels, through a real broker.

A PLC publishes a task name and tag values; the answer must be what
`generate` gives for the rendered chat. Every bad task request gets a coded
error that names what is wrong. A cancel ends a request and frees its KV caches.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path
from typing import Any

import pytest
from brokers import BrokerHandle
from pipeline import plant_for, reference_tokens, running
from pydantic import ValidationError
from test_pipeline import TINY_SPLITS

from edgebus.ask import ask
from edgebus.core.client import BusClient
from edgebus.core.messages import ChatMessage, GenerateRequest
from plant_config import Plant
from plant_config.tasks import TaskTemplate

ALARM = TaskTemplate(
    system="You are a maintenance assistant at a metal press plant. Answer in one sentence.",
    user="Machine {machine} raised alarm {code} (oil {oil_c} C, guard closed: {closed}). "
         "What should the operator check first?",
    vars={"code": "int", "machine": "str", "oil_c": "float", "closed": "bool"},
    max_tokens=12)
VARS: dict[str, Any] = {"code": 4711, "machine": "press 3", "oil_c": 61.5, "closed": True}
# What ALARM renders for VARS, written out by hand: the test of the rendering.
RENDERED = [ChatMessage(role="system", content=ALARM.system or ""),
            ChatMessage(role="user", content="Machine press 3 raised alarm 4711 (oil 61.5 C, "
                        "guard closed: true). What should the operator check first?")]
# Long enough that a cancel sent once the first delta arrives lands mid-generation.
LONG_TOKENS = 400
# The request that a stale cancel must leave alone: it decodes every token, so fewer than
# LONG_TOKENS, still many times the few milliseconds a cancel takes to arrive.
FOLLOWING_TOKENS = 96


def with_tasks(plant: Plant) -> Plant:
    return plant.model_copy(update={"tasks": {"alarm_summary": ALARM}})


async def test_a_task_request_answers_what_generate_gives_for_the_rendered_chat(
        tiny_llama: Path, amqtt_broker: BrokerHandle) -> None:
    plant = with_tasks(plant_for(tiny_llama, amqtt_broker, TINY_SPLITS["3-stages-uneven"]))
    async with running(plant):
        response = await ask(plant, GenerateRequest.model_validate(
            {"id": "t1", "task": "alarm_summary", "vars": VARS}))
        # A request's own knobs win over the template's defaults.
        longer = await ask(plant, GenerateRequest.model_validate(
            {"id": "t2", "task": "alarm_summary", "vars": VARS, "max_tokens": 16}))
    assert response.error is None and longer.error is None
    expected = GenerateRequest(id="ref", messages=RENDERED, max_tokens=ALARM.max_tokens)
    assert response.tokens == reference_tokens(tiny_llama, expected)
    assert longer.tokens == reference_tokens(
        tiny_llama, expected.model_copy(update={"max_tokens": 16}))
    assert len(longer.tokens) == 16 or longer.finish_reason == "stop"


@pytest.mark.parametrize(("fields", "code", "named"), [
    ({"task": "alarm_sumary", "vars": VARS}, "unknown_task", "alarm_summary"),
    ({"task": "alarm_summary", "vars": {**VARS, "code": "4711"}},
     "wrong_type", "code must be int"),
    ({"task": "alarm_summary", "vars": {**VARS, "closed": 1}}, "wrong_type", "closed must be bool"),
    ({"task": "alarm_summary", "vars": {**VARS, "code": True}}, "wrong_type", "code must be int"),
    ({"task": "alarm_summary", "vars": {k: v for k, v in VARS.items() if k != "machine"}},
     "missing_var", "machine"),
    ({"task": "alarm_summary", "vars": {**VARS, "line": 2}}, "unknown_var", "line"),
])
async def test_a_bad_task_request_gets_a_coded_error_naming_it(
        tiny_llama: Path, mosquitto_broker: BrokerHandle, fields: dict[str, Any], code: str,
        named: str) -> None:
    plant = with_tasks(plant_for(tiny_llama, mosquitto_broker, [(0, 6)]))
    async with running(plant):
        response = await ask(plant, GenerateRequest.model_validate({"id": "bad", **fields}))
        # ... and the plant goes on serving.
        good = await ask(plant, GenerateRequest.model_validate(
            {"id": "good", "task": "alarm_summary", "vars": VARS}))
    assert response.error is not None, response
    assert (response.error.code, response.finish_reason) == (code, "error")
    assert named in response.error.message
    assert good.error is None and len(good.tokens) > 0


@pytest.mark.parametrize(("template", "complaint"), [
    ({"user": "alarm {code}"}, "does not declare them"),
    ({"user": "alarm", "vars": {"code": "int"}}, "neither system nor user uses them"),
    ({"user": "alarm {code.__class__}", "vars": {"code": "int"}}, "not a plain variable"),
    ({"user": "alarm {code:04d}", "vars": {"code": "int"}}, "not a plain variable"),
    ({"user": "alarm {code}", "vars": {"code": "integer"}}, "'str', 'int', 'float' or 'bool'"),
])
def test_a_bad_template_is_refused_when_the_plant_file_loads(template: dict[str, Any],
                                                             complaint: str) -> None:
    with pytest.raises(ValidationError, match=complaint):
        TaskTemplate.model_validate(template)


def test_literal_braces_stay_and_a_request_names_one_kind_of_prompt() -> None:
    template = TaskTemplate.model_validate({"user": "{{json}} for {m}", "vars": {"m": "str"}})
    assert template.render("t", {"m": "press 3"})[0].content == "{json} for press 3"
    with pytest.raises(ValidationError, match="exactly one of 'prompt'"):
        GenerateRequest.model_validate({"id": "x", "prompt": "p", "task": "t"})
    with pytest.raises(ValidationError, match="give 'task' with them"):
        GenerateRequest.model_validate({"id": "x", "prompt": "p", "vars": {"a": 1}})


async def test_a_cancel_ends_the_request_and_frees_its_kv_caches(
        tiny_llama: Path, amqtt_broker: BrokerHandle) -> None:
    plant = plant_for(tiny_llama, amqtt_broker, [(0, 3), (3, 6)])
    gateway = f"gw-{secrets.token_hex(3)}"
    async with running(plant) as stages:
        streaming = asyncio.Event()
        request = GenerateRequest(id="long", prompt="count to a thousand:",
                                  max_tokens=LONG_TOKENS, ignore_eos=True, stream=True)
        asking = asyncio.create_task(ask(plant, request, client_id=gateway,
                                         on_delta=lambda _: streaming.set()))
        await asyncio.wait_for(streaming.wait(), 30)
        await cancel(plant, gateway, "long")
        response = await asyncio.wait_for(asking, 30)
        assert response.error is not None and response.error.code == "cancelled", response
        assert "cancelled by the gateway" in response.error.message
        # RELEASE frames reach the stages after the answer leaves: wait for them.
        for _ in range(100):
            if all(not stage.caches for stage in stages):
                break
            await asyncio.sleep(0.1)
        assert [len(stage.caches) for stage in stages] == [0, 0]
        # A cancel for a request no longer in flight changes nothing, not even for the
        # gateway's request in flight now: it lands while "next" streams.
        streaming.clear()
        following = GenerateRequest(id="next", prompt="hi", max_tokens=FOLLOWING_TOKENS,
                                    ignore_eos=True, stream=True)
        asking = asyncio.create_task(ask(plant, following, client_id=gateway,
                                         on_delta=lambda _: streaming.set()))
        await asyncio.wait_for(streaming.wait(), 30)
        await cancel(plant, gateway, "long")
        after = await asyncio.wait_for(asking, 60)
        assert after.error is None and len(after.tokens) == FOLLOWING_TOKENS, after.error


async def cancel(plant: Plant, gateway: str, request_id: str) -> None:
    bus = BusClient(plant.broker.endpoint(), f"test.cancel-{secrets.token_hex(3)}")
    runner = asyncio.create_task(bus.run(lambda message: None))
    try:
        await bus.wait_connected(10)
        await bus.publish(plant.topics.cancel(gateway), json.dumps({"id": request_id}))
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)

