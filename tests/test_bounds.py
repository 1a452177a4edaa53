"""Nothing unbounded: an LZ4 bomb and a flood of frames against a running plant.

The stages run as OS processes over a real Mosquitto, so a stage's resident
memory is its own: the kernel's high-water mark (VmHWM, reset through
/proc/PID/clear_refs) says the most it ever held. Valid requests run at the
same time and must stay token-exact; every frame the stage cannot take is
accounted for by an ERROR frame to the coordinator. The model is the tiny
random Llama's GGUF on llama.cpp stages: the bounds under test follow from the
plant's numbers and the stage agent's inbox, whatever the model and engine, and
a llama.cpp agent of it starts in a fraction of a torch agent's time (which
spends 6 s of CPU importing torch).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import aiomqtt
import paho.mqtt.client as paho
import pytest
import torch
from brokers import MosquittoBroker
from gguf_models import with_kv_budget
from paho.mqtt.enums import CallbackAPIVersion
from plant_gateway import AgentProcesses, Gateway, assert_exact, gateway, requests, send
from test_frames import lz4_bomb
from transformers import AutoConfig

from edgebus.core import frames
from edgebus.core.client import MAX_QUEUED_OUT_BYTES, QUEUED_MESSAGE_BYTES, BusClient
from edgebus.core.endpoint import BrokerEndpoint
from edgebus.core.frames import Header, Kind
from node_agent.cancel import cancel_all
from node_agent.model_config import LLAMACPP_KV_ITEM_BYTES, kv_bytes_per_token
from node_agent.stage_inbox import waiting_limit
from plant_config import Plant, make_plant, write_plant

# The smallest KV budget, so the bounds it implies are small and a bomb or flood
# past them shows plainly in the stage's memory. The tiny model's KV takes
# 384 bytes a position per llama.cpp stage (f16), so 1 MiB bounds stage 0's waiting
# frames at 5.4 MiB (SmolLM2's 16 MiB bounded them at 1.4 MiB).
KV_BUDGET_MB = 1
# A request's longest length (prompt plus max_tokens): llama.cpp reserves every
# request's share of it at load, and 1 MiB holds no request of the default 5,120
# positions (1.9 MiB each). 256 positions (96 KiB) give each stage 10 sequences, room
# for the 6 requests of a test (prompts of 20 tokens or fewer) at once.
MAX_PROMPT_TOKENS = 192
MAX_TOKENS_LIMIT = 64
# Prompt chunks of 1152 positions: with the tiny model's 64-wide activations, a
# stage's largest legal frame is then SmolLM2's at its default 128 (576 wide),
# 288 KiB, and its largest message 18 MiB. The 4 MiB bomb fits in that,
# so it is refused from its frames' headers, as in the SmolLM2 plant; with the
# default chunk, the message's size alone would refuse it.
PREFILL_CHUNK = 1152
# What a stage's forward passes and the allocator's slack may add beyond its
# KV budget and its waiting bound, measured 5-20 MiB for these requests on the
# tiny model's llama.cpp stages (15-18 MiB on its torch stages, 20-40 with SmolLM2).
COMPUTE_SLACK = 96 * 2**20
TOKENS = 12
WAIT_S = 600.0
# Frames per flood message, and messages: 19,200 frames, 3.75 times what stage 0's
# bound takes in (5,120: it refuses the rest, 14,080, as fast as they come). The
# stage, the coordinator and the counting client spend CPU on every frame: five
# times as many took 5 s more of it, and refused only more of the same.
FLOOD_FRAMES = 64
FLOOD_MESSAGES = 300
# QoS 1 publishes in flight at once: past Mosquitto's queue per client (1000)
# the broker itself would drop messages, and those could not be accounted for.
FLOOD_WINDOW = 100
FLOOD_ID = 0x7E00_0000_0000_0000
# Mosquitto holds at most 1000 QoS 1 messages per client beyond those in flight,
# and drops the rest. The stage answers the flood with ERROR messages as fast as
# it reads it, faster than the counting client reads them on a loaded box: the
# broker the flood runs on holds as many messages as the flood has frames (one
# ERROR message each, at worst), so the count misses nothing the stage did send.
ROOMY_QUEUE = f"max_queued_messages {FLOOD_MESSAGES * FLOOD_FRAMES}\n"
# What a message to the coordinator may carry (the vocabulary of SmolLM2's
# tokenizer, which the tiny model shares).
RESULT_LIMITS = frames.coordinator_limits(vocab=49152, max_in_flight=64, stages=2)
# The flood test reads its stage's counters from its status, which a heartbeat refreshes
# (every 2 s by default): it waited for two of them. Only the refresh is shorter;
# liveness.timeout_s stays the default 6 s, so a stage the flood keeps busy is not taken
# for dead.
STATUS_HEARTBEAT_S = 0.25


def write_plant_file(model: Path, broker: MosquittoBroker, workdir: Path) -> tuple[Path, Plant]:
    plant = with_kv_budget(make_plant(model, stages=2, broker=broker.url, plant_id="bounds",
                                      weights="gguf"), KV_BUDGET_MB)
    plant = plant.model_copy(update={"coordinator": plant.coordinator.model_copy(update={
        "prefill_chunk": PREFILL_CHUNK, "max_prompt_tokens": MAX_PROMPT_TOKENS,
        "max_tokens_limit": MAX_TOKENS_LIMIT}),
        "liveness": plant.liveness.model_copy(update={"heartbeat_s": STATUS_HEARTBEAT_S})})
    path = workdir / "plant.yaml"
    write_plant(plant, path)
    return path, plant


@dataclass
class BoundedPlant:
    """The module's plant: its agents as OS processes over its own Mosquitto."""

    plant: Plant
    agents: AgentProcesses
    broker: MosquittoBroker


@pytest.fixture(scope="module")
def bounded(tiny_llama_gguf: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[BoundedPlant]:
    """One plant for the module (its agents' start was most of each test's time): each test
    targets a stage of its own, and leaves it with nothing waiting."""
    workdir = tmp_path_factory.mktemp("bounds")
    broker = MosquittoBroker(workdir / "mosquitto")
    with broker.conf_path.open("a") as conf:
        conf.write(ROOMY_QUEUE)
    with broker:
        path, plant = write_plant_file(tiny_llama_gguf, broker, workdir)
        with AgentProcesses(path, workdir) as agents:
            for stage in plant.stages:
                agents.start_stage(stage.node)
            agents.start_coordinator()
            yield BoundedPlant(plant, agents, broker)
        print(f"--- {broker!r} log ---\n{broker.log_tail()}")


@asynccontextmanager
async def plant_running(bounded: BoundedPlant, client_id: str
                        ) -> AsyncIterator[tuple[Plant, AgentProcesses, Gateway, BusClient]]:
    """The module's plant, every agent online, and a gateway of `client_id` (a session of
    each test's own)."""
    plant = bounded.plant
    async with gateway(plant, client_id) as (gw, bus):
        await gw.until_online([*(s.node for s in plant.stages), plant.coordinator.id])
        yield plant, bounded.agents, gw, bus


def budget(plant: Plant, node: str) -> int:
    """The most a stage may add to its resting memory: KV budget, waiting bound, compute."""
    spec = plant.node(node)
    config = AutoConfig.from_pretrained(plant.model)
    first = plant.stage_index(node) == 0
    waiting = waiting_limit(plant, node, config.hidden_size,
                            kv_bytes_per_token(config, spec.layers, LLAMACPP_KV_ITEM_BYTES), first)
    return spec.kv_budget_mb * 2**20 + waiting + COMPUTE_SLACK


def reset_peak(pid: int) -> int:
    """Reset the process's peak resident memory to its current one; return that."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _status_kib(pid, "VmRSS") * 1024


def peak(pid: int) -> int:
    return _status_kib(pid, "VmHWM") * 1024


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


async def test_an_lz4_bomb_costs_a_stage_nothing_and_valid_requests_stay_exact(
        bounded: BoundedPlant) -> None:
    bomb = lz4_bomb()  # 8 frames, 4 MiB on the wire, 1 GiB once decompressed
    client = "plc-bomb"
    async with plant_running(bounded, client) as (plant, agents, gw, bus):
        warm = requests(TOKENS, prefix="bomb-warm", count=2)
        await send(bus, plant, warm, client)  # the stage's heap grows to its working size first
        await gw.until(lambda: all(r.id in gw.responses for r in warm), WAIT_S)
        target = plant.pipeline[1].node_ids[0]
        resting = reset_peak(agents.pid(target))
        batch = requests(TOKENS, prefix="bomb-valid", count=4)
        await send(bus, plant, batch, client)
        await bus.publish(plant.topics.activations(target), bomb, qos=1)
        await gw.until(lambda: all(r.id in gw.responses for r in batch)
                       and bool(gw.messages("exceeds the largest legal frame")), WAIT_S)
        grown = peak(agents.pid(target)) - resting
    print(f"{target}: resting {resting / 2**20:.0f} MiB, peak +{grown / 2**20:.0f} MiB under "
          f"the bomb, budget +{budget(plant, target) / 2**20:.0f} MiB")
    assert grown <= budget(plant, target)
    refusals = gw.messages("exceeds the largest legal frame")
    assert all(target in m or "stage-1" in m for m in refusals), refusals
    assert_exact(plant, gw, warm + batch)


def flood_message(first: int) -> bytes:
    """FLOOD_FRAMES well-formed prompt chunks that continue prompts stage-0 never saw: each
    looks like a request in flight whose first chunk was lost, so each must be told."""
    return b"".join(frames.encode(Kind.TOKENS, torch.tensor([[11]]),
                                  Header(FLOOD_ID + first + i, 1, 0, (0, 0)), start=5,
                                  prefill=True)
                    for i in range(FLOOD_FRAMES))


class ErrorCounter:
    """Counts the ERROR frames sent to the coordinator per flood request, on a thread of its
    own: a reader sharing the test's busy event loop falls behind, and Mosquitto drops
    what queues past 1000 messages for a client; the count would miss frames the stage did
    send."""

    def __init__(self, broker: MosquittoBroker, topic: str) -> None:
        self.counts: dict[int, int] = {}
        self.bad: list[str] = []
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self._client = paho.Client(CallbackAPIVersion.VERSION2)
        self._client.on_message = self._on_message
        self._client.on_subscribe = lambda *_: self._subscribed.set()
        self._client.connect(broker.host, broker.port)
        self._client.subscribe(topic, qos=1)
        self._client.loop_start()
        if not self._subscribed.wait(30):
            raise AssertionError("the counting client did not subscribe within 30 s")

    def _on_message(self, _client: object, _userdata: object,
                    message: paho.MQTTMessage) -> None:
        for frame in frames.decode_all(bytes(message.payload), RESULT_LIMITS):
            if frame.kind == Kind.ERROR and frame.request >= FLOOD_ID:
                with self._lock:
                    if not frame.retry:  # the coordinator must be told to replay, not to fail
                        self.bad.append(frame.text())
                    self.counts[frame.request] = self.counts.get(frame.request, 0) + 1

    def answered(self) -> int:
        with self._lock:
            return len(self.counts)

    def close(self) -> None:
        # Disconnect first: its packet wakes the network thread, which loop_stop then joins
        # at once; stopped first, the thread slept out its select's 1 s timeout.
        self._client.disconnect()
        self._client.loop_stop()


async def test_a_flood_of_frames_is_refused_at_the_bound_and_every_frame_accounted_for(
        bounded: BoundedPlant) -> None:
    broker = bounded.broker
    flood = [flood_message(m * FLOOD_FRAMES) for m in range(FLOOD_MESSAGES)]
    total = FLOOD_MESSAGES * FLOOD_FRAMES
    client = "plc-flood"
    async with plant_running(bounded, client) as (plant, agents, gw, bus):
        target = plant.pipeline[0].node_ids[0]
        resting = reset_peak(agents.pid(target))
        refused_before = gw.metric(target, "refused_frames")
        counter = ErrorCounter(broker, plant.topics.activations(plant.coordinator.id))
        try:
            batch = requests(TOKENS, prefix="flood-valid", count=4)
            await send(bus, plant, batch, client)
            async with aiomqtt.Client(broker.host, broker.port) as flooder:
                for offset in range(0, FLOOD_MESSAGES, FLOOD_WINDOW):
                    await asyncio.gather(*(
                        flooder.publish(plant.topics.activations(target), message, qos=1)
                        for message in flood[offset:offset + FLOOD_WINDOW]))
            try:
                await gw.until(lambda: all(r.id in gw.responses for r in batch)
                               and counter.answered() == total, WAIT_S)
            except AssertionError as exc:
                raise AssertionError(f"{exc}; {counter.answered()} of {total} flood frames "
                                     f"answered by an ERROR frame; {target}: "
                                     f"{gw.status(target)}") from None
        finally:
            counter.close()
        grown = peak(agents.pid(target)) - resting
        await gw.until(lambda: gw.metric(target, "refused_frames") > refused_before, 30)
        refused = gw.metric(target, "refused_frames") - refused_before
        # Once the flood drained, every byte counted against the bound is given back
        # (a heartbeat says so within seconds, or this wait fails).
        await gw.until(lambda: gw.metric(target, "waiting_bytes") == 0, 60)
    print(f"{target}: {refused:.0f} of {total} flood frames refused at the bound, peak "
          f"+{grown / 2**20:.0f} MiB, budget +{budget(plant, target) / 2**20:.0f} MiB")
    # Every flood frame: one ERROR frame to the coordinator, refused at the bound or
    # found to continue no prompt held here; none dropped without a word, none twice.
    assert set(counter.counts.values()) == {1} and not counter.bad
    assert gw.messages("refused")  # the bound was reached, and said so
    assert grown <= budget(plant, target)
    assert_exact(plant, gw, batch)


async def test_a_broker_that_stops_reading_makes_send_refuse_past_the_outgoing_bound(
        mosquitto_broker: MosquittoBroker) -> None:
    """Mosquitto stopped (SIGSTOP) keeps the connection open but acknowledges nothing:
    paho's queue of unacknowledged messages then holds MAX_QUEUED_OUT_BYTES, no more,
    and what it held is delivered once the broker reads again."""
    endpoint = BrokerEndpoint(host=mosquitto_broker.host, port=mosquitto_broker.port,
                              tls=False, username=None, password=None, protocol="3.1.1",
                              ca_file=None, keepalive_s=60)
    sender = BusClient(endpoint, "bounded-sender")
    topic = f"edgebus-test/{os.getpid()}/out"
    payload = b"\0" * 2**20  # a large prefill frame's size
    fits = MAX_QUEUED_OUT_BYTES // (len(payload) + QUEUED_MESSAGE_BYTES)
    extra = 10
    async with aiomqtt.Client(mosquitto_broker.host, mosquitto_broker.port) as reader:
        await reader.subscribe(topic, qos=1)
        running = asyncio.ensure_future(sender.run(lambda message: None))
        try:
            await sender.wait_connected(WAIT_S)
            assert mosquitto_broker.pid is not None
            os.kill(mosquitto_broker.pid, signal.SIGSTOP)
            try:
                for i in range(fits + extra):
                    sender.send(topic, i.to_bytes(4, "big") + payload)
                assert sender.connected  # refused while connected, not waiting for a connection
                assert sender.unsent == extra
                assert sender.queued_bytes <= MAX_QUEUED_OUT_BYTES
            finally:
                os.kill(mosquitto_broker.pid, signal.SIGCONT)
            got: list[int] = []
            async with asyncio.timeout(WAIT_S):
                async for message in reader.messages:
                    assert isinstance(message.payload, bytes)
                    got.append(int.from_bytes(message.payload[:4], "big"))
                    if len(got) == fits:
                        break
                # Every acknowledgement counted back.
                while sender.queued_bytes:
                    await asyncio.sleep(0.05)
        finally:
            await cancel_all([running])
    # The first that fitted, each once; the refused ones never left.
    assert sorted(got) == list(range(fits))
