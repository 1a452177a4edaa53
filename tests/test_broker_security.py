"""Broker security: the generated Mosquitto config, and the embedded broker's, enforced for real.

Every test runs a real broker with what `edgebus broker mosquitto-config`
writes (Mosquitto) or what `broker.amqtt_security` configures (amqtt), and
real clients logging in with the passwords the generator left in the
credentials directory. A forbidden message is shown undelivered by a marker:
the reader subscribes, the forbidden publish completes (QoS 1, acknowledged),
then an allowed client publishes a marker the reader may read. Brokers keep
per-subscriber order, so if the forbidden message had been delivered it would
have arrived first.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import secrets
import socket
import ssl
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path

import aiomqtt
import pytest
import trustme
import yaml
from brokers import AmqttBroker, BrokerHandle, MosquittoBroker
from certs import broker_tls
from gguf_models import PROCESS_KV_BUDGET_MB
from pipeline import plant_reference, reference_tokens, running
from plant_gateway import edgebus_up

from broker.acl import client_id_owner
from broker.amqtt_security import plugins_for
from broker.embedded import EmbeddedBroker
from broker.mosquitto_config import write_mosquitto_config
from broker.passwd import hash_password, verify_password
from edgebus.ask import ask
from edgebus.core import tls
from edgebus.core.client import BusClient
from edgebus.core.errors import BusError, EdgebusError, PlantConfigError
from edgebus.core.messages import AgentStatus, GenerateRequest, GenerateResponse
from edgebus.core.processes import LOOPBACK, free_port
from node_agent.cancel import cancel_all
from plant_config import BrokerSettings, Plant, StageSpec, load_plant
from plant_config.broker_section import BrokerTls, Security
from plant_config.credentials import password_path

WAIT_S = 10.0
GATEWAYS = ["plc-1", "plc-2"]
SECURED_KINDS = ["mosquitto", "amqtt"]


def secured_plant(tmp_path: Path, url: str, *, model: Path | None = None, mqtt5: bool = True,
                  tls: BrokerTls | None = None, ca_file: Path | None = None) -> Plant:
    """Two stages, two gateways and an ops identity; passwords under tmp_path/credentials."""
    return Plant(
        plant_id="sec", topic_root=f"edgebus-test/{secrets.token_hex(4)}",
        broker=BrokerSettings(url=url, protocol="5" if mqtt5 else "3.1.1", ca_file=ca_file),
        model=model or tmp_path / "no-model",
        stages=[StageSpec(node="stage-0", layers=(0, 3)), StageSpec(node="stage-1", layers=(3, 6))],
        security=Security(credentials=tmp_path / "credentials", gateways=GATEWAYS, ops=["ops"],
                          password_file=tmp_path / "conf" / "passwd", tls=tls))


def start_secured(kind: str, plant: Plant, tmp_path: Path) -> BrokerHandle:
    """A broker of `kind` that enforces `plant`'s security, on the port of `plant`'s URL."""
    write_mosquitto_config(plant, tmp_path / "conf", bind=LOOPBACK)
    port = plant.broker.endpoint().port
    broker: BrokerHandle
    if kind == "mosquitto":
        broker = MosquittoBroker(tmp_path / "mosquitto", port=port, include_dir=tmp_path / "conf")
    else:
        broker = AmqttBroker(plugins_for(plant))
        broker.port = port
    broker.start()
    return broker


@pytest.fixture(params=SECURED_KINDS, ids=SECURED_KINDS)
def secured(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Plant]:
    """A secured broker of each kind in turn, and the plant it serves (no model on disk)."""
    mqtt5 = request.param == "mosquitto"  # amqtt speaks 3.1.1 only
    plant = secured_plant(tmp_path, f"mqtt://{LOOPBACK}:{free_port(LOOPBACK)}", mqtt5=mqtt5)
    broker = start_secured(request.param, plant, tmp_path)
    yield plant
    broker.stop()


@asynccontextmanager
async def login(plant: Plant, identity: str | None,
                password: str | None = None) -> AsyncIterator[aiomqtt.Client]:
    """A bare MQTT client as `identity` with its password (or `password`); None: anonymous."""
    endpoint = plant.broker_endpoint()  # over TLS where the plant's broker serves it
    user = None
    if identity is not None:
        user = identity
        password = password or plant.endpoint_for(identity).password
    async with aiomqtt.Client(
            endpoint.host, endpoint.port, username=user, password=password,
            identifier=f"{plant.plant_id}.{identity}.{secrets.token_hex(3)}",
            tls_context=tls.client_context(endpoint) if endpoint.tls else None,
            protocol=aiomqtt.ProtocolVersion.V5 if endpoint.protocol == "5"
            else aiomqtt.ProtocolVersion.V311) as client:
        yield client


async def first_message(client: aiomqtt.Client) -> aiomqtt.Message:
    return await asyncio.wait_for(anext(aiter(client.messages)), WAIT_S)


async def publish_maybe_refused(client: aiomqtt.Client, topic: str, payload: bytes) -> None:
    # Over MQTT 5 Mosquitto may say "not authorised" in the PUBACK; either way
    # the message must not reach anyone, which the marker shows.
    with contextlib.suppress(aiomqtt.MqttCodeError):
        await client.publish(topic, payload, qos=1)


# -- passwords ---------------------------------------------------------------------------


def test_hashes_match_mosquitto_passwd_both_ways(tmp_path: Path) -> None:
    password = secrets.token_urlsafe(16)
    path = tmp_path / "passwd"
    subprocess.run(["mosquitto_passwd", "-c", "-b", str(path), "alice", password], check=True)
    theirs = path.read_text().strip().split(":", 1)[1]
    assert verify_password(password, theirs)
    assert not verify_password(password + "x", theirs)
    # And theirs, re-derived with its own salt, is exactly what we compute.
    salt = base64.b64decode(theirs.split("$")[3])
    assert hash_password(password, salt=salt) == theirs


async def test_anonymous_and_wrong_passwords_are_refused(secured: Plant) -> None:
    for identity, password in [(None, None), ("stage-0", "not-its-password"),
                               ("intruder", "whatever")]:
        with pytest.raises(aiomqtt.MqttCodeError):
            async with login(secured, identity, password):
                pass
    async with login(secured, "stage-0"):
        pass  # the real password gets in


async def test_a_bus_client_with_bad_credentials_fails_with_a_clear_error(secured: Plant) -> None:
    bad = BusClient(replace(secured.endpoint_for("stage-0"), password="wrong"), "x")
    with pytest.raises(BusError, match=r"refused 'x'.*credentials"):
        await asyncio.wait_for(bad.run(lambda message: None), WAIT_S)


# (publisher, topic under the root, a reader allowed to read it, a writer allowed to write it)
FORBIDDEN_PUBLISHES = [
    ("plc-1", "act/stage-0", "stage-0", "coordinator"),  # a gateway into a stage's input
    ("plc-1", "llm/request/plc-2", "coordinator", "plc-2"),  # a gateway posing as another
    ("plc-1", "llm/response/plc-2/j1", "plc-2", "coordinator"),  # a gateway answering one
    ("stage-1", "act/stage-0", "stage-0", "coordinator"),  # a node writing upstream
    ("stage-0", "llm/response/plc-1/j1", "plc-1", "coordinator"),  # a node answering a gateway
    ("stage-0", "status/stage-1", "ops", "stage-1"),  # a node faking another's status
    ("ops", "events", "ops", "stage-0"),  # ops is read-only
    ("ops", "plan", "ops", "coordinator"),
]


@pytest.mark.parametrize(("publisher", "level", "reader", "writer"), FORBIDDEN_PUBLISHES)
async def test_a_forbidden_publish_is_not_delivered(secured: Plant, publisher: str, level: str,
                                                    reader: str, writer: str) -> None:
    topic = f"{secured.topic_root}/{level}"
    async with login(secured, reader) as read, login(secured, publisher) as forger, \
            login(secured, writer) as allowed:
        await read.subscribe(topic, qos=1)
        await publish_maybe_refused(forger, topic, b"forged")
        await allowed.publish(topic, b"marker", qos=1)
        assert (await first_message(read)).payload == b"marker"


# (reader, filter it tries, writer, topic written there, a topic the reader may read)
FORBIDDEN_READS = [
    ("stage-0", "llm/response/#", "coordinator", "llm/response/plc-1/j1", "act/stage-0"),
    ("plc-2", "llm/response/plc-1/#", "coordinator", "llm/response/plc-1/j1",
     "llm/response/plc-2/j2"),
    ("stage-1", "act/stage-0", "coordinator", "act/stage-0", "act/stage-1"),
    ("ops", "#", "stage-0", "act/stage-1", "status/stage-0"),
    ("plc-1", "llm/request/+", "plc-2", "llm/request/plc-2", "llm/response/plc-1/j1"),
]


@pytest.mark.parametrize(("reader", "pattern", "writer", "level", "marker"), FORBIDDEN_READS)
async def test_a_client_cannot_read_what_is_not_its_own(secured: Plant, reader: str, pattern: str,
                                                        writer: str, level: str,
                                                        marker: str) -> None:
    root = secured.topic_root
    marker_writer = "stage-0" if marker.startswith("status/") else "coordinator"
    async with login(secured, reader) as read, login(secured, writer) as write, \
            login(secured, marker_writer) as mark:
        # A broker may refuse the subscription outright or accept it and filter
        # every message: both keep the message away, and only that is checked.
        with contextlib.suppress(aiomqtt.MqttCodeError):
            await read.subscribe(f"{root}/{pattern}", qos=1)
        await read.subscribe(f"{root}/{marker}", qos=1)
        await write.publish(f"{root}/{level}", b"secret", qos=1)
        await mark.publish(f"{root}/{marker}", b"marker", qos=1)
        assert (await first_message(read)).payload == b"marker"


def test_an_unknown_identity_gets_a_clear_error(tmp_path: Path) -> None:
    plant = secured_plant(tmp_path, "mqtt://h:1883")
    with pytest.raises(PlantConfigError, match=r"'plc-9' is not an identity.*security.gateways"):
        plant.endpoint_for("plc-9")
    with pytest.raises(PlantConfigError, match=r"no password for 'plc-1'.*mosquitto-config"):
        plant.endpoint_for("plc-1")


# -- Last Wills ----------------------------------------------------------------------------

# Where a forged Will could do harm (topic under the root: who reads it, who may write it).
WILL_TARGETS = {
    "llm/response/plc-2/will": ("plc-2", "coordinator"),  # a forged answer
    "llm/request/plc-2": ("coordinator", "plc-2"),  # a request in another gateway's name
    "status/stage-0": ("ops", "stage-0"),  # a fake status
    "plan": ("ops", "coordinator"),  # an overwritten plan
    "act/stage-0": ("stage-0", "coordinator"),  # a frame pushed into a stage
}
# Targets whose retained message a forged Will (all are retained) must not replace.
RETAINED_TARGETS = ["status/stage-0", "plan"]
# Every kind of identity, and the targets of WILL_TARGETS it may not publish to.
WILL_FORGERS = {
    "stage-1": list(WILL_TARGETS),  # a stage node
    "coordinator": ["llm/request/plc-2", "status/stage-0"],
    "plc-1": list(WILL_TARGETS),  # a gateway (the HTTP gateway logs in as one)
    "ops": list(WILL_TARGETS),  # read-only
    "bridge-line": list(WILL_TARGETS),  # a line broker's bridge (no stage on that line)
}
# The one allowed Will among them, connected last: once it arrives, the broker
# has seen the killed process's connections drop.
WITNESS = ("stage-1", "status/stage-1")

# A client process holding one MQTT connection per (user, password, will topic,
# will payload, retain) of argv[1]; it says "ready" once every one is connected, then
# waits for its kill.
_WILL_CLIENTS = """
import json, sys, threading
import paho.mqtt.client as mqtt
host, port, v5, plant_id, clients = json.loads(sys.argv[1])
held = []
for user, password, topic, payload, retain in clients:
    connected = threading.Event()
    codes = []
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2,
                         client_id=f"{plant_id}.{user}.will-{len(held)}",
                         protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311)
    client.username_pw_set(user, password)
    client.will_set(topic, payload, qos=1, retain=retain)
    def on_connect(client, userdata, flags, code, properties, codes=codes, done=connected):
        codes.append(code)
        done.set()
    client.on_connect = on_connect
    client.connect(host, port)
    client.loop_start()
    assert connected.wait(10), f"{user} got no CONNACK"
    assert not codes[0].is_failure, f"{user} was refused: {codes[0]}"
    held.append(client)
print("ready", flush=True)
threading.Event().wait()
"""


async def _read_until(client: aiomqtt.Client, wanted: set[tuple[str, bytes]],
                      seen: list[tuple[str, bytes]]) -> None:
    """Append what `client` receives to `seen` until every (topic, payload) of `wanted` came."""
    while not wanted <= set(seen):
        message = await first_message(client)
        seen.append((message.topic.value, bytes(message.payload)))


@pytest.mark.parametrize("kind", SECURED_KINDS)
async def test_a_will_goes_only_where_its_identity_may_publish(
        kind: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A Will on a topic its identity may not publish to never arrives, after a kill -9,
    nor replaces a retained message."""
    url = f"mqtt://{LOOPBACK}:{free_port(LOOPBACK)}"
    line = BrokerSettings(url=f"mqtt://{LOOPBACK}:{free_port(LOOPBACK)}")  # for its bridge
    secured = secured_plant(tmp_path, url, mqtt5=kind == "mosquitto").model_copy(
        update={"brokers": {"line": line}})
    broker = start_secured(kind, secured, tmp_path)
    try:
        await _forge_wills(secured)
    finally:
        broker.stop()
    if kind == "amqtt":  # in this process: its log says what it dropped, and why
        assert ("dropped the Last Will of client 'sec.stage-1.will-0' (user 'stage-1'): it may "
                f"not publish to '{secured.topic_root}/llm/response/plc-2/will'") in caplog.text


async def _forge_wills(secured: Plant) -> None:
    root = secured.topic_root
    endpoint = secured.broker.endpoint()
    wills = [(forger, secured.endpoint_for(forger).password, f"{root}/{level}",
              f"forged by {forger}", True) for forger, levels in WILL_FORGERS.items()
             for level in levels]
    witness, witness_level = WITNESS
    witness_topic = f"{root}/{witness_level}"
    wills.append((witness, secured.endpoint_for(witness).password, witness_topic, "witness",
                  False))
    readers: dict[str, list[str]] = {}
    for level, (reader, _) in WILL_TARGETS.items():
        readers.setdefault(reader, []).append(f"{root}/{level}")
    seen: dict[str, list[tuple[str, bytes]]] = {reader: [] for reader in readers}
    async with contextlib.AsyncExitStack() as stack:
        logins = {identity: await stack.enter_async_context(login(secured, identity))
                  for identity in {*readers, *(writer for _, writer in WILL_TARGETS.values())}}
        for level in RETAINED_TARGETS:
            await logins[WILL_TARGETS[level][1]].publish(f"{root}/{level}", b"baseline",
                                                         qos=1, retain=True)
        for reader, topics in readers.items():
            for topic in topics:
                await logins[reader].subscribe(topic, qos=1)
        await logins["ops"].subscribe(witness_topic, qos=1)
        clients = subprocess.Popen(
            [sys.executable, "-c", _WILL_CLIENTS,
             json.dumps([endpoint.host, endpoint.port, endpoint.protocol == "5", secured.plant_id,
                         wills])],
            stdout=subprocess.PIPE, text=True)
        try:
            assert clients.stdout is not None
            ready = await asyncio.wait_for(asyncio.to_thread(clients.stdout.readline), WAIT_S)
            assert ready.strip() == "ready"
        finally:
            clients.kill()  # SIGKILL: no DISCONNECT, so the broker owes every Will
            clients.wait()
        await _read_until(logins["ops"], {(witness_topic, b"witness")}, seen["ops"])
        for level, (_, writer) in WILL_TARGETS.items():
            await logins[writer].publish(f"{root}/{level}", b"marker", qos=1)
        # Per subscriber the broker keeps order: a forged Will would come before the marker.
        for reader, topics in readers.items():
            await _read_until(logins[reader], {(topic, b"marker") for topic in topics},
                              seen[reader])
    forged = {reader: [m for m in got if m[1].startswith(b"forged")]
              for reader, got in seen.items()}
    assert not any(forged.values()), f"forged Wills arrived: {forged}"
    retained: list[tuple[str, bytes]] = []
    async with login(secured, "ops") as late:
        for level in RETAINED_TARGETS:
            await late.subscribe(f"{root}/{level}", qos=1)
        while len(retained) < len(RETAINED_TARGETS):
            message = await first_message(late)
            retained.append((message.topic.value, bytes(message.payload)))
    assert sorted(retained) == sorted((f"{root}/{level}", b"baseline")
                                      for level in RETAINED_TARGETS)


# -- the embedded broker under churn ---------------------------------------------------

# Messages published while clients come and go: amqtt's broadcast race (see
# broker.embedded._Broker) lost one within the first few dozen here, on 2 cores.
CHURN_MESSAGES = 300
CHURNERS = 6  # clients subscribing and leaving over and over, each its own connection


async def test_the_embedded_broker_delivers_every_message_while_clients_come_and_go(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """With security on, a subscriber gets every message though others subscribe and leave
    all the while (what `edgebus status` beside a burst of `edgebus ask` does)."""
    plant = secured_plant(tmp_path, f"mqtt://{LOOPBACK}:{free_port(LOOPBACK)}", mqtt5=False)
    broker = start_secured("amqtt", plant, tmp_path)
    topic = plant.topics.status("stage-0")
    sent = [f"{n}".encode() for n in range(CHURN_MESSAGES)]
    published = asyncio.Event()

    async def churn() -> None:
        while not published.is_set():
            async with login(plant, "ops") as passer:
                await passer.subscribe(f"{plant.topic_root}/status/#", qos=1)

    try:
        async with login(plant, "ops") as reader, login(plant, "stage-0") as writer:
            await reader.subscribe(topic, qos=1)
            churners = [asyncio.create_task(churn()) for _ in range(CHURNERS)]
            for payload in sent:
                await writer.publish(topic, payload, qos=1)
            published.set()
            await asyncio.gather(*churners)
            await writer.publish(topic, b"end", qos=1)
            received = []
            while (message := await first_message(reader)).payload != b"end":
                received.append(bytes(message.payload))
    finally:
        broker.stop()
    assert "dictionary changed size" not in caplog.text
    assert received == sent, f"{len(sent) - len(received)} message(s) lost"


# -- TLS ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mutual", [False, True], ids=["server-auth", "mutual"])
async def test_a_tls_connection_with_a_ca_made_here(tmp_path: Path, mutual: bool) -> None:
    ca = trustme.CA()
    tls = broker_tls(tmp_path / "tls", ca).model_copy(update={"require_certificate": mutual})
    plant = secured_plant(tmp_path, f"mqtts://{LOOPBACK}:{free_port(LOOPBACK)}", tls=tls,
                          ca_file=tls.cafile)
    broker = start_secured("mosquitto", plant, tmp_path)
    try:
        if mutual:
            with pytest.raises(PlantConfigError, match="'ops' has no client certificate"):
                plant.endpoint_for("ops")
            client_cert = ca.issue_cert("ops.edgebus.invalid")
            client_cert.cert_chain_pems[0].write_to_path(str(tmp_path / "credentials" / "ops.crt"))
            client_cert.private_key_pem.write_to_path(str(tmp_path / "credentials" / "ops.key"))
        endpoint = plant.endpoint_for("ops")
        assert endpoint.tls and (endpoint.cert_file is not None) == mutual
        bus = BusClient(endpoint, "sec.ops.tls", subscriptions=[(plant.topics.events, 1)])
        runner = asyncio.create_task(bus.run(lambda message: None))
        try:
            await bus.wait_connected(WAIT_S)
        finally:
            await cancel_all([runner])
        # Without trusting the CA (and, with mutual TLS, without a client certificate)
        # the handshake fails. At most TLS 1.2: under 1.3 the broker rejects a
        # missing client certificate after the client's handshake has completed,
        # so the client would see only a missing CONNACK, which a slow box also
        # gives; under 1.2 the refusal is an alert inside the handshake.
        context = ssl.create_default_context(cafile=str(tls.cafile) if mutual else None)
        context.maximum_version = ssl.TLSVersion.TLSv1_2
        with pytest.raises(aiomqtt.MqttError) as refused:
            async with aiomqtt.Client(LOOPBACK, endpoint.port, username="ops",
                                      password=endpoint.password, tls_context=context,
                                      timeout=WAIT_S):
                pass
        assert "timed out" not in str(refused.value)
    finally:
        broker.stop()


# -- a request through the secured stack -------------------------------------------------


@pytest.mark.parametrize("kind", SECURED_KINDS)
async def test_a_request_runs_end_to_end_and_no_secret_leaks(
        tiny_llama: Path, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    plant = secured_plant(tmp_path, f"mqtt://{LOOPBACK}:{free_port(LOOPBACK)}",
                          model=tiny_llama, mqtt5=kind == "mosquitto")
    broker = start_secured(kind, plant, tmp_path)
    request = GenerateRequest(id="sec-1", prompt="Alarm 4711 on press 3 means", max_tokens=8,
                              ignore_eos=True)
    try:
        async with running(plant):
            response = await ask(plant, request, client_id="plc-1", timeout=60)
            # The broker would drop an answer outside the gateway's own topics: refused.
            elsewhere = request.model_copy(update={
                "id": "sec-2", "reply_to": f"{plant.topic_root}/llm/response/plc-2/x"})
            refused = await ask(plant, elsewhere, client_id="plc-1", timeout=60)
            retained = await _retained_as_ops(plant)
    finally:
        broker.stop()
    assert response.error is None
    assert response.tokens == reference_tokens(tiny_llama, request)
    assert refused.error is not None and refused.error.code == "reply_to"
    assert plant.topics.plan in retained
    passwords = [password_path(tmp_path / "credentials", identity).read_text().strip()
                 for identity in plant.identities()]
    seen = "\n".join([caplog.text, *retained.values(), repr(plant),
                      *(repr(plant.endpoint_for(identity)) for identity in plant.identities())])
    # Every agent could write its status (and the ops identity read them).
    assert {plant.topics.status(a) for a in ["stage-0", "stage-1", "coordinator"]} \
        <= retained.keys()
    for password in passwords:
        assert password not in seen


@pytest.mark.parametrize(("client_id", "owner"), [
    ("sec.ops", "ops"), ("sec.ops.status-1a2b", "ops"), ("sec.coordinator.b", "coordinator"),
    ("sec.ops-tls", None), ("sec.opsx", None), ("ops", None), ("other.ops", None), ("sec.", None),
    # Identities may hold dots: the longest one named owns the id.
    ("sec.line.a", "line.a"), ("sec.line.a.x", "line.a"), ("sec.line.b", "line")])
def test_a_client_id_belongs_to_the_identity_it_names(client_id: str, owner: str | None) -> None:
    identities = ["ops", "coordinator", "line", "line.a"]
    assert client_id_owner("sec", identities, client_id) == owner


async def _connect_as(plant: Plant, user: str, password: str, client_id: str, *,
                      clean_session: bool) -> None:
    """Log in as `user` with `client_id`, then leave with a DISCONNECT."""
    endpoint = plant.broker.endpoint()
    async with aiomqtt.Client(
            endpoint.host, endpoint.port, username=user, password=password,
            identifier=client_id, clean_session=clean_session, timeout=WAIT_S,
            # 3.1.1 on both brokers: its clean-session flag says which session it takes.
            protocol=aiomqtt.ProtocolVersion.V311):
        pass


@pytest.mark.parametrize("kind", SECURED_KINDS)
async def test_another_identitys_client_id_does_not_silence_the_coordinator(
        tiny_llama: Path, tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture) -> None:
    """A client logging in with the coordinator's client id: the embedded broker refuses it,
    Mosquitto (which cannot bind client ids to users) knocks the coordinator off, and either
    way the coordinator answers the next request."""
    plant = secured_plant(tmp_path, f"mqtt://{LOOPBACK}:{free_port(LOOPBACK)}",
                          model=tiny_llama, mqtt5=kind == "mosquitto")
    broker = start_secured(kind, plant, tmp_path)
    coordinator = f"{plant.plant_id}.{plant.coordinator.id}"
    ops_password = plant.endpoint_for("ops").password
    assert ops_password is not None
    # A clean session (amqtt deleted the coordinator's), a persistent one (amqtt handed it
    # over), and a wrong password (amqtt did both before checking it).
    squatters = [("ops", ops_password, True), ("ops", ops_password, False),
                 ("stage-0", "not-its-password", True)]
    request = GenerateRequest(id="after-squat", prompt="Alarm 4711 on press 3 means",
                              max_tokens=4, ignore_eos=True)
    try:
        async with running(plant):
            for user, password, clean in squatters:
                if kind == "amqtt":
                    with pytest.raises(aiomqtt.MqttCodeError, match=r"(?i)not authori"):
                        await _connect_as(plant, user, password, coordinator,
                                          clean_session=clean)
                elif user == "ops":
                    await _connect_as(plant, user, password, coordinator, clean_session=clean)
            response = await ask(plant, request, client_id="plc-1", timeout=60)
    finally:
        broker.stop()
    assert response.error is None
    assert response.tokens == reference_tokens(tiny_llama, request)
    if kind == "amqtt":
        assert f"refused client id {coordinator!r} of user 'ops'" in caplog.text


async def test_a_status_speaks_only_for_the_agent_its_topic_names(
        tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A stage node may write its own status only, whatever its JSON claims: a claim to be
    another stage, or a coordinator instance, is dropped and changes nothing."""
    caplog.set_level(logging.INFO)
    plant = secured_plant(tmp_path, f"mqtt://{LOOPBACK}:{free_port(LOOPBACK)}",
                          model=tiny_llama)
    plant = plant.model_copy(update={  # several coordinators: a peer's death starts a drain
        "coordinator": plant.coordinator.model_copy(update={"instances": ["b"]})})
    broker = start_secured("mosquitto", plant, tmp_path)
    # A bdseq above any real session's, so that neither is taken for a late Will.
    lie = AgentStatus(state="offline", role="stage", agent_id="stage-1", pid=1, host="forged",
                      version="0", bdseq=2**53)
    lies = [lie, lie.model_copy(update={"role": "coordinator", "agent_id": "coordinator.b"})]
    request = GenerateRequest(id="after-lies", prompt="Alarm 4711 on press 3 means",
                              max_tokens=4, ignore_eos=True)
    try:
        async with running(plant):
            async with login(plant, "stage-0") as liar:
                for lie in lies:
                    await liar.publish(plant.topics.status("stage-0"), lie.model_dump_json(),
                                       qos=1)
            # Sent after the lies, so the coordinator has read them when it answers.
            response = await ask(plant, request, client_id="plc-1", timeout=60)
            seen = caplog.text  # before the agents stop, and say so
    finally:
        broker.stop()
    assert response.error is None
    assert response.tokens == reference_tokens(tiny_llama, request)
    assert "stage-1 went offline" not in seen
    assert "coordinator.b is offline" not in seen  # no drain of a peer
    assert "stage node stage-0 went offline" not in seen  # nor taken as stage-0's own
    assert "on the status topic of stage-0 that claim agent_id 'stage-1'" in seen


# `edgebus ask` runs at once as one gateway: what reproduced the broadcast race.
CONCURRENT_ASKS = 12


async def test_asks_at_once_as_one_gateway_are_all_answered(
        tiny_llama: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Several `edgebus ask` at once, each as the plant's first gateway (its default), on the
    secured embedded broker: each gets its own answer."""
    plant = secured_plant(tmp_path, f"mqtt://{LOOPBACK}:{free_port(LOOPBACK)}",
                          model=tiny_llama, mqtt5=False)
    broker = start_secured("amqtt", plant, tmp_path)
    batch = [GenerateRequest(id=f"ask-{n}", prompt=f"Alarm {n} on press 3 means", max_tokens=4,
                             ignore_eos=True) for n in range(CONCURRENT_ASKS)]
    try:
        async with running(plant):
            responses = await asyncio.gather(*(ask(plant, r, timeout=60) for r in batch))
    finally:
        broker.stop()
    assert [r.id for r in responses] == [r.id for r in batch]
    assert all(r.error is None for r in responses), [r.error for r in responses]
    assert "dictionary changed size" not in caplog.text


async def _retained_as_ops(plant: Plant) -> dict[str, str]:
    """Every retained message an operator sees, by topic: each agent's status and the plan
    (there is nothing else to retain), collected until all of them have come."""
    expected = {plant.topics.plan, *(plant.topics.status(a) for a in
                                     [*(s.node for s in plant.stages), plant.coordinator.id])}
    payloads: dict[str, str] = {}
    async with login(plant, "ops") as ops:
        await ops.subscribe(f"{plant.topic_root}/status/#", qos=1)
        await ops.subscribe(plant.topics.plan, qos=1)
        async with asyncio.timeout(WAIT_S):
            async for message in ops.messages:
                payloads[message.topic.value] = bytes(message.payload).decode()
                if expected <= payloads.keys():
                    break
    return payloads


# `edgebus up` starts four Python processes that import torch: ~10 s on two
# cores (tests/test_launcher.py), with a wide margin for a loaded box.
UP_S = 90.0


def edgebus(*args: str) -> subprocess.CompletedProcess[str]:
    """`edgebus ARGS` as an operator types it."""
    return subprocess.run([sys.executable, "-m", "edgebus", *args], capture_output=True,
                          text=True, timeout=UP_S)


def init_plant(tmp_path: Path, model: Path, *extra: str, name: str = "plant.yaml",
               stages: int = 2, **broker: object) -> Path:
    """`edgebus init` (2 stages), then the embedded broker moved off 1883 (where a Mosquitto
    or another test may listen) to a free loopback port, with `broker` fields added, and
    the stages' KV budgets cut to what a test's requests need (gguf_models.with_kv_budget)."""
    path = tmp_path / name
    done = edgebus("init", str(path), "--model", str(model), "--stages", str(stages), *extra)
    assert done.returncode == 0, done.stderr
    data = yaml.safe_load(path.read_text())
    data["broker"].update({"port": free_port(LOOPBACK), **broker})
    for stage in data["stages"]:
        stage["kv_budget_mb"] = PROCESS_KV_BUDGET_MB
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


async def test_a_fresh_init_and_up_admit_the_plants_identities_and_nobody_else(
        tiny_llama_gguf: Path, tmp_path: Path) -> None:
    """The operator's path, nothing configured by hand: `init`, `up`, `ask`, `status`. On
    llama.cpp stages, which start without importing torch: security is the same for all."""
    plant_path = init_plant(tmp_path, tiny_llama_gguf, "--weights", "gguf")
    plant = load_plant(plant_path)
    assert plant.security is not None and plant.security.gateways == ["plc-1", "http"]
    # `up` says the plant is up once it has seen every agent online, which it watches as the
    # ops identity.
    async with edgebus_up(plant_path, tmp_path / "up.log", UP_S):
        # Anonymous, or a gateway with another's password: refused in the CONNACK.
        for identity, password in [(None, None), ("plc-1", plant.endpoint_for("ops").password)]:
            with pytest.raises(aiomqtt.MqttCodeError):
                async with login(plant, identity, password):
                    pass
        # Over TLS, `init`'s default, with the plant's CA: refused by MQTT, not by TLS.
        assert plant.security.listener_tls is not None
        anonymous = await asyncio.create_subprocess_exec(
            "mosquitto_sub", "-h", LOOPBACK, "-p", str(plant.broker.port), "-t", "#", "-C", "1",
            "--cafile", str(plant.security.listener_tls.cafile),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(anonymous.communicate(), UP_S)
        assert anonymous.returncode != 0 and out == b"", err
        # The gateway's own identity gets in, and reads what it may.
        async with login(plant, "plc-1") as gateway:
            await gateway.subscribe(plant.topics.status(plant.coordinator.id), qos=1)
            status = AgentStatus.model_validate_json(
                (await first_message(gateway)).payload)
            assert status.state == "online"
        # `ask` and `status` log in with the plant file's credentials, as plc-1 and ops.
        asked = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "edgebus", "ask", str(plant_path), "Alarm 4711 means",
            "--raw", "--max-tokens", "5", "--json",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(asked.communicate(), UP_S)
        assert asked.returncode == 0, err.decode() + (tmp_path / "up.log").read_text()
        status_done = await asyncio.to_thread(edgebus, "status", str(plant_path))
        assert status_done.returncode == 0, status_done.stdout + status_done.stderr
        assert "missing" not in status_done.stdout and "stage-1" in status_done.stdout
    response = GenerateResponse.model_validate_json(out)
    assert response.tokens == plant_reference(
        plant, GenerateRequest(id="x", prompt="Alarm 4711 means", max_tokens=5))
    assert "security is off" not in (tmp_path / "up.log").read_text()
    assert "plain MQTT" not in (tmp_path / "up.log").read_text()


async def test_a_second_init_in_the_same_folder_leaves_the_first_plant_working(
        tiny_llama_gguf: Path, tmp_path: Path) -> None:
    """`edgebus init` of a 3-stage plant, then of a 2-stage one beside it: `edgebus broker` of
    each admits every identity of its own plant, stage-2 (the first plant's only) included.
    The second init used to replace the one broker/passwd, refusing the first's stage-2."""
    paths = [init_plant(tmp_path, tiny_llama_gguf, "--weights", "gguf", name=name,
                        stages=stages) for name, stages in (("plant.yaml", 3), ("line-2.yaml", 2))]
    plants = [load_plant(path) for path in paths]
    assert "stage-2" in plants[0].identities() and "stage-2" not in plants[1].identities()
    for path, plant in zip(paths, plants, strict=True):
        broker = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "edgebus", "broker", str(path), stderr=asyncio.subprocess.PIPE)
        try:
            assert broker.stderr is not None
            async with asyncio.timeout(UP_S):
                while b"listening on" not in await broker.stderr.readline():
                    assert broker.returncode is None
            for identity in plant.identities():
                async with login(plant, identity):
                    pass
        finally:
            broker.terminate()
            await broker.wait()


def test_init_in_a_source_tree_warns_that_credentials_went_into_a_package(
        tiny_llama_gguf: Path, tmp_path: Path) -> None:
    """`init` in this repository's root writes broker/ into the `broker` package: it says so."""
    (tmp_path / "broker").mkdir()
    (tmp_path / "broker" / "__init__.py").touch()
    done = edgebus("init", str(tmp_path / "plant.yaml"), "--model", str(tiny_llama_gguf))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "broker" / "plant.passwd").exists()
    assert f"{tmp_path / 'broker'} is a Python package" in done.stderr
    assert f"{tmp_path / 'credentials'} is a Python package" not in done.stderr


ALL_INTERFACES = "0.0.0.0"


async def test_a_listener_beyond_the_loopback_without_security_does_not_start(
        tiny_llama: Path, tmp_path: Path) -> None:
    plant_path = init_plant(tmp_path, tiny_llama, "--insecure", bind=ALL_INTERFACES)
    plant = load_plant(plant_path)
    assert plant.security is None
    port = plant.broker.port
    for command in ("broker", "up"):
        done = edgebus(command, str(plant_path))
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"would listen on {ALL_INTERFACES}:{port}" in done.stderr
        assert "security:" in done.stderr and "broker.bind: 127.0.0.1" in done.stderr
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((LOOPBACK, port), timeout=WAIT_S).close()
    assert "started" not in done.stdout  # `up` started nothing
    # The same for the embedded broker and a test's Mosquitto, used as libraries.
    with pytest.raises(EdgebusError, match="admit anyone"):
        async with EmbeddedBroker(ALL_INTERFACES, port):
            pass
    with pytest.raises(EdgebusError, match="admit anyone"):
        MosquittoBroker(tmp_path / "mosquitto", host=ALL_INTERFACES)


async def test_a_secured_embedded_broker_may_listen_beyond_the_loopback(tmp_path: Path) -> None:
    plant = secured_plant(tmp_path, "embedded", mqtt5=False)
    write_mosquitto_config(plant, tmp_path / "conf")
    port = free_port(LOOPBACK)
    async with EmbeddedBroker(ALL_INTERFACES, port, plugins_for(plant)):
        plant = plant.model_copy(update={"broker": BrokerSettings(port=port)})
        with pytest.raises(aiomqtt.MqttCodeError):
            async with login(plant, None):
                pass
        async with login(plant, "ops"):
            pass
