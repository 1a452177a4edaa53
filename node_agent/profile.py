"""The planner's cost model of a model, measured on this machine: `edgebus plan`'s profile.

Time: the whole model runs as one fp32 stage (`TorchEngine`, the code path a
stage runs in production), and forward hooks time each decoder layer, the
embedding and the final norm + LM head separately, for a PREFILL_POSITIONS
prefill and for one decode step after it. Each time is the minimum over the
rounds, the least disturbed by other processes on shared cores, and it is
measured on one torch thread: the plan uses relative costs, and with two
threads on cores another process also used, decode measured ~10x slower
(OpenMP threads waiting for each other), one thread was undisturbed.

The same hooks time a decode step of BATCH_ROWS rows, the batch the
coordinator forms per request group: a step's cost is not the 1-row cost
times the rows, nor the 1-row cost (on SmolLM2 here, 1.0x it for the head, 1.1-1.2x
for a layer).

Messages: every decode step crosses the broker once per hop, and the CPU that
costs (the sending agent encoding and publishing BATCH_ROWS rows' frames,
Mosquitto routing it, the receiving agent reading and decoding it) is spent on
the boxes' shares like a forward pass. The profile measures it on loopback
with a Mosquitto child and two `BusClient`s, as CPU time (not wall time: on a
box with a CPU quota the CPU is what the quota rations). Without Mosquitto
installed it is left unmeasured (`message` None).

Memory: weight bytes per part and weight mode come from the model's shapes
(`weight_sizes.stored_bytes` on a meta-device skeleton, nothing loaded), and the
per-process baseline is the peak resident memory of a fresh Python that
imports what a stage agent imports and builds the model on the meta device
(measured in a child process: the caller's own memory, a test session's
say, says nothing of an agent's).

The measured part is cached as `edgebus-profile.json` in the model directory
and reused while the host, torch version and checkpoint files are the same;
`edgebus plan --profile` measures again.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import platform
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, get_args

import gguf
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from broker.mosquitto import MosquittoProcess, mosquitto_binary
from edgebus import frames
from edgebus.client import BusClient
from edgebus.errors import EdgebusError
from edgebus.model_import import GGUF_FILE
from edgebus.processes import idle_agent_rss
from node_agent import packed
from node_agent.checkpoint import tensor_locations
from node_agent.kv_cache import KVCache
from node_agent.weight_sizes import stored_bytes
from plant_config.planner import (
    BATCH_ROWS,
    PREFILL_POSITIONS,
    MessageCost,
    ModelCosts,
    PartBytes,
    PartCost,
)
from plant_config.schema import BrokerEndpoint, WeightMode

PROFILE_FILE = "edgebus-profile.json"
# Untimed first round: it pays for allocator growth and oneDNN's kernel choice per shape.
WARMUP_ROUNDS = 1
# Timed rounds: the minimum of 3 shrugs off rounds disturbed by other
# processes; a round of SmolLM2-135M takes ~1.5 s here on one thread.
ROUNDS = 3
PROFILE_THREADS = 1  # see the module doc
# Decode steps per round: each is cheap, and more give the minimum more chances.
DECODE_STEPS = 8
# Token ids drawn for the timing prompt: any ids the vocabulary holds time the same.
_PROMPT_IDS = 1000
_EMBEDDING, _HEAD = "embedding", "head"
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


def model_costs(model_dir: Path, *, remeasure: bool = False) -> tuple[ModelCosts, Measured, bool]:
    """The cost model of the model in `model_dir`, its measurements and whether they are new.

    Uses the cached profile unless `remeasure`, or unless it was measured on
    another machine, torch version or checkpoint; a fresh one is cached if
    the directory is writable.
    """
    key = _cache_key(model_dir)
    measured = None if remeasure else _read_cache(model_dir, key)
    fresh = measured is None
    if measured is None:
        measured = measure(model_dir)
        _write_cache(model_dir, measured)
    return costs_from(measured, weight_sizes(model_dir)), measured, fresh


def measure(model_dir: Path, *, rounds: int = ROUNDS) -> Measured:
    """Time every part of the model in `model_dir` on this machine (see the module doc)."""
    baseline = idle_agent_rss(model_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(PROFILE_THREADS)
    try:
        hidden = AutoConfig.from_pretrained(model_dir).hidden_size
        message = measure_message(hidden) if mosquitto_binary() is not None else None
        return _measure(model_dir, rounds, baseline, message)
    finally:
        torch.set_num_threads(threads)


def _measure(model_dir: Path, rounds: int, baseline: int,
             message: tuple[float, float] | None) -> Measured:
    from node_agent.engines.torch_engine import TorchEngine

    num_layers = AutoConfig.from_pretrained(model_dir).num_hidden_layers
    model = TorchEngine(model_dir, 0, num_layers)
    assert model.embed_tokens is not None and model.norm is not None and model.lm_head is not None
    parts: dict[str | int, tuple[nn.Module, nn.Module]] = {
        index: (layer, layer) for index, layer in enumerate(model.layers)}
    parts[_EMBEDDING] = (model.embed_tokens, model.embed_tokens)
    parts[_HEAD] = (model.norm, model.lm_head)
    prefill: dict[str | int, list[float]] = {name: [] for name in parts}
    decode: dict[str | int, list[float]] = {name: [] for name in parts}
    batch: dict[str | int, list[float]] = {name: [] for name in parts}
    generator = torch.Generator().manual_seed(0)
    for round_index in range(WARMUP_ROUNDS + rounds):
        timed = round_index >= WARMUP_ROUNDS
        cache = KVCache()
        ids = torch.randint(0, _PROMPT_IDS, (1, PREFILL_POSITIONS), generator=generator)
        with _timing(parts, prefill if timed else None):
            model.prefill(ids, cache, 0)
        for step in range(DECODE_STEPS):
            with _timing(parts, decode if timed else None):
                model.decode(ids[:, :1], [cache], [PREFILL_POSITIONS + step])
        # The batch's rows are requests of their own, each with its prompt's cache.
        caches = [KVCache() for _ in range(BATCH_ROWS)]
        for row_cache in caches:
            model.prefill(ids, row_cache, 0)
        rows = ids[:1, :1].expand(BATCH_ROWS, 1)
        for step in range(DECODE_STEPS):
            with _timing(parts, batch if timed else None):
                model.decode(rows, caches, [PREFILL_POSITIONS + step] * BATCH_ROWS)

    def times(name: str | int) -> tuple[float, float, float]:
        return min(prefill[name]), min(decode[name]), min(batch[name])

    return Measured(layers=[times(index) for index in range(num_layers)],
                    embedding=times(_EMBEDDING), head=times(_HEAD), message=message,
                    baseline_bytes=baseline,
                    key=_cache_key(model_dir),
                    measured_at=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"))


def weight_sizes(model_dir: Path) -> tuple[tuple[PartBytes, ...], PartBytes, PartBytes, bool]:
    """Weight bytes per layer, of the embedding and of the head, in each mode; whether tied."""
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):  # shapes only: nothing is allocated
        skeleton = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    decoder = skeleton.get_decoder()
    head = skeleton.get_output_embeddings()

    in_file = gguf_bytes(model_dir)

    def sizes(module: nn.Module, part: str | int, edge: bool = False) -> PartBytes:
        return PartBytes(**{mode: stored_bytes(module, mode, edge=edge)
                            for mode in get_args(WeightMode) if mode != "gguf"},
                         gguf=in_file.get(part, 0))

    return (tuple(sizes(layer, i) for i, layer in enumerate(decoder.layers)),
            sizes(decoder.embed_tokens, "embedding"),
            sizes(nn.ModuleList([decoder.norm, head]), "head", edge=True),
            head.weight is decoder.embed_tokens.weight)


def gguf_bytes(model_dir: Path) -> dict[str | int, int]:
    """Bytes of each layer (by index), of "embedding" and of "head" in the model's GGUF,
    as shipped; empty without one. A tied head is the embedding's matrix."""
    path = model_dir / GGUF_FILE
    if not path.is_file():
        return {}
    parts: dict[str | int, int] = collections.defaultdict(int)
    names = set()
    for tensor in gguf.GGUFReader(str(path)).tensors:
        names.add(tensor.name)
        layer = tensor.name.split(".")[1] if tensor.name.startswith("blk.") else None
        part: str | int = (int(layer) if layer is not None else "embedding"
                           if tensor.name.startswith("token_embd") else "head")
        parts[part] += int(tensor.n_bytes)
    if "output.weight" not in names:
        parts["head"] += parts["embedding"]
    return dict(parts)


def costs_from(measured: Measured,
               sizes: tuple[tuple[PartBytes, ...], PartBytes, PartBytes, bool]) -> ModelCosts:
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
                      packed_fp32=packed.available())


@contextmanager
def _timing(parts: dict[str | int, tuple[nn.Module, nn.Module]],
            into: dict[str | int, list[float]] | None) -> Iterator[None]:
    """Append each part's milliseconds in the enclosed forward pass to `into` (None: discard).

    A part runs from its first module's forward call to its last module's return,
    summed over the calls (a batched step may call a part once per row).
    """
    started: dict[str | int, float] = {}
    spent: dict[str | int, float] = dict.fromkeys(parts, 0.0)
    handles = []
    for name, (first, last) in parts.items():
        def begin(*_: Any, name: str | int = name) -> None:
            started[name] = time.perf_counter()

        def end(*_: Any, name: str | int = name) -> None:
            spent[name] += (time.perf_counter() - started[name]) * 1e3

        handles += [first.register_forward_pre_hook(begin), last.register_forward_hook(end)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
    if into is not None:
        for name, ms in spent.items():
            into[name].append(ms)


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
        rows = torch.randn(BATCH_ROWS, 1, 1, hidden, generator=torch.Generator().manual_seed(0))
        agent_s = broker_s = 0.0
        for index in range(MESSAGE_WARMUP + MESSAGES):
            if index == MESSAGE_WARMUP:
                agent_s, broker_s = time.process_time(), _cpu_s(broker_pid)
            header = frames.Header(request=0, epoch=0, step=index)
            sender.send(_TOPIC, b"".join(frames.encode(frames.Kind.HIDDEN, row, header, start=0)
                                         for row in rows))
            if await asyncio.wait_for(arrived.get(), MESSAGE_TIMEOUT_S) != BATCH_ROWS:
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


def _cache_key(model_dir: Path) -> dict[str, Any]:
    """What a profile depends on: the machine, torch and its threads, the checkpoint files."""
    files = sorted({str(path) for path in tensor_locations(model_dir).values()})
    return {"host": platform.node(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "threads": PROFILE_THREADS,
            "prefill_positions": PREFILL_POSITIONS,
            "checkpoint": [[Path(f).name, os.stat(f).st_size, os.stat(f).st_mtime_ns]
                           for f in files]}


def _read_cache(model_dir: Path, key: dict[str, Any]) -> Measured | None:
    try:
        data = json.loads((model_dir / PROFILE_FILE).read_text(encoding="utf-8"))
        message = data["message"]
        measured = Measured(layers=[(a, b, c) for a, b, c in data["layers"]],
                            embedding=tuple(data["embedding"]), head=tuple(data["head"]),
                            message=None if message is None else (message[0], message[1]),
                            baseline_bytes=data["baseline_bytes"], key=data["key"],
                            measured_at=data["measured_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none, unreadable or of an older format: measure again
    return measured if measured.key == key else None


def _write_cache(model_dir: Path, measured: Measured) -> None:
    target = model_dir / PROFILE_FILE
    temporary = target.with_name(f".{PROFILE_FILE}.{os.getpid()}")
    try:
        temporary.write_text(json.dumps(asdict(measured), indent=1), encoding="utf-8")
        temporary.replace(target)  # atomic: a concurrent reader sees the old or the new file
    except OSError:
        temporary.unlink(missing_ok=True)  # a read-only model directory: plan without a cache
