"""The references the pipeline is measured against: the model in one process, and memory.

Baseline A is what a plant would run if one box could hold the model:
`transformers` `generate` on the same fp32 checkpoint with every core. The
llama.cpp number is a stretch reference on the bundled Q4_1 GGUF (a quarter
of the bytes per weight, so not the same arithmetic). The memory references
say how much of a stage's peak RSS is its share of the weights.
"""

from __future__ import annotations

import gc
import math
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.streamers import BaseStreamer

from edgebus.core.errors import EdgebusError
from edgebus.core.processes import proc_status_bytes
from harness.metrics import (
    StreamStats,
    Trace,
    stream_stats,
    time_to_first_token,
)
from harness.peers import Skipped, llama_cpp_python_single
from harness.results import OneCoreBaseline, TransformersBaseline
from harness.workload import chat_request, long_request
from node_agent.checkpoint import tensor_locations
from node_agent.text import prompt_ids

T = TypeVar("T")

# Untimed runs first: the first generate pays for allocator growth and for
# oneDNN picking its kernels for each new shape.
WARMUP_RUNS = 1
# Static batches for reference: what one process gets when requests arrive together.
STATIC_BATCHES = (8, 16)
# Bytes per element of the safetensors dtypes a checkpoint may hold.
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
                "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class _TokenTimes(BaseStreamer):
    """Records when `generate` hands over each new token; its first `put` is the prompt."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        """Nothing to flush: only times are kept."""


def run_transformers(model_dir: Path, tokenizer: PreTrainedTokenizerBase, *, tokens: int,
                     runs: int, long_prompt: str, threads: int) -> TransformersBaseline:
    """Baseline A: single stream, static batches, and the long prompt's time to first token."""
    torch.set_num_threads(threads)
    chat = torch.tensor([prompt_ids(tokenizer, chat_request("baseline", tokens))])
    long = torch.tensor([prompt_ids(tokenizer, long_request("baseline", long_prompt))])

    def measure(model: PreTrainedModel) -> TransformersBaseline:
        for _ in range(WARMUP_RUNS):
            _generate(model, chat, tokens)
            _generate(model, long, 1)
        single = stream_stats([_generate(model, chat, tokens) for _ in range(runs)])
        batch = {size: _batch_rate(model, chat, size, tokens) for size in STATIC_BATCHES}
        long_ttft = statistics.median(time_to_first_token(_generate(model, long, 1))
                                      for _ in range(runs))
        return TransformersBaseline(single=single, batch_tok_s=batch, long_ttft_s=long_ttft)

    return _measured(model_dir, measure)


def run_transformers_one_core(model_dir: Path, tokenizer: PreTrainedTokenizerBase, *,
                              tokens: int, runs: int, cpu: int,
                              batches: tuple[int, ...]) -> OneCoreBaseline:
    """The one process the pinned stages are compared with: one thread, pinned to `cpu`.

    Linux only (sched_setaffinity); the caller's affinity and thread count are
    restored afterwards.
    """
    affinity, threads = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    chat = torch.tensor([prompt_ids(tokenizer, chat_request("baseline", tokens))])

    def measure(model: PreTrainedModel) -> OneCoreBaseline:
        for _ in range(WARMUP_RUNS):
            _generate(model, chat, tokens)
        single = stream_stats([_generate(model, chat, tokens) for _ in range(runs)])
        batch = {size: _batch_rate(model, chat, size, tokens) for size in batches}
        return OneCoreBaseline(single_tok_s=single.tok_s, batch_tok_s=batch)

    try:
        return _measured(model_dir, measure)
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, affinity)


def _measured(model_dir: Path, measure: Callable[[PreTrainedModel], T]) -> T:
    """`measure` run on the fp32 model of `model_dir`, which is freed before this returns."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    try:
        return measure(model)
    finally:
        del model
        gc.collect()  # the agents measured next should not share the box with 0.5 GB of garbage


def _generate(model: PreTrainedModel, ids: torch.Tensor, tokens: int) -> Trace:
    times = _TokenTimes()
    sent = time.perf_counter()
    out = _greedy(model, ids, tokens, streamer=times)
    done = time.perf_counter()
    return Trace(sent=sent, arrivals=list(enumerate(times.times)), done=done,
                 tokens=out.shape[1] - ids.shape[1])


def _batch_rate(model: PreTrainedModel, chat: torch.Tensor, size: int, tokens: int) -> float:
    batch = chat.repeat(size, 1)  # the same prompt in every row: no padding to account for
    sent = time.perf_counter()
    out = _greedy(model, batch, tokens)
    return size * (out.shape[1] - chat.shape[1]) / (time.perf_counter() - sent)


def _greedy(model: PreTrainedModel, ids: torch.Tensor, tokens: int,
            streamer: BaseStreamer | None = None) -> torch.Tensor:
    # eos_token_id=None: never stop early, as the pipeline's requests ask with ignore_eos.
    out: torch.Tensor = model.generate(  # type: ignore[operator]
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False,
        eos_token_id=None, pad_token_id=model.generation_config.pad_token_id,
        streamer=streamer)
    if out.shape[1] - ids.shape[1] != tokens:
        raise EdgebusError(f"generate made {out.shape[1] - ids.shape[1]} tokens, not {tokens}: "
                           "the baseline would not do the pipeline's work")
    return out


def run_llama_cpp(gguf: Path, ids: list[int], *, tokens: int, runs: int, threads: int,
                  notes: list[str] | None = None) -> StreamStats | None:
    """Single stream on llama.cpp through llama-cpp-python, measured in a child process.

    None if it is not installed or could not run; the reason then goes to `notes`
    (the report's notes). llama.cpp runs with its extra CPU buffer types (repacked
    weights, AMX) first, as it does by default. If the child dies of a signal, as on
    Intel VMs that advertise AMX but do not execute it (SIGILL), it runs again without
    them, and `notes` says so: those numbers are then without repacked kernels.
    """
    result = llama_cpp_python_single(gguf, ids, tokens=tokens, runs=runs, threads=threads)
    if isinstance(result, Skipped) and result.crashed:
        retry = llama_cpp_python_single(gguf, ids, tokens=tokens, runs=runs, threads=threads,
                                        extra_bufts=False)
        if not isinstance(retry, Skipped) and notes is not None:
            notes.append(f"llama.cpp (llama-cpp-python): {result.reason}; measured again "
                         "with use_extra_bufts=False (no AMX, no repacked weights)")
        result = retry
    if isinstance(result, Skipped):
        if notes is not None:
            notes.append(f"llama.cpp (llama-cpp-python) skipped: {result.reason}")
        return None
    return result


def rss(pid: int) -> tuple[int, int]:
    """(peak, current) resident set size of a running process in bytes: VmHWM, VmRSS."""
    status = Path(f"/proc/{pid}/status").read_text()
    return proc_status_bytes(status, "VmHWM"), proc_status_bytes(status, "VmRSS")


def checkpoint_tensor_bytes(model_dir: Path) -> dict[str, int]:
    """Bytes of every tensor in the checkpoint, from the safetensors headers (no tensor is read)."""
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, path in tensor_locations(model_dir).items():
        by_file[path].append(name)
    sizes: dict[str, int] = {}
    for path, names in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in names:
                tensor = f.get_slice(name)
                sizes[name] = math.prod(tensor.get_shape()) * _DTYPE_BYTES[tensor.get_dtype()]
    return sizes
