"""TLS by default (issue 43): the plant's own CA, certificates over time, and what is refused.

Every test runs real brokers (amqtt in-process, Mosquitto) and real clients; the
capture test runs a whole default plant (`init`, `up`, `ask`, `status`) and reads
its loopback traffic with tcpdump.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import aiomqtt
import optional
import pytest
import trustme
import yaml
from brokers import AmqttBroker, BrokerHandle, MosquittoBroker, mosquitto_binary
from cryptography import x509
from gguf_models import PROCESS_KV_BUDGET_MB
from plant_gateway import edgebus_up

import broker.embedded
from broker.amqtt_security import plugins_for
from broker.mosquitto_config import write_mosquitto_config
from edgebus import status_view
from edgebus.core.client import BusClient
from edgebus.core.endpoint import BrokerEndpoint
from edgebus.core.errors import BusError
from edgebus.core.processes import LOOPBACK, free_port
from node_agent.runtime import warn_if_insecure
from plant_config import BrokerSettings, Plant, StageSpec, load_plant
from plant_config.broker_section import BrokerTls, Security
from plant_config.certificates import (
    CA_KEY,
    ca_common_name,
    certificate_info,
    client_paths,
    issue,
    names_in,
    signed_by,
)
from plant_config.credentials import password_path

UP_S = 90.0
# How long tcpdump may take to write out what it captured, on a loaded machine.
CAPTURE_WRITTEN_S = 30.0
CONNECT_S = 15.0


def edgebus(*args: str) -> subprocess.CompletedProcess[str]:
    """`edgebus ARGS` as an operator types it."""
    return subprocess.run([sys.executable, "-m", "edgebus", *args], capture_output=True,
                          text=True, timeout=UP_S)


def init(tmp_path: Path, model: Path, *extra: str, name: str = "plant.yaml") -> Path:
    """`edgebus init` of a 2-stage plant, as an operator runs it, with nothing changed."""
    path = tmp_path / name
    done = edgebus("init", str(path), "--model", str(model), "--stages", "2",
                   "--weights", "gguf", *extra)
    assert done.returncode == 0, done.stderr
    return path


def edit(path: Path, **changes: dict[str, object]) -> Plant:
    """The plant file with sections updated (a free port, mutual TLS, ...), as loaded."""
    data = yaml.safe_load(path.read_text())
    for section, fields in changes.items():
        data[section].update(fields)
    for stage in data["stages"]:
        stage["kv_budget_mb"] = PROCESS_KV_BUDGET_MB
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_plant(path)


async def connect(endpoint: BrokerEndpoint, client_id: str) -> None:
    """Connect as edgebus's agents do; return once connected, or raise what `run` raises."""
    bus = BusClient(endpoint, client_id)
    runner = asyncio.create_task(bus.run(lambda message: None))
    connected = asyncio.create_task(bus.wait_connected())
    try:
        await asyncio.wait([runner, connected], timeout=CONNECT_S,
                           return_when=asyncio.FIRST_COMPLETED)
        if runner.done():
            runner.result()
        assert connected.done(), f"{client_id}: neither connected nor refused"
    finally:
        for task in (runner, connected):
            task.cancel()
        await asyncio.gather(runner, connected, return_exceptions=True)


def embedded_for(plant: Plant) -> AmqttBroker:
    """The embedded broker as `edgebus broker` runs it for `plant`, on a free port."""
    assert plant.security is not None
    return AmqttBroker(plugins_for(plant), tls=plant.security.listener_tls)


@contextlib.contextmanager
def started(broker: BrokerHandle) -> Iterator[BrokerHandle]:
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def at_port(endpoint: BrokerEndpoint, port: int) -> BrokerEndpoint:
    return replace(endpoint, port=port)


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    """The command's error, which must be one line and no traceback."""
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr and "SSLError" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("edgebus: error:")]
    assert len(lines) == 1, done.stderr
    return lines[0]


# -- item 1: the plant's own CA -------------------------------------------------------------


def test_init_makes_the_plants_ca_and_a_broker_certificate_naming_its_hosts(
        tiny_llama_gguf: Path, tmp_path: Path) -> None:
    """The default `init`: a CA of the plant, the broker's certificate from it naming the
    embedded broker's addresses, keys mode 0600 in the credentials' folder, the plant file
    naming them, the embedded broker on 8883. An external mqtts:// broker's certificate
    names its host, and `broker mosquitto-config` serves TLS with it."""
    plant = load_plant(init(tmp_path, tiny_llama_gguf))
    assert plant.security is not None
    tls = plant.security.listener_tls
    assert tls is not None and plant.broker.port == 8883 and plant.broker_endpoint().tls
    credentials = plant.security.credentials
    assert tls.cafile.parent == credentials / "tls"
    assert stat.S_IMODE((credentials / "tls").stat().st_mode) == 0o700
    for key in (tls.cafile.with_name(CA_KEY), tls.keyfile):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    assert certificate_info(tls.cafile).subject == ca_common_name(plant.plant_id)
    assert {"127.0.0.1", "localhost"} <= names_in(tls.certfile)
    assert signed_by(tls.certfile, tls.cafile)
    assert certificate_info(tls.certfile).days_left() >= 800
    # Out of the source tree: beside the plant file, as the passwords are.
    assert credentials == tmp_path / "credentials"

    site = tmp_path / "site"
    site.mkdir()
    path = init(site, tiny_llama_gguf, "--broker", "mqtts://broker.plant.local:8883")
    external = load_plant(path)
    assert external.security is not None and external.security.listener_tls is not None
    assert external.broker.ca_file == external.security.listener_tls.cafile
    assert names_in(external.security.listener_tls.certfile) == {"broker.plant.local"}
    conf = edgebus("broker", "mosquitto-config", str(path), str(site / "out"))
    assert conf.returncode == 0, conf.stderr
    text = (site / "out" / "mosquitto.conf").read_text()
    assert "listener 8883" in text
    assert f"certfile {external.security.listener_tls.certfile}" in text
    # The broker moved to another host since `init`: its certificate follows.
    edit(path, broker={"url": "mqtts://mqtt.plant.local:8883"})
    conf = edgebus("broker", "mosquitto-config", str(path), str(site / "out"))
    assert conf.returncode == 0, conf.stderr
    assert names_in(external.security.listener_tls.certfile) == {"mqtt.plant.local"}


def test_a_second_init_reuses_the_plants_ca_and_never_overwrites_another_plants(
        tiny_llama_gguf: Path, tmp_path: Path) -> None:
    first = load_plant(init(tmp_path, tiny_llama_gguf))
    assert first.security is not None and first.security.listener_tls is not None
    ca = first.security.listener_tls.cafile
    key = ca.with_name(CA_KEY)
    before = ca.read_bytes(), key.read_bytes()
    second = load_plant(init(tmp_path, tiny_llama_gguf, name="line-2.yaml"))
    assert second.security is not None and second.security.listener_tls is not None
    assert second.security.listener_tls.cafile == ca
    assert (ca.read_bytes(), key.read_bytes()) == before  # the same CA, reused
    # Another plant's CA in the folder (its subject says whose): refused, left as it was.
    other = trustme.CA(organization_unit_name="another plant")
    other.cert_pem.write_to_path(str(ca))
    other.private_key_pem.write_to_path(str(key))
    theirs = ca.read_bytes(), key.read_bytes()
    done = edgebus("init", str(tmp_path / "third.yaml"), "--model", str(tiny_llama_gguf),
                   "--weights", "gguf")
    assert "another plant's CA" in one_line_error(done) and str(ca) in done.stderr
    assert (ca.read_bytes(), key.read_bytes()) == theirs


# -- item 4: what is refused ----------------------------------------------------------------


@pytest.fixture(scope="module")
def mutual_plant(tiny_llama_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Plant:
    """A default plant with mutual TLS asked for, and its client certificates issued: made
    once (an `init` and a `certs renew`, two Python starts) for both brokers' runs, which
    only read it."""
    path = init(tmp_path_factory.mktemp("mutual"), tiny_llama_gguf)
    data = yaml.safe_load(path.read_text())
    edit(path, security={"tls": {**data["security"]["tls"], "require_certificate": True}})
    renewed = edgebus("certs", "renew", str(path))
    assert renewed.returncode == 0, renewed.stderr
    return load_plant(path)


@pytest.mark.parametrize("kind", ["amqtt", "mosquitto"])
async def test_with_mutual_tls_a_client_without_a_certificate_or_with_another_cas_is_refused(
        kind: str, mutual_plant: Plant, tmp_path: Path) -> None:
    plant = mutual_plant
    assert plant.security is not None and plant.security.listener_tls is not None
    for identity in plant.identities():  # one client certificate per identity
        cert, key = client_paths(plant.security.credentials, identity)
        assert signed_by(cert, plant.security.listener_tls.cafile)
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    port = free_port(LOOPBACK)
    if kind == "amqtt":
        handle: BrokerHandle = embedded_for(plant)
    else:
        if mosquitto_binary() is None:
            optional.missing("mosquitto")
        external = plant.model_copy(update={"broker": BrokerSettings(
            url=f"mqtts://{LOOPBACK}:{port}", ca_file=plant.security.listener_tls.cafile)})
        write_mosquitto_config(external, tmp_path / "conf", bind=LOOPBACK)
        handle = MosquittoBroker(tmp_path / "mosquitto", port=port, include_dir=tmp_path / "conf")
    with started(handle) as running:
        endpoint = at_port(plant.endpoint_for("stage-0"), running.port)
        assert endpoint.cert_file is not None
        await connect(endpoint, f"{plant.plant_id}.stage-0")  # its own certificate: in
        with pytest.raises(BusError, match="client certificate") as refused:
            await connect(replace(endpoint, cert_file=None, key_file=None),
                          f"{plant.plant_id}.stage-0")
        assert f"{LOOPBACK}:{running.port}" in str(refused.value)
        other = trustme.CA().issue_cert("stage-0")
        other.cert_chain_pems[0].write_to_path(str(tmp_path / "other.crt"))
        other.private_key_pem.write_to_path(str(tmp_path / "other.key"))
        with pytest.raises(BusError, match="refuse") as refused:
            await connect(replace(endpoint, cert_file=tmp_path / "other.crt",
                                  key_file=tmp_path / "other.key"), f"{plant.plant_id}.stage-0")
        assert str(tmp_path / "other.crt") in str(refused.value)


async def test_a_broker_certificate_from_another_ca_is_refused(
        tiny_llama_gguf: Path, tmp_path: Path) -> None:
    """A broker with a certificate of another CA (a rogue broker on the plant network) is
    refused by the agents, and `edgebus status` says so in one line naming the CA file."""
    path = init(tmp_path, tiny_llama_gguf)
    plant = edit(path, broker={"port": free_port(LOOPBACK)})
    assert plant.security is not None
    rogue = trustme.CA().issue_cert(LOOPBACK, "localhost")
    rogue.cert_chain_pems[0].write_to_path(str(tmp_path / "rogue.crt"))
    rogue.private_key_pem.write_to_path(str(tmp_path / "rogue.key"))
    own = plant.security.listener_tls
    assert own is not None
    handle = AmqttBroker(plugins_for(plant), tls=BrokerTls(
        cafile=own.cafile, certfile=tmp_path / "rogue.crt", keyfile=tmp_path / "rogue.key"))
    handle.port = plant.broker.port
    with started(handle):
        with pytest.raises(BusError, match="not signed by the CA") as refused:
            await connect(plant.endpoint_for("stage-0"), f"{plant.plant_id}.stage-0")
        assert str(own.cafile) in str(refused.value)
        line = one_line_error(await asyncio.to_thread(edgebus, "status", str(path)))
        assert "not signed by the CA" in line and str(own.cafile) in line
        assert f"{LOOPBACK}:{plant.broker.port}" in line


async def test_an_expired_certificate_is_refused_with_its_message(
        tiny_llama_gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The broker's certificate expired: refused, and `status` names the CA file and the
    host in one line. A client's own expired certificate (mutual TLS): refused before it
    is sent, naming the file."""
    path = init(tmp_path, tiny_llama_gguf)
    plant = edit(path, broker={"port": free_port(LOOPBACK)})
    assert plant.security is not None and plant.security.listener_tls is not None
    tls = plant.security.listener_tls
    long_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=900)
    issue(tls.cafile, tls.certfile, tls.keyfile, common_name=LOOPBACK,
          hosts=[LOOPBACK, "localhost"], issued=long_ago)
    assert certificate_info(tls.certfile).days_left() < 0
    report = status_view.certificates(plant)
    assert any(row["path"] == str(tls.certfile) and "expired" in row["warning"]
               for row in report)
    handle = embedded_for(plant)
    handle.port = plant.broker.port
    with caplog.at_level(logging.WARNING), started(handle):
        assert f"the broker's certificate {tls.certfile} has expired" in caplog.text
        with pytest.raises(BusError, match="has expired"):
            await connect(plant.endpoint_for("stage-0"), f"{plant.plant_id}.stage-0")
        line = one_line_error(await asyncio.to_thread(edgebus, "status", str(path)))
        assert "has expired" in line and str(tls.cafile) in line
        assert f"{LOOPBACK}:{plant.broker.port}" in line
    # A client's own certificate, expired.
    endpoint = plant.endpoint_for("stage-0")
    cert, key = tmp_path / "old.crt", tmp_path / "old.key"
    issue(tls.cafile, cert, key, common_name="stage-0", issued=long_ago)
    with pytest.raises(BusError, match="expired") as refused:
        await connect(replace(endpoint, cert_file=cert, key_file=key), "plant.stage-0")
    assert str(cert) in str(refused.value) and LOOPBACK in str(refused.value)


# -- item 3: certificates over time ---------------------------------------------------------


async def test_status_shows_days_left_and_certs_renew_reissues_while_the_broker_runs(
        tiny_llama_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A broker certificate with 20 days left: `status` warns, 30 days ahead. `certs renew`
    issues a new one from the same CA while the embedded broker runs: a client connected
    before stays connected, and new connections get the new certificate."""
    monkeypatch.setattr(broker.embedded, "CERTIFICATE_POLL_S", 0.2)
    path = init(tmp_path, tiny_llama_gguf)
    plant = edit(path, broker={"port": free_port(LOOPBACK)})
    assert plant.security is not None and plant.security.listener_tls is not None
    tls = plant.security.listener_tls
    issue(tls.cafile, tls.certfile, tls.keyfile, common_name=LOOPBACK,
          hosts=[LOOPBACK, "localhost"], days=20)
    rows = {row["path"]: row for row in status_view.certificates(plant)}
    assert rows[str(tls.certfile)]["days_left"] in (19, 20)
    assert "expires in" in rows[str(tls.certfile)]["warning"]
    assert rows[str(tls.cafile)]["warning"] is None
    text = status_view.table({"plant_id": "plant", "topic_root": "r", "plan": None,
                              "agents": [], "tls": True,
                              "certificates": list(rows.values())})
    assert f"warning: {tls.certfile} expires in" in text and "days left" in text

    def served_serial() -> int:
        context = ssl.create_default_context(cafile=str(tls.cafile))
        with socket.create_connection((LOOPBACK, plant.broker.port)) as raw, \
                context.wrap_socket(raw, server_hostname=LOOPBACK) as wrapped:
            der = wrapped.getpeercert(binary_form=True)
        assert der is not None
        return x509.load_der_x509_certificate(der).serial_number

    handle = embedded_for(plant)
    handle.port = plant.broker.port
    with started(handle):
        old_serial = served_serial()
        bus = BusClient(plant.endpoint_for("ops"), f"{plant.plant_id}.ops.before")
        runner = asyncio.create_task(bus.run(lambda message: None))
        await bus.wait_connected(CONNECT_S)
        renewed = await asyncio.to_thread(edgebus, "certs", "renew", str(path))
        assert renewed.returncode == 0, renewed.stderr
        assert f"wrote {tls.certfile}" in renewed.stdout
        assert certificate_info(tls.certfile).days_left() > 800
        deadline = time.monotonic() + 10
        while (new_serial := await asyncio.to_thread(served_serial)) == old_serial:
            assert time.monotonic() < deadline, "the broker kept the old certificate"
            await asyncio.sleep(0.2)
        assert new_serial == certificate_info_serial(tls.certfile)
        assert bus.connected and not runner.done()  # never dropped
        await connect(plant.endpoint_for("stage-0"), f"{plant.plant_id}.stage-0")
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)


def certificate_info_serial(path: Path) -> int:
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


# -- item 2: plain only by saying so --------------------------------------------------------


def test_plain_mqtt_only_by_saying_so_and_with_a_warning_at_every_start(
        tiny_llama_gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`init --broker mqtt://...` is plain on purpose: the plant file says `tls: off`, and
    every agent warns at start; `tls: off` with an mqtts:// URL is a contradiction."""
    done = edgebus("init", str(tmp_path / "plant.yaml"), "--model", str(tiny_llama_gguf),
                   "--weights", "gguf", "--broker", "mqtt://broker.plant.local:1883")
    assert done.returncode == 0, done.stderr
    assert "TLS: off" in done.stdout
    plant = load_plant(tmp_path / "plant.yaml")
    assert plant.security is not None and plant.security.tls is False
    assert "tls: false" in (tmp_path / "plant.yaml").read_text()
    with caplog.at_level(logging.WARNING):
        warn_if_insecure(plant, "stage-0", tmp_path / "plant.yaml")
    assert "plain MQTT, no TLS" in caplog.text and "broker.plant.local:1883" in caplog.text
    with pytest.raises(Exception, match="is off, but the broker's url is mqtts"):
        Plant(plant_id="p", topic_root="r", model=tiny_llama_gguf,
              broker=BrokerSettings(url="mqtts://h:8883"),
              stages=[StageSpec(node="stage-0", layers=(0, 6))],
              security=Security(credentials=tmp_path / "c", tls=False))


# -- item 5 of the issue: nothing in clear on the wire ----------------------------------------


@contextlib.asynccontextmanager
async def capture(path: Path, ports: list[int], last: bytes) -> AsyncIterator[None]:
    """tcpdump of the loopback's traffic on `ports` into `path`, whole packets, while inside,
    and on until `last` (the final bytes sent) is in the file: the capture is then whole,
    however long a loaded machine took tcpdump to write it."""
    tcpdump = shutil.which("tcpdump")
    if tcpdump is None:
        optional.missing("tcpdump (apt-get install tcpdump; .ci/run installs it)")
    assert tcpdump is not None
    where = " or ".join(f"tcp port {port}" for port in ports)
    # -B: a kernel buffer (KiB) roomy enough for the plant's burst while tcpdump waits for CPU.
    proc = await asyncio.create_subprocess_exec(
        tcpdump, "-i", "lo", "-U", "-B", "32768", "-s", "0", "-w", str(path), where,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    try:
        async with asyncio.timeout(30):
            while b"listening on" not in (line := await proc.stderr.readline()):
                if not line:
                    pytest.fail(f"tcpdump did not start (root or CAP_NET_RAW is needed): "
                                f"{(await proc.stderr.read()).decode()}")
        yield
        try:
            async with asyncio.timeout(CAPTURE_WRITTEN_S):
                while last not in path.read_bytes():
                    await asyncio.sleep(0.1)
        except TimeoutError:
            pytest.fail(f"the capture never held the last bytes sent in {CAPTURE_WRITTEN_S} s: "
                        "it would not show the rest either (packets dropped by the kernel?)")
    finally:
        proc.send_signal(signal.SIGINT)
        await proc.wait()


def ask_over_http(path: Path, tmp_path: Path, prompt: str) -> None:
    """`edgebus http` of the plant, asked once as an editor would (its own leg, HTTP on the
    loopback, is not the broker's and is not captured)."""
    port = free_port(LOOPBACK)
    key = (path.parent / "credentials" / "http-1.api-key").read_text().strip()
    with (tmp_path / "http.log").open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "edgebus", "http", str(path),
                                 "--listen", f"{LOOPBACK}:{port}"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + UP_S
        while "Uvicorn running on" not in (tmp_path / "http.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "http.log").read_text()
            time.sleep(0.1)
        model = load_plant(path).model.name
        body = json.dumps({"model": model, "max_tokens": 4,
                           "messages": [{"role": "user", "content": prompt}]}).encode()
        request = urllib.request.Request(
            f"http://{LOOPBACK}:{port}/v1/chat/completions", data=body,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=UP_S) as answer:
            assert json.load(answer)["choices"][0]["message"]["content"] is not None
    finally:
        proc.terminate()
        proc.wait(UP_S)


async def test_a_default_plant_answers_with_no_password_and_no_prompt_on_the_wire(
        tiny_llama_gguf: Path, tmp_path: Path) -> None:
    """issue 43's own check: `init`, `up`, `ask`, `status` as a new user runs them, and
    `edgebus http` answering an editor (so that all six identities log in), every loopback
    packet of the broker's port captured. Not one of the plant's passwords and not the
    prompt's text is in it. A marker sent in clear beside it, in the same capture, shows
    the capture would have seen them."""
    path = init(tmp_path, tiny_llama_gguf)
    plant = edit(path, broker={"port": free_port(LOOPBACK)})
    assert plant.security is not None
    prompt = "Hydraulic press 7 reports seal leak near valve V-113"
    marker_port = free_port(LOOPBACK)
    marker = b"edgebus-capture-marker-" + prompt.encode()
    pcap = tmp_path / "plant.pcap"
    async with (capture(pcap, [plant.broker.port, marker_port], marker),
                edgebus_up(path, tmp_path / "up.log", UP_S)):
        asked = await asyncio.to_thread(edgebus, "ask", str(path), prompt, "--raw",
                                        "--max-tokens", "8")
        assert asked.returncode == 0, asked.stderr
        status = await asyncio.to_thread(edgebus, "status", str(path))
        assert status.returncode == 0, status.stdout + status.stderr
        assert "TLS: on" in status.stdout and "days left" in status.stdout
        await asyncio.to_thread(ask_over_http, path, tmp_path, prompt)
        with socket.socket() as server:
            server.bind((LOOPBACK, marker_port))
            server.listen()
            with socket.create_connection((LOOPBACK, marker_port)) as client:
                client.sendall(marker)
                accepted, _ = server.accept()
                accepted.recv(len(marker))
                accepted.close()
    wire = pcap.read_bytes()
    assert marker in wire  # the capture holds payloads: it would have shown the rest
    assert len(wire) > 20_000, len(wire)  # the plant's whole conversation, encrypted
    passwords = {identity: password_path(plant.security.credentials, identity).read_text()
                 .strip() for identity in plant.identities()}
    assert len(passwords) == 6  # coordinator, stage-0, stage-1, plc-1, http, ops: all used
    leaked = [identity for identity, password in passwords.items()
              if password.encode() in wire]
    assert leaked == []
    assert wire.count(prompt.encode()) == 1  # the marker's copy only
    assert b"Hydraulic press 7" not in wire.replace(marker, b"")
    assert b"MQTT" not in wire.replace(marker, b"")  # no CONNECT in clear either
    assert "plain MQTT" not in (tmp_path / "up.log").read_text()


# -- the token's path: what a TLS socket does not take at once -------------------------------

# Enough for a stopped broker's socket buffers not to take it all at once (on the loopback
# they grow to a few MiB): every message paho may have in flight, 1 MiB each.
STALLED_SENDS = 24
STALLED_PAYLOAD = b"\0" * 2**20
# Generous: 24 MiB through TLS on a loaded 2-core box.
STALLED_DELIVERED_S = 120.0


async def test_what_a_tls_socket_does_not_take_at_once_is_written_once_the_broker_reads(
        tiny_llama_gguf: Path, tmp_path: Path) -> None:
    """BusClient.send writes at once and watches the socket for writability only for what it
    did not take. Under TLS too: Mosquitto stopped (SIGSTOP) leaves the sender's TLS socket
    full, and every message still arrives once it runs again."""
    if mosquitto_binary() is None:
        optional.missing("mosquitto")
    plant = load_plant(init(tmp_path, tiny_llama_gguf))
    assert plant.security is not None and plant.security.listener_tls is not None
    port = free_port(LOOPBACK)
    external = plant.model_copy(update={"broker": BrokerSettings(
        url=f"mqtts://{LOOPBACK}:{port}", ca_file=plant.security.listener_tls.cafile)})
    write_mosquitto_config(external, tmp_path / "conf", bind=LOOPBACK)
    mosquitto = MosquittoBroker(tmp_path / "mosquitto", port=port, include_dir=tmp_path / "conf")
    sender_id, reader_id = (spec.node for spec in plant.stages)
    topic = plant.topics.activations(reader_id)
    got: list[int] = []
    all_in = asyncio.Event()

    def receive(message: aiomqtt.Message) -> None:
        assert isinstance(message.payload, bytes)
        got.append(int.from_bytes(message.payload[:4], "big"))
        if len(got) == STALLED_SENDS:
            all_in.set()

    with started(mosquitto):
        assert mosquitto.pid is not None
        reader = BusClient(at_port(plant.endpoint_for(reader_id), port),
                           f"{plant.plant_id}.{reader_id}", subscriptions=[(topic, 1)])
        sender = BusClient(at_port(plant.endpoint_for(sender_id), port),
                           f"{plant.plant_id}.{sender_id}")
        running = [asyncio.create_task(reader.run(receive)),
                   asyncio.create_task(sender.run(lambda message: None))]
        try:
            async with asyncio.timeout(CONNECT_S):
                await reader.wait_connected()
                await sender.wait_connected()
            os.kill(mosquitto.pid, signal.SIGSTOP)
            try:
                for i in range(STALLED_SENDS):
                    sender.send(topic, i.to_bytes(4, "big") + STALLED_PAYLOAD)
                assert sender.unsent == 0
                # What this test is about: paho still holds bytes the socket did not take.
                assert sender._client is not None and sender._client._client.want_write()
            finally:
                os.kill(mosquitto.pid, signal.SIGCONT)
            async with asyncio.timeout(STALLED_DELIVERED_S):
                await all_in.wait()
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
    assert sorted(got) == list(range(STALLED_SENDS))
