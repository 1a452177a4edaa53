"""The stage agent: one box, one contiguous range of layers.

    {root}/act/{node} --message of frames--> [inbox] --> scheduler --> next stage's topic
                                                                   \\-> coordinator (last stage)

Continuous batching: whenever the worker is free it takes every decode frame
waiting, from whatever requests, and runs them as one batched forward pass
(`StageModel.decode`), then publishes all their outputs as one message. Prompt
chunks run one per turn between those batches, so a long prompt never holds
up other requests' tokens for more than one chunk.

Frames are decoded and checked in the event loop (cheap); forward passes run
on one worker thread, so the loop keeps receiving and publishing while the CPU
computes. A frame that is garbage, out of order, or names an unknown request
is dropped with an event on `{root}/events`; it never takes the agent or
another request's state down with it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiomqtt
import torch

from edgebus import frames
from edgebus.client import BusClient
from edgebus.errors import FrameError
from edgebus.frames import Frame, Kind
from edgebus.messages import Event
from node_agent.kv_cache import KVCache
from node_agent.runtime import presence, publish_event, run_agent, serve_until
from node_agent.sampling import top_candidates
from node_agent.stage_model import StageModel
from plant_config import Plant

log = logging.getLogger(__name__)

_WIRE_DTYPES = {"float16": torch.float16, "float32": torch.float32}
# Most decode rows batched into one forward pass. Past ~32 a CPU stage stops
# gaining (the step turns compute-bound) while each row waits longer.
MAX_BATCH = 32


class StageAgent:
    """Runs one stage of the plant's pipeline."""

    def __init__(self, plant: Plant, node_id: str, model: StageModel | None = None, *,
                 batch_groups: int | None = None) -> None:
        self.plant = plant
        self.batch_groups = batch_groups or len(plant.stages)
        self.node_id = node_id
        self.index = plant.stage_index(node_id)
        spec = plant.stages[self.index]
        topics = plant.topics
        self.topics = topics
        self.model = model if model is not None else StageModel(plant.model, *spec.layers)
        is_last = self.index == len(plant.stages) - 1
        self.next_topic = topics.activations(
            plant.coordinator.id if is_last else plant.stages[self.index + 1].node)
        self.wire_dtype = _WIRE_DTYPES[plant.wire_dtype]
        self.caches: dict[int, KVCache] = {}  # touched only by the worker thread
        self.inbox: asyncio.Queue[Frame] = asyncio.Queue()
        self._prompts: collections.deque[Frame] = collections.deque()  # prefill chunks waiting
        self.metrics = {"compute_s": 0.0, "steps": 0.0, "rows": 0.0}
        self.bus = BusClient(
            plant.broker.endpoint(), f"{plant.plant_id}.{node_id}",
            subscriptions=[(topics.activations(node_id), 1)],
            presence=presence(topics, node_id, "stage", stage=self.index, layers=spec.layers,
                              metrics=self._metrics))
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"stage-{node_id}")
        self._background: set[asyncio.Task[None]] = set()

    def _metrics(self) -> dict[str, float]:
        caches = list(self.caches.values())  # a snapshot: the worker thread changes the dict
        return {**self.metrics, "queue": float(self.inbox.qsize() + len(self._prompts)),
                "requests": float(len(caches)), "kv_bytes": float(sum(c.nbytes for c in caches))}

    async def serve(self, stop: asyncio.Event) -> None:
        try:
            await serve_until(stop, self.bus, self._on_message, self._work())
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _on_message(self, message: aiomqtt.Message) -> None:
        payload = message.payload if isinstance(message.payload, bytes) else b""
        try:
            batch = frames.decode_all(payload)
        except frames.BatchError as exc:
            batch = exc.good
            self._report(f"dropped a frame on {message.topic}: {exc}")
        for frame in batch:
            self.inbox.put_nowait(frame)

    # -- scheduling (event loop) -----------------------------------------------

    def _batch_limit(self) -> int:
        """Decode rows to take now: a 1/batch_groups share of the requests held here.

        Taking all of them would merge every request into one group moving in
        lockstep, leaving S-1 stages idle while one computes; with one group
        per stage (the default) every box earns its place. Stages that share
        one box's cores want one group per core: more would only queue for them.
        """
        return max(1, min(MAX_BATCH, math.ceil(len(self.caches) / self.batch_groups)))

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            # With prompt chunks pending there is work now; else sleep until a frame comes.
            arrived = [] if self._prompts else [await self.inbox.get()]
            decodes: list[Frame] = []
            limit = self._batch_limit()
            while arrived or (not self.inbox.empty() and len(decodes) < limit):
                frame = arrived.pop() if arrived else self.inbox.get_nowait()
                if frame.kind == Kind.RELEASE:
                    await loop.run_in_executor(self._executor, self.caches.pop, frame.request,
                                               None)
                elif frame.step == 0:
                    self._prompts.append(frame)
                else:
                    decodes.append(frame)
            if decodes:
                await self._run(loop, decodes)
            if self._prompts:
                await self._run(loop, [self._prompts.popleft()])

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[Frame]) -> None:
        out, errors = await loop.run_in_executor(self._executor, self._forward, batch)
        for error in errors:
            self._report(error)
        if out:
            # Not awaited: the next batch need not wait for this one's PUBACK.
            # Publishes leave in call order, so a request's frames stay in order.
            self._spawn(self.bus.publish(self.next_topic, out, qos=1))

    # -- compute (worker thread) -------------------------------------------------

    def _forward(self, batch: list[Frame]) -> tuple[bytes, list[str]]:
        """Run a prefill chunk or a batch of decode rows; return the outgoing message."""
        errors: list[str] = []
        rows: list[tuple[Frame, torch.Tensor, KVCache]] = []
        for frame in batch:
            try:
                if any(frame.request == row[0].request for row in rows):
                    raise FrameError("second frame for this request in one batch: duplicate")
                rows.append((frame, self._check_input(frame), self._cache_for(frame)))
            except FrameError as exc:
                errors.append(f"dropped frame of request {frame.request:x} step {frame.step}: "
                              f"{exc}")
        if not rows:
            return b"", errors
        started = time.perf_counter()
        try:
            if rows[0][0].step == 0:
                (frame, x, cache), = rows
                out = self.model.prefill(x, cache, frame.start)
            else:
                out = self.model.decode(torch.cat([x for _, x, _ in rows]),
                                        [cache for _, _, cache in rows],
                                        [frame.start for frame, _, _ in rows])
        except Exception as exc:
            # A half-updated cache would poison every later step of these requests.
            for frame, _, _ in rows:
                self.caches.pop(frame.request, None)
            return b"", [*errors, f"forward failed ({type(exc).__name__}: {exc}); dropped "
                                  f"{len(rows)} request(s)"]
        self.metrics["compute_s"] += time.perf_counter() - started
        self.metrics["steps"] += 1
        self.metrics["rows"] += len(rows)
        return b"".join(self._encode(frame, out[i:i + 1])
                        for i, (frame, _, _) in enumerate(rows)), errors

    def _cache_for(self, frame: Frame) -> KVCache:
        if frame.start == 0:
            cache = self.caches[frame.request] = KVCache()
            return cache
        cache_or_none = self.caches.get(frame.request)
        if cache_or_none is None:
            raise FrameError("unknown request (never prefilled here, or already released)")
        if cache_or_none.get_seq_length() != frame.start:
            raise FrameError(f"frame starts at position {frame.start} but the cache holds "
                             f"{cache_or_none.get_seq_length()}: duplicate or out of order")
        return cache_or_none

    def _encode(self, frame: Frame, out: torch.Tensor) -> bytes:
        header = dict(request=frame.request, epoch=frame.epoch, step=frame.step,
                      start=frame.start)
        if self.model.lm_head is None:
            return frames.encode(Kind.HIDDEN, out.to(self.wire_dtype),
                                 candidates=frame.candidates, **header)
        if frame.candidates == 0:  # a prompt chunk before the last: nothing to sample yet
            return b""
        ids, logits = top_candidates(out, frame.candidates)
        return frames.encode_candidates(ids, logits, **header)

    def _check_input(self, frame: Frame) -> torch.Tensor:
        """The frame's tensor, or FrameError if it cannot be this stage's input."""
        first = self.model.embed_tokens is not None
        expected = Kind.TOKENS if first else Kind.HIDDEN
        if frame.kind != expected:
            raise FrameError(f"stage {self.index} takes {expected.name} frames, got "
                             f"{frame.kind.name}")
        if frame.count < 1 or (frame.step > 0 and frame.count != 1):
            raise FrameError(f"step {frame.step} carries {frame.count} positions")
        if frame.candidates > self.model.config.vocab_size or (
                frame.step > 0 and frame.candidates == 0):
            raise FrameError(f"asks for {frame.candidates} candidates")
        x = frame.tensor()
        if first:
            if x.shape != (1, frame.count):
                raise FrameError(f"token frame of shape {tuple(x.shape)}, expected "
                                 f"(1, {frame.count})")
            if int(x.min()) < 0 or int(x.max()) >= self.model.config.vocab_size:
                raise FrameError("token id outside the vocabulary")
            return x.long()
        if x.shape != (1, frame.count, self.model.config.hidden_size):
            raise FrameError(f"hidden-state frame of shape {tuple(x.shape)}, expected "
                             f"(1, {frame.count}, {self.model.config.hidden_size})")
        if not torch.isfinite(x).all():
            raise FrameError("hidden states hold NaN or Inf")
        return x

    def _report(self, message: str) -> None:
        self._spawn(publish_event(
            self.bus, self.topics, Event(kind="error", agent_id=self.node_id, message=message)))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def run_stage(plant: Plant, node_id: str, threads: int | None = None,
              batch_groups: int | None = None) -> None:
    """`edgebus node PLANT --id NODE`: load the layers, then serve until SIGTERM."""
    spec = plant.stages[plant.stage_index(node_id)]
    threads = threads or spec.threads
    if threads:
        torch.set_num_threads(threads)

    async def main(stop: asyncio.Event) -> None:
        agent = StageAgent(plant, node_id, batch_groups=batch_groups)
        log.info("stage %s holds layers [%d, %d): %.1f MB of parameters", node_id,
                 *spec.layers, agent.model.param_bytes / 1e6)
        await agent.serve(stop)

    run_agent(main)
