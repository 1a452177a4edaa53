"""The stage agent: one box, one contiguous range of layers.

    {root}/act/{node}  --frame-->  [inbox] --> forward (worker thread) --> next stage's topic
                                                                     \\-> coordinator (last stage)

Frames are decoded and checked in the event loop (cheap), queued, and run one
at a time on a single worker thread, so the event loop keeps receiving and
publishing while the CPU computes. A frame that is garbage, out of order, or
names an unknown request is dropped with an event on `{root}/events`; it never
takes the agent or another request's state down with it.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

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


class StageAgent:
    """Runs one stage of the plant's pipeline."""

    def __init__(self, plant: Plant, node_id: str, model: StageModel | None = None) -> None:
        self.plant = plant
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
        self.bus = BusClient(
            plant.broker.endpoint(), f"{plant.plant_id}.{node_id}",
            subscriptions=[(topics.activations(node_id), 1)],
            presence=presence(topics, node_id, "stage", stage=self.index, layers=spec.layers))
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"stage-{node_id}")
        self._background: set[asyncio.Task[None]] = set()

    async def serve(self, stop: asyncio.Event) -> None:
        try:
            await serve_until(stop, self.bus, self._on_message, self._work())
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _on_message(self, message: aiomqtt.Message) -> None:
        try:
            frame = frames.decode(message.payload)
        except (FrameError, TypeError) as exc:
            self._report(f"dropped a frame on {message.topic}: {exc}")
            return
        self.inbox.put_nowait(frame)

    async def _work(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            frame = await self.inbox.get()
            try:
                out = await loop.run_in_executor(self._executor, self._step, frame)
            except FrameError as exc:
                self._report(f"dropped frame of request {frame.request:x} step {frame.step}: "
                             f"{exc}")
                continue
            if out is not None:
                await self.bus.publish(self.next_topic, out, qos=1)

    def _step(self, frame: Frame) -> bytes | None:
        """Run one frame through this stage's layers (worker thread)."""
        if frame.kind == Kind.RELEASE:
            self.caches.pop(frame.request, None)
            return None
        x = self._check_input(frame)
        if frame.step == 0:
            cache = self.caches[frame.request] = KVCache()
        elif (found := self.caches.get(frame.request)) is not None:
            cache = found
        else:
            raise FrameError("unknown request (never prefilled here, or already released)")
        if cache.get_seq_length() != frame.start:
            raise FrameError(f"frame starts at position {frame.start} but the cache holds "
                             f"{cache.get_seq_length()}: duplicate or out of order")
        try:
            if frame.step == 0:
                out = self.model.prefill(x, cache, frame.start)
            else:
                out = self.model.decode(x, cache, frame.start)
        except Exception as exc:
            # A half-updated cache would poison every later step of this request.
            self.caches.pop(frame.request, None)
            raise FrameError(f"forward failed ({type(exc).__name__}: {exc})") from exc
        header = dict(request=frame.request, epoch=frame.epoch, step=frame.step,
                      start=frame.start)
        if self.model.lm_head is not None:
            ids, logits = top_candidates(out, frame.candidates)
            return frames.encode_candidates(ids, logits, **header)
        return frames.encode(Kind.HIDDEN, out.to(self.wire_dtype), candidates=frame.candidates,
                             **header)

    def _check_input(self, frame: Frame) -> torch.Tensor:
        """The frame's tensor, or FrameError if it cannot be this stage's input."""
        first = self.model.embed_tokens is not None
        expected = Kind.TOKENS if first else Kind.HIDDEN
        if frame.kind != expected:
            raise FrameError(f"stage {self.index} takes {expected.name} frames, got "
                             f"{frame.kind.name}")
        if frame.count < 1 or (frame.step > 0 and frame.count != 1):
            raise FrameError(f"step {frame.step} carries {frame.count} positions")
        if not 1 <= frame.candidates <= self.model.config.vocab_size:
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
        task = asyncio.create_task(publish_event(
            self.bus, self.topics, Event(kind="error", agent_id=self.node_id, message=message)))
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def run_stage(plant: Plant, node_id: str, threads: int | None = None) -> None:
    """`edgebus node PLANT --id NODE`: load the layers, then serve until SIGTERM."""
    spec = plant.stages[plant.stage_index(node_id)]
    threads = threads or spec.threads
    if threads:
        torch.set_num_threads(threads)

    async def main(stop: asyncio.Event) -> None:
        agent = StageAgent(plant, node_id)
        log.info("stage %s holds layers [%d, %d): %.1f MB of parameters", node_id,
                 *spec.layers, agent.model.param_bytes / 1e6)
        await agent.serve(stop)

    run_agent(main)
