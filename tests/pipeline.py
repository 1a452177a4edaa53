"""Run a whole plant inside the test process, over a real broker.

Stage agents and the coordinator are the production classes, connected to a
real broker through real sockets; only the OS-process boundary is left out
(tests that depend on it run `edgebus up`). Loaded stage weights are shared
between tests because loading is the slow part; KV caches live in the agents,
so no request state is shared.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import optional
from brokers import BrokerHandle

from edgebus.ask import ask
from edgebus.core.messages import GenerateRequest, GenerateResponse
from node_agent.coordinator.agent import Coordinator
from node_agent.coordinator.token_loop import prefill_chunks
from node_agent.engines import StageEngine, context_shape, load_engine
from node_agent.gguf_tokenizer import GgufTokenizer
from node_agent.memory import return_freed_memory
from node_agent.model_config import generation_eos, is_gguf, load_config
from node_agent.stage import StageAgent
from plant_config import BrokerSettings, CoordinatorSpec, Plant, StageSpec
from plant_config.schema import EngineName, WeightMode, resolve_engine

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

# torch and transformers are imported where a helper needs them, after
# optional.require_torch(): on a base install (a llama.cpp box) the tests that need only
# llama.cpp run, and those that need torch skip, saying why.

READY_TIMEOUT_S = 30.0


def plant_for(model_dir: Path, broker: BrokerHandle, splits: Sequence[tuple[int, int]], *,
              weights: WeightMode = "fp32", engine: EngineName = "auto",
              kv_budget_mb: int = 512, threads: int | None = None,
              **coordinator: object) -> Plant:
    """A plant over `broker` with one stage per layer range, on a topic root of its own.

    `threads`: each stage's (None: the plant file's default, all cores for llama.cpp). A
    plant run inside the test process has its stages share the test's cores: on tiny
    models, one thread each spends the CPU on the path under test, not on OpenMP's
    threads waiting at barriers for each other."""
    return Plant(
        plant_id="test", topic_root=f"edgebus-test/{secrets.token_hex(4)}",
        broker=BrokerSettings(url=f"mqtt://{broker.host}:{broker.port}",
                              protocol="5" if broker.mqtt5 else "3.1.1"),
        model=model_dir,
        stages=[StageSpec(node=f"stage-{i}", layers=layers, weights=weights, engine=engine,
                          kv_budget_mb=kv_budget_mb, threads=threads)
                for i, layers in enumerate(splits)],
        coordinator=CoordinatorSpec(**coordinator))  # type: ignore[arg-type]


# Threads of the engines this process loads (shared stages and references) and of its torch
# (conftest.py). Their operations on tiny models last microseconds, beside a plant's other
# agents in threads and processes of their own: with two threads every operation waited at
# an OpenMP barrier for a core the plant held. test_pipeline.py's tiny-model tests took 78
# CPU-seconds with two, 26.7 with one; SmolLM2's llama.cpp chat reference 12.8 with two, 1.4
# with one (2-core AMD EPYC, load 5-7). llama.cpp and torch compute each row on one thread
# either way, so the answers do not change.
IN_PROCESS_THREADS = 1

# Loaded stage engines, shared between tests because loading is the slow part, until
# release_models (conftest.py: at the end of each test module). Kept for the whole run, the
# suite's process held 13.5 GB by its end: every engine, mode and split of SmolLM2.
_STAGES: dict[tuple[Path, int, int, WeightMode, EngineName], StageEngine] = {}


def stage_model(model_dir: Path, first: int, end: int, weights: WeightMode = "fp32",
                engine: EngineName = "auto") -> StageEngine:
    key = (model_dir, first, end, weights, engine)
    if key not in _STAGES:
        _STAGES[key] = load_engine(model_dir, first, end, engine=engine, weights=weights,
                                   threads=IN_PROCESS_THREADS)
    return _STAGES[key]


def release_models() -> None:
    """Close the shared stage engines and drop the reference models; the next test that
    needs one loads it again."""
    for engine in _STAGES.values():
        engine.close()
    _STAGES.clear()
    _reference_model.cache_clear()
    _gguf_tokenizer.cache_clear()
    gc.collect()
    # What outlives a module is the run's (the modules its tests imported, session fixtures):
    # out of the collector's walk from now on, as what collection imported (conftest.py).
    gc.freeze()
    return_freed_memory()


@functools.cache
def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    optional.require_torch()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@asynccontextmanager
async def running(plant: Plant) -> AsyncIterator[list[StageAgent]]:
    """Start every agent of `plant` as a task; yield the stages once the pipeline is ready."""
    stop = asyncio.Event()
    # llama.cpp engines load in a fraction of a second but hold their whole KV budget from
    # the start: each plant gets its own, closed at the end, instead of cached ones.
    fresh = [load_engine(plant.model, *s.layers, engine=s.engine, weights=s.weights,
                         threads=s.threads, shape=context_shape(plant, s.node))
             if resolve_engine(s.engine, s.weights) == "llamacpp" else None
             for s in plant.stages]
    stages = [StageAgent(plant, s.node, model=engine or stage_model(
                  plant.model, *s.layers, s.weights, s.engine))
              for s, engine in zip(plant.stages, fresh, strict=True)]
    # A GGUF model's coordinator reads the file's own tokenizer (node_agent/gguf_tokenizer.py).
    coordinator = Coordinator(plant, tokenizer=None if is_gguf(plant.model)
                              else tokenizer(plant.model))
    agents: list[StageAgent | Coordinator] = [*stages, coordinator]
    tasks = [asyncio.create_task(agent.serve(stop)) for agent in agents]
    try:
        await asyncio.wait_for(coordinator._ready.wait(), READY_TIMEOUT_S)
        yield stages
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        for engine in fresh:
            if engine is not None:
                engine.close()


_T = TypeVar("_T")


@asynccontextmanager
async def beside(compute: Callable[[], _T]) -> AsyncIterator[asyncio.Future[_T]]:
    """`compute()` (a reference's answers) in a thread while the block runs a plant: its
    result is the future's once the block ends. Done or failed by then, even where the
    block raises, so it never outlives the test (release_models closes its engines).

    A plant in the test process is a pipeline: over SmolLM2's llama.cpp split it kept about
    one of two cores busy, and the whole-model reference after it took 40 % of the test.
    Entered inside `running`, once the stages are ready, so no two models load at once.
    For a reference that computes in C between short Python steps (llama.cpp's, a call a
    token): `generate()` is Python between its torch calls, and beside a plant in this
    process it held the GIL the plant's hops need (slower than after it, here)."""
    future = asyncio.ensure_future(asyncio.to_thread(compute))
    try:
        yield future
    finally:
        await asyncio.wait([future])


async def ask_all(plant: Plant, requests: Sequence[GenerateRequest]) -> list[GenerateResponse]:
    """All requests in flight at once, each from its own gateway client."""
    return list(await asyncio.gather(*(ask(plant, r, client_id=f"gw{i}")
                                       for i, r in enumerate(requests))))


@functools.cache
def _gguf_tokenizer(path: Path) -> GgufTokenizer:
    return GgufTokenizer(path)


@functools.cache
def _reference_model(model_dir: Path) -> torch.nn.Module:
    optional.require_torch()
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def prompt_ids(model_dir: Path, request: GenerateRequest) -> list[int]:
    """Tokenize like a test author would, straight from transformers; a GGUF file (which
    transformers reads only by converting it) with llama.cpp's reading of its vocabulary,
    which tests/test_gguf_model.py holds to transformers'."""
    # Both answer transformers' calls (node_agent/tokenizer.py's TemplatedTokenizer).
    tok: Any = _gguf_tokenizer(model_dir) if is_gguf(model_dir) else tokenizer(model_dir)
    if request.messages is not None:
        chat = [m.model_dump() for m in request.messages]
        return list(tok.apply_chat_template(chat, add_generation_prompt=True,
                                            return_dict=True)["input_ids"])
    return list(tok(request.prompt)["input_ids"])


@functools.cache
def _generate(model_dir: Path, ids: tuple[int, ...], max_new_tokens: int,
              ignore_eos: bool) -> tuple[int, ...]:
    import torch

    model = _reference_model(model_dir)
    kwargs = {"eos_token_id": None} if ignore_eos else {}
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,  # type: ignore[operator]
                         do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         **kwargs)
    return tuple(out[0, len(ids):].tolist())


@functools.cache
def _engine_tokens(model_dir: Path, ids: tuple[int, ...], max_new_tokens: int, ignore_eos: bool,
                   engine: EngineName, weights: WeightMode, chunk: int) -> tuple[int, ...]:
    model = stage_model(model_dir, 0, load_config(model_dir).num_hidden_layers, weights, engine)
    eos = generation_eos(model_dir)
    stop = set() if ignore_eos else set(eos) if isinstance(eos, list) else {eos}
    cache, start = model.new_cache(0), 0
    try:
        for size in prefill_chunks(len(ids), chunk):  # the coordinator's chunks
            logits = model.run([np.array([ids[start:start + size]])], [cache], [start])[0]
            start += size
        out: list[int] = []
        while True:
            assert logits is not None
            out.append(int(np.argmax(logits)))
            if len(out) == max_new_tokens or out[-1] in stop:
                return tuple(out)
            logits = model.run([np.array([[out[-1]]])], [cache],
                                [len(ids) + len(out) - 1])[0]
    finally:
        model.free_cache(cache)


def engine_tokens(model_dir: Path, request: GenerateRequest, engine: EngineName,
                  weights: WeightMode, chunk: int = 128) -> list[int]:
    """Greedy tokens for `request` from the whole model as one `engine` in `weights`, in this
    process, one request at a time: what a pipeline of that engine and mode must answer."""
    ids = tuple(prompt_ids(model_dir, request))
    return list(_engine_tokens(model_dir, ids, request.max_tokens, request.ignore_eos, engine,
                               weights, chunk))


def reference_tokens(model_dir: Path, request: GenerateRequest) -> list[int]:
    """What `generate(do_sample=False)` in one process gives for `request`."""
    ids = tuple(prompt_ids(model_dir, request))
    return list(_generate(model_dir, ids, request.max_tokens, request.ignore_eos))


def plant_reference(plant: Plant, request: GenerateRequest) -> list[int]:
    """What `plant` must answer to greedy `request`: llama.cpp's answer for the GGUF whole,
    with the prompt in the plant's chunks, where every stage is `weights: gguf`; otherwise
    `generate`'s on the fp32 checkpoint."""
    if all(s.weights == "gguf" for s in plant.stages):
        return engine_tokens(plant.model, request, "llamacpp", "gguf",
                             plant.coordinator.prefill_chunk)
    return reference_tokens(plant.model, request)
