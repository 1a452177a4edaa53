"""What every profile of `edgebus plan` shares, and which profile a model gets.

A model directory is profiled in torch (node_agent/profile.py: its decoder
layers timed one by one in fp32, its weight bytes from its shapes); a GGUF
file in llama.cpp (node_agent/gguf_profile.py: its layers timed in llama.cpp's
own graph, its bytes the file's tensors), and so is a model directory's GGUF
for a plant whose stages all run llama.cpp (`profiled_model`). Both give a
`Measured`, cached as JSON, and the planner's `ModelCosts`. This module
imports neither torch nor llama.cpp; each profile imports its own.

Messages: every decode step crosses the broker once per hop, and the CPU that
costs (the sending agent encoding and publishing BATCH_ROWS rows' frames,
Mosquitto routing it, the receiving agent reading and decoding it) is spent on
the boxes' shares like a forward pass. `measure_message` measures it on
loopback with a Mosquitto child and two `BusClient`s, as CPU time (not wall
time: on a box with a CPU quota the CPU is what the quota rations). Without
Mosquitto installed it is left unmeasured (`message` None).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeAlias

import numpy as np

from broker.mosquitto import MosquittoProcess
from edgebus import frames
from edgebus.client import BusClient
from edgebus.errors import EdgebusError
from edgebus.model_import import GGUF_FILE
from plant_config.planner import BATCH_ROWS, MessageCost, ModelCosts, PartBytes, PartCost
from plant_config.schema import GGUF_SUFFIX, BrokerEndpoint

# Weight bytes per layer, of the embedding and of the head in each mode; whether tied.
Sizes: TypeAlias = tuple[tuple[PartBytes, ...], PartBytes, PartBytes, bool]
# Decode messages timed through the broker, after MESSAGE_WARMUP untimed ones
# (connection buffers, paho's first allocations). ~0.5 ms of wall time each
# here, and the CPU clocks tick in ns (schedstat) or 10 ms (stat): 400 give
# the coarser one a resolution of ~3 %.
MESSAGES = 400
MESSAGE_WARMUP = 20
# A message the receiver does not get within this long means the broker lost
# it (it never does on loopback at QoS 1): ~1000x a message's time here.
MESSAGE_TIMEOUT_S = 10.0
# The broker connection of the two profile clients: comes up within ~50 ms
# here; the margin is for a loaded box.
CONNECT_TIMEOUT_S = 10.0
_TOPIC = "edgebus/profile/frame"


@dataclass(frozen=True)
class Measured:
    """What a profile measures, as cached: milliseconds per part and the process baseline."""

    # (prefill ms, decode ms, BATCH_ROWS-row decode ms) per decoder layer
    layers: list[tuple[float, float, float]]
    embedding: tuple[float, float, float]
    head: tuple[float, float, float]    # final norm + LM head
    # CPU ms per decode message: (both agents, Mosquitto); None without Mosquitto
    message: tuple[float, float] | None
    baseline_bytes: int
    key: dict[str, Any]                 # where and on what it was measured
    measured_at: str


def model_costs(model: Path, *, remeasure: bool = False) -> tuple[ModelCosts, Measured, bool]:
    """The cost model of `model` (a model directory, or a GGUF file), its measurements and
    whether they are new.

    Uses the cached profile unless `remeasure`, or unless it was measured on
    another machine, library version or checkpoint; a fresh one is cached if
    the cache's directory is writable.
    """
    profile = _profile(model)
    key = profile.cache_key(model)
    path = profile.cache_path(model)
    measured = None if remeasure else read_cache(path, key)
    fresh = measured is None
    if measured is None:
        measured = profile.measure(model)
        write_cache(path, measured)
    return profile.costs(measured, model), measured, fresh


def profiled_model(model: Path, engines: Collection[str]) -> Path:
    """What to profile for stages running `engines` on `model`: a model directory's GGUF
    when every stage runs llama.cpp, whose times are llama.cpp's, not torch fp32's (which
    put a llama.cpp plant's predicted stage times 1.7-4x off, docs/benchmarks.md); else
    `model` itself."""
    gguf_file = Path(model) / GGUF_FILE
    if engines and set(engines) == {"llamacpp"} and gguf_file.is_file():
        return gguf_file
    return model


def profile_path(model: Path) -> Path:
    """Where the profile of `model` is cached."""
    return Path(_profile(model).cache_path(model))


def _profile(model: Path) -> Any:
    """The module that profiles `model`: llama.cpp's for a GGUF file, else torch's."""
    if Path(model).suffix.lower() == GGUF_SUFFIX:
        from node_agent import gguf_profile

        return gguf_profile
    from node_agent import profile

    return profile


def costs_from(measured: Measured, sizes: Sizes, *, packed_fp32: bool = False) -> ModelCosts:
    """The planner's ModelCosts of a profile's times and the model's weight bytes;
    `packed_fp32`: fp32 heads are packed apart from a tied embedding (node_agent/packed.py)."""
    layer_bytes, embedding_bytes, head_bytes, tied = sizes
    if len(layer_bytes) != len(measured.layers):
        raise EdgebusError(f"the profile has {len(measured.layers)} layers, the model "
                           f"{len(layer_bytes)} — measure again with `edgebus plan --profile`")
    message = None if measured.message is None else MessageCost(*measured.message)
    return ModelCosts(layers=tuple(PartCost(*part) for part in measured.layers),
                      embedding=PartCost(*measured.embedding), head=PartCost(*measured.head),
                      message=message,
                      layer_bytes=layer_bytes, embedding_bytes=embedding_bytes,
                      head_bytes=head_bytes, tied=tied, baseline_bytes=measured.baseline_bytes,
                      packed_fp32=packed_fp32)


def measure_message(hidden: int) -> tuple[float, float]:
    """CPU ms per decode message of BATCH_ROWS `hidden`-wide fp32 rows: of the sending and
    the receiving agent together (encode, publish, read, decode), and of Mosquitto."""
    with tempfile.TemporaryDirectory(prefix="edgebus-profile-") as workdir, \
            MosquittoProcess(Path(workdir)) as broker:
        assert broker.pid is not None
        endpoint = BrokerEndpoint(host=broker.host, port=broker.port, tls=False, username=None,
                                  password=None, protocol="5", ca_file=None, keepalive_s=30)
        return asyncio.run(_messages(endpoint, hidden, broker.pid))


async def _messages(endpoint: BrokerEndpoint, hidden: int, broker_pid: int
                    ) -> tuple[float, float]:
    limits = frames.stage_limits(prefill_chunk=1, hidden=hidden, max_in_flight=BATCH_ROWS,
                                 stages=1)
    arrived: asyncio.Queue[int] = asyncio.Queue()
    sender = BusClient(endpoint, "profile-sender")
    receiver = BusClient(endpoint, "profile-receiver", subscriptions=[(_TOPIC, 1)])
    tasks = [asyncio.create_task(sender.run(lambda _: None)),
             asyncio.create_task(receiver.run(
                 lambda message: arrived.put_nowait(len(frames.decode_all(
                     bytes(message.payload), limits)))))]
    try:
        await sender.wait_connected(CONNECT_TIMEOUT_S)
        await receiver.wait_connected(CONNECT_TIMEOUT_S)
        rows = np.random.default_rng(0).standard_normal((BATCH_ROWS, 1, 1, hidden),
                                                        dtype=np.float32)
        agent_s = broker_s = 0.0
        for index in range(MESSAGE_WARMUP + MESSAGES):
            if index == MESSAGE_WARMUP:
                agent_s, broker_s = time.process_time(), _cpu_s(broker_pid)
            header = frames.Header(request=0, epoch=0, step=index)
            sender.send(_TOPIC, b"".join(frames.encode(frames.Kind.HIDDEN, row, header, start=0)
                                         for row in rows))
            async with asyncio.timeout(MESSAGE_TIMEOUT_S):
                got = await arrived.get()
            if got != BATCH_ROWS:
                raise EdgebusError("the profile's decode message lost frames on the way "
                                   "through Mosquitto")
        return ((time.process_time() - agent_s) * 1e3 / MESSAGES,
                (_cpu_s(broker_pid) - broker_s) * 1e3 / MESSAGES)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _cpu_s(pid: int) -> float:
    """CPU seconds process `pid` has used: schedstat's nanoseconds where the kernel keeps
    them, else stat's clock ticks."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        # utime and stime, fields 14 and 15 of proc(5), counted after the ")" from field 3.
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def read_cache(path: Path, key: dict[str, Any]) -> Measured | None:
    """The profile cached at `path` if it was measured under `key`."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        message = data["message"]
        measured = Measured(layers=[(a, b, c) for a, b, c in data["layers"]],
                            embedding=tuple(data["embedding"]), head=tuple(data["head"]),
                            message=None if message is None else (message[0], message[1]),
                            baseline_bytes=data["baseline_bytes"], key=data["key"],
                            measured_at=data["measured_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none, unreadable or of an older format: measure again
    return measured if measured.key == key else None


def write_cache(target: Path, measured: Measured) -> None:
    """Cache `measured` at `target`, if its directory can be written."""
    temporary = target.with_name(f".{target.name}.{os.getpid()}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps(asdict(measured), indent=1), encoding="utf-8")
        temporary.replace(target)  # atomic: a concurrent reader sees the old or the new file
    except OSError:
        temporary.unlink(missing_ok=True)  # a read-only directory: plan without a cache
