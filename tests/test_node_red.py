"""The shipped Node-RED flow (docs/examples/node-red-plc-flow.json) against a running plant.

A real Node-RED, installed by `.ci/run` from the npm registry, gets the flow the
way an integrator's does (through its admin API, as the editor's Deploy), with the
settings in its environment as docs/deploy.md says. The plant runs on a
secured Mosquitto that admits the flow only as its gateway identity; the PLC's
tags are on a second, plain Mosquitto, as on a site's tag broker. A PLC alarm
tag change must come back as the answer on the machine's advice tag: the
plant's answer to the `alarm_summary` task, token-exact against `generate` on
the rendered chat; a tag value the template's type refuses comes back as the
coded error on the error tag.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack, contextmanager
from pathlib import Path

import aiomqtt
import optional
import pytest
from brokers import BrokerHandle, MosquittoBroker
from certs import plant_tls, tls_context
from pipeline import reference_tokens, running

from broker.mosquitto_config import write_mosquitto_config
from edgebus.core.messages import ChatMessage, GenerateRequest, GenerateResponse
from edgebus.core.processes import LOOPBACK, free_port
from plant_config import BrokerSettings, Plant, StageSpec
from plant_config.broker_section import Security
from plant_config.tasks import TaskTemplate

REPO = Path(__file__).resolve().parents[1]
FLOW = REPO / "docs" / "examples" / "node-red-plc-flow.json"
# Where `.ci/run` installs Node-RED (`npm install --prefix .ci/node-red`).
NODE_RED = REPO / ".ci" / "node-red" / "node_modules" / ".bin" / "node-red"
INSTALL_HINT = (f"Node-RED is not installed at {NODE_RED}: .ci/run installs it (its `npm "
                "install --prefix .ci/node-red` line alone does too)")
GATEWAY = "node-red"
# The task the flow fills in: its name and vars as `edgebus init` writes them.
ALARM = TaskTemplate(
    system="You are a maintenance assistant at a metal press plant. Answer in one sentence.",
    user="Machine {machine} raised alarm {code}. What should the operator check first?",
    vars={"code": "int", "machine": "str"}, max_tokens=16)
# Node-RED is ready in ~1.2 s here; its first start on a loaded 2-core CI box, with the
# plant's agents beside it, gets ample room.
START_S = 60.0
# The whole round trip (tag broker, Node-RED, plant, back) takes well under a second
# with the tiny model; this bounds a hang, not the speed.
ANSWER_S = 60.0


def with_node_red(plant_dir: Path, tiny_llama: Path) -> Plant:
    """A one-stage plant that serves the alarm task, secured and over TLS as `init` makes a
    plant, with the flow's gateway."""
    credentials = plant_dir / "credentials"
    tls = plant_tls(credentials)
    return Plant(
        plant_id="nr", topic_root=f"edgebus-test/{secrets.token_hex(4)}",
        broker=BrokerSettings(url=f"mqtts://{LOOPBACK}:{free_port(LOOPBACK)}", protocol="5",
                              ca_file=tls.cafile),
        model=tiny_llama, stages=[StageSpec(node="stage-0", layers=(0, 6))],
        security=Security(credentials=credentials, gateways=[GATEWAY], tls=tls),
        tasks={"alarm_summary": ALARM})


@contextmanager
def node_red(user_dir: Path, env: dict[str, str]) -> Iterator[tuple[str, Path]]:
    """Node-RED on a free loopback port with an empty user directory: its URL and its log."""
    port = free_port(LOOPBACK)
    user_dir.mkdir()
    log = user_dir / "node-red.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(NODE_RED), "--userDir", str(user_dir), "--port", str(port),
             "-D", f"uiHost={LOOPBACK}"],
            env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield f"http://{LOOPBACK}:{port}", log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        print(f"--- node-red log ---\n{log.read_text(errors='replace')}")


async def until(what: str, check: Callable[[], bool], log: Path) -> None:
    """Poll `check()` (blocking, short) off the event loop the plant runs on until it is true."""
    deadline = time.monotonic() + START_S
    while not await asyncio.to_thread(check):
        if time.monotonic() > deadline:
            raise AssertionError(f"Node-RED: {what} after {START_S:.0f} s; its log:\n"
                                 f"{log.read_text(errors='replace')}")
        await asyncio.sleep(0.2)


def listening(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/flows", timeout=5) as response:
            return bool(response.status == 200)
    except OSError:  # connection refused until it listens
        return False


def deploy(url: str, flow: bytes) -> None:
    """POST the flow file to the admin API, as the editor's Import and Deploy do."""
    request = urllib.request.Request(f"{url}/flows", data=flow, method="POST", headers={
        "Content-Type": "application/json", "Node-RED-Deployment-Type": "full"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 204, response.read()


async def test_a_plc_alarm_tag_gets_the_plants_answer_through_node_red(
        tiny_llama: Path, tmp_path: Path, mosquitto_broker: BrokerHandle) -> None:
    if not NODE_RED.exists() or shutil.which("node") is None:
        optional.missing(INSTALL_HINT)
    plant = with_node_red(tmp_path / "plant", tiny_llama)
    write_mosquitto_config(plant, tmp_path / "conf", bind=LOOPBACK)
    plant_endpoint = plant.endpoint_for(GATEWAY)
    plant_broker = MosquittoBroker(tmp_path / "mosquitto", port=plant_endpoint.port,
                                   include_dir=tmp_path / "conf")
    tags = f"plant-tags/{secrets.token_hex(4)}"
    env = {"EDGEBUS_BROKER_HOST": LOOPBACK, "EDGEBUS_BROKER_PORT": str(plant_endpoint.port),
           "EDGEBUS_TOPIC_ROOT": plant.topic_root, "EDGEBUS_GATEWAY": GATEWAY,
           "EDGEBUS_CLIENT_ID": f"{plant.plant_id}.{GATEWAY}",
           "EDGEBUS_GATEWAY_PASSWORD": plant_endpoint.password or "",
           "EDGEBUS_CA_FILE": str(plant_endpoint.ca_file),
           "PLC_BROKER_HOST": mosquitto_broker.host,
           "PLC_BROKER_PORT": str(mosquitto_broker.port), "PLC_TAG_ROOT": tags}
    received: dict[str, str] = {}  # non-empty tag values by topic
    answers: list[GenerateResponse] = []
    plant_broker.start()
    try:
        async with running(plant), AsyncExitStack() as stack:
            url, log = stack.enter_context(node_red(tmp_path / "node-red", env))
            await until("not listening", lambda: listening(url), log)
            await asyncio.to_thread(deploy, url, FLOW.read_bytes())
            plc = await stack.enter_async_context(aiomqtt.Client(
                mosquitto_broker.host, mosquitto_broker.port, identifier=f"plc-{tags[-8:]}"))
            # Seeing what Node-RED is sent needs its own login: the broker lets nobody else read it.
            observer = await stack.enter_async_context(aiomqtt.Client(
                LOOPBACK, plant_endpoint.port, username=GATEWAY,
                password=plant_endpoint.password, identifier=f"observer-{tags[-8:]}",
                tls_context=tls_context(plant_endpoint)))
            await plc.subscribe(f"{tags}/+/+", qos=1)
            await observer.subscribe(f"{plant.topic_root}/llm/response/{GATEWAY}/+", qos=1)
            # Retained, as a PLC connector's tags often are: the flow reads alarms only
            # once it is connected to the plant's broker, and then still sees them.
            await plc.publish(f"{tags}/press-3/alarm", b"4711", qos=1, retain=True)
            await plc.publish(f"{tags}/press-4/alarm", b"4711.5", qos=1, retain=True)

            async def collect_tags() -> None:
                async for message in plc.messages:
                    payload = bytes(message.payload).decode()
                    if payload and not message.topic.value.endswith("/alarm"):
                        received[message.topic.value] = payload
                    if {f"{tags}/press-3/alarm_advice",
                            f"{tags}/press-4/alarm_advice_error"} <= received.keys():
                        return

            async def collect_answers() -> None:
                async for message in observer.messages:
                    answers.append(GenerateResponse.model_validate_json(
                        bytes(message.payload)))
                    if len(answers) == 2:
                        return

            try:
                await asyncio.wait_for(asyncio.gather(collect_tags(), collect_answers()),
                                       ANSWER_S)
            except TimeoutError:
                pytest.fail(f"after {ANSWER_S:.0f} s the tags had {received} and the plant "
                            f"had answered {answers} (Node-RED's log follows)")
    finally:
        plant_broker.stop()
    # The flow's request ids start with the machine's name.
    [answer] = [a for a in answers if a.id.startswith("press-3-")]
    [refused] = [a for a in answers if a.id.startswith("press-4-")]
    rendered = GenerateRequest(id="ref", max_tokens=ALARM.max_tokens, messages=[
        ChatMessage(role="system", content=ALARM.system or ""),
        ChatMessage(role="user", content="Machine press-3 raised alarm 4711. "
                                         "What should the operator check first?")])
    assert answer.error is None and answer.text
    assert answer.tokens == reference_tokens(tiny_llama, rendered)
    assert received[f"{tags}/press-3/alarm_advice"] == answer.text
    assert refused.error is not None and refused.error.code == "wrong_type"
    assert received[f"{tags}/press-4/alarm_advice_error"] == \
        f"wrong_type: {refused.error.message}"
    assert "code must be int" in refused.error.message
    # Only the two tags that were asked about got an answer: nothing went to a wrong machine.
    assert set(received) == {f"{tags}/press-3/alarm_advice", f"{tags}/press-4/alarm_advice_error"}
