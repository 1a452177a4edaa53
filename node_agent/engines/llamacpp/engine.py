"""The llamacpp engine: a stage's layers run by llama.cpp from the GGUF's own blocks.

A stage loads its stage GGUF (stage_gguf.py: layers [first, end) renumbered)
into one llama.cpp context. Each request is a llama.cpp *sequence* of that
context, so its keys and values live inside llama.cpp; `new_cache` hands out a
sequence id and `free_cache` clears it (`llama_memory_seq_rm`).

    first:  ids [T]   ─ batch.token ─> layers ─ capture l_out-{n-1} ─> [T, H]
    middle: h [T, H]  ─ batch.embd  ─> layers ─ capture l_out-{n-1} ─> [T, H]
    last:   h [T, H]  ─ batch.embd  ─> layers ─ norm ─ LM head ───────> [V] per row

The capture is a C eval callback (capture.c): it copies the last layer's
output and stops the graph, so a stage that is not last never computes the
final norm or the LM head.

Exactness: the context keeps one KV stream per sequence (`kv_unified =
false`), with which a row's attention does not depend on the other rows of its
batch, bit for bit. Its matrix products may: ggml hands a product of several
rows to other kernels than one row's where it has them, and some sum in another
order (which, depends on the block type and the CPU: docs/row-exactness.md). So
the engine measures two things at load, and calls llama.cpp only in ways it
found exact:
- `exact_batch`: how many decode rows of as many sequences one call computes,
  each as it is alone (`_exact_batch`). Decode rows of many requests run in
  calls of at most that many rows, sequence ids ascending: llama.cpp's split keeps ascending,
  consecutive ids in one micro-batch and the rows in batch order. Ids with gaps
  it splits into one micro-batch per run of consecutive ids, each reading every
  weight again, so before such a call the engine moves sequences to make the
  rows' ids one run (`_contiguous`).
- `exact_rows`: how many positions of one sequence one call computes as as many
  one-position calls (`_exact_rows`). A decode frame of a token and its drafts
  (`verify`) is one call up to that many positions, else one call a position.
  The same probe times its calls: `row_costs[k - 1]`, the time of k positions in
  one call over one position's, which the status shows the operator.
A prompt chunk runs in a call of its own, all its positions at once, as the
whole model run in one process with the same chunks computes it. In one call
with decode rows, llama.cpp would split it anyway (one position beside the
decode rows, the rest after: llama-batch.cpp, split_equal), so the separate
call reads the weights no more often.
"""

from __future__ import annotations

import ctypes
import itertools
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from edgebus.core.errors import EngineError
from edgebus.core.frames import MAX_DECODE_POSITIONS
from node_agent.engines.base import CacheFull, ContextShape, StageEngine, StageSlice
from node_agent.engines.llamacpp import library, stage_gguf
from node_agent.memory import return_freed_memory
from node_agent.model_config import (
    LLAMACPP_KV_ITEM_BYTES,
    kv_bytes_per_token,
    load_config,
    model_gguf,
)
from plant_config.schema import Device

if TYPE_CHECKING:
    # Only for `step`, the torch API of tests and tools: a stage runs `run`, without torch.
    import torch

# Flash attention on: its CPU kernel computes each query row alone, over the row's own
# keys and values, so positions of one sequence in one call attend as they do one a call.
# Off, their attention scores are a matrix product that llamafile's sgemm takes from 2
# rows on (F16 keys, a summing order of its own): SmolLM2 on the Intel Xeon VM, 8
# positions after 50 of history, one call against one a call, logits 0.63 apart, where
# the load-time probe's short history saw none (docs/row-exactness.md).
FLASH_ATTN = 1
# Positions of history the load-time probes compute first, so that the rows they compare
# attend over a history, as a request's decode rows do.
PROBE_HISTORY = 16
# Rows the load-time probe batches at most: the bench's 16 concurrent requests. Kernels
# pick their tiling by the row count (ggml's repacked ARM kernels go from gemv to gemm at
# 4), so the probe tries as many rows as a stage batches in practice.
PROBE_ROWS = 16


class SeqCache:
    """One request's keys and values inside llama.cpp: a sequence id of the stage's context.
    What the stage agent reads of it is what it reads of a KVCache."""

    def __init__(self, seq_id: int, epoch: int, bytes_per_position: int) -> None:
        self.seq_id = seq_id
        self.epoch = epoch
        self.touched = time.monotonic()
        self.held = 0  # positions computed
        self.nbytes = 0  # a plain int another thread may read (the status)
        self._per_position = bytes_per_position

    def get_seq_length(self) -> int:
        return self.held

    def advance(self, positions: int) -> None:
        self.held += positions
        self.nbytes = self.held * self._per_position

    def cut(self, positions: int) -> None:
        self.held = min(self.held, positions)
        self.nbytes = self.held * self._per_position


class LlamaCppEngine(StageEngine):
    """Layers [first, end) of `model` (a GGUF file, or a directory with one), run by
    llama.cpp."""

    name = "llamacpp"

    def __init__(self, model: Path, first: int, end: int, *, shape: ContextShape,
                 threads: int, device: Device = "cpu", observer: Any = None) -> None:
        """`observer`: an eval callback (`ggml_backend_sched_eval_callback`) for a stage that
        runs the head, which needs no capture: how the planner's profile times each layer
        (node_agent/gguf_profile.py). Stages run without one."""
        self._llama = lowlevel = library.llama()
        self.config = load_config(model)
        self.slice = StageSlice(first, end, self.config.num_hidden_layers)
        self.threads, self.device = threads, device
        source = model_gguf(model)
        path = stage_gguf.stage_file(source, first, end,
                                     library_version=library.library_version())
        # A cut leaves its freed buffers in the heap (22 MiB of SmolLM2's first stage,
        # measured): RSS should be the layers and the KV, not them.
        return_freed_memory()
        self._file_bytes = path.stat().st_size
        # On a CPU: weights placed so that rows of one call stay exact where this CPU's
        # kernels were measured (placement.py), before the probes below measure it.
        params, overrides = (library.model_params(path) if device == "cpu"
                             else (lowlevel.llama_model_default_params(), None))
        # cuda: every layer on the GPU; llama.cpp keeps the rest on the CPU.
        params.n_gpu_layers = 999 if device == "cuda" else 0
        # Read into memory, not mapped (load mode none reads the file): on CPUs where
        # llama.cpp repacks blocks for its kernels (Q4_0, Q4_K, Q8_0 on AVX2 and on ARM's
        # dotprod), a mapped file stays resident beside its repacked copy. Llama-3-8B's
        # shape in Q4_0 (4.66 GB), whole, on the 2-core AMD EPYC: 8,299 MiB RSS mapped
        # (3,839 anonymous + 4,459 file), 4,584 read (docs/architecture.md, "A stage holds
        # its weights once").
        params.load_mode = lowlevel.LLAMA_LOAD_MODE_NONE
        self._model = lowlevel.llama_model_load_from_file(str(path).encode(), params)
        del overrides  # read by the load only
        if not self._model:
            raise EngineError(f"llama.cpp could not load {path}: its reasons are in the log "
                              "lines above (logger llama.cpp)")
        self.hidden = int(lowlevel.llama_model_n_embd(self._model))
        self.vocab = int(lowlevel.llama_vocab_n_tokens(lowlevel.llama_model_get_vocab(
            self._model)))
        layers = int(lowlevel.llama_model_n_layer(self._model))
        self.kv_per_position = kv_bytes_per_token(self.config, (first, end), LLAMACPP_KV_ITEM_BYTES)
        per_sequence = shape.sequence_positions
        self.max_sequences = shape.sequences(self.kv_per_position)
        if self.max_sequences < 1:
            need = per_sequence * self.kv_per_position / 2**20
            raise EngineError(f"kv_budget_mb holds no request of {shape.positions} positions "
                              f"on layers [{first}, {end}) ({need:.1f} MiB each): raise "
                              "kv_budget_mb, or lower max_prompt_tokens or max_tokens_limit")
        self._free = list(range(self.max_sequences - 1, -1, -1))  # pop() takes the lowest id
        self._held: dict[int, SeqCache] = {}  # by llama.cpp sequence id
        self.moves = 0  # sequences moved to make a batch's ids consecutive (_contiguous)
        rows = shape.batch_positions
        # One float32 row per position a call carries: the input of a stage after the first,
        # and what the capture writes.
        self._hidden_in = np.zeros((rows, self.hidden), dtype=np.float32)
        self._hidden_out = np.zeros((rows, self.hidden), dtype=np.float32)
        context = lowlevel.llama_context_default_params()
        context.n_ctx = per_sequence * self.max_sequences
        context.n_batch = context.n_ubatch = rows
        context.n_seq_max = self.max_sequences
        # llama.cpp keeps an output row per sequence at least, and asserts it fits this.
        context.n_outputs_max = max(rows, self.max_sequences)
        context.n_threads = context.n_threads_batch = threads
        context.kv_unified = False
        context.flash_attn_type = FLASH_ATTN
        context.no_perf = True
        self._capture = None
        if not self.slice.has_head:
            self._capture = library.new_capture(f"l_out-{layers - 1}",
                                                self._hidden_out.ctypes.data,
                                                self._hidden_out.nbytes)
            context.cb_eval = library.callback_pointer()
            context.cb_eval_user_data = ctypes.cast(ctypes.pointer(self._capture),
                                                    ctypes.c_void_p)
        elif observer is not None:
            context.cb_eval = observer
        self._context = lowlevel.llama_init_from_model(self._model, context)
        if not self._context:
            raise EngineError(f"llama.cpp could not make a context of {context.n_ctx} "
                              f"positions for {self.max_sequences} requests: lower kv_budget_mb")
        self._memory = lowlevel.llama_get_memory(self._context)
        self._batch = _Batch(lowlevel, rows)
        # A profiling engine (observer) times single requests and never batches.
        self.exact_batch = PROBE_ROWS if observer is not None else self._exact_batch()
        if observer is None:
            self.exact_rows, self.row_costs = self._exact_rows()

    @property
    def param_bytes(self) -> int:
        return self._file_bytes

    def describe(self) -> dict[str, str | int | float]:
        return {"engine": self.name, "weights": "gguf", "device": self.device,
                "threads": self.threads, "tuned": self.tuned, "weight_bytes": self.param_bytes,
                "sequences": self.max_sequences, "exact_batch": self.exact_batch,
                "exact_rows": self.exact_rows, "cut_format": stage_gguf.CUT_FORMAT,
                **{f"row_cost_{k}": round(cost, 2)
                   for k, cost in enumerate(self.row_costs[1:], start=2)}}

    def kv_bytes_per_token(self) -> int:
        return self.kv_per_position

    # -- requests' sequences ---------------------------------------------------

    def new_cache(self, epoch: int) -> SeqCache:
        if not self._free:
            raise CacheFull(f"all {self.max_sequences} sequences of this node's llama.cpp "
                            "context are taken")
        cache = SeqCache(self._free.pop(), epoch, self.kv_per_position)
        self._held[cache.seq_id] = cache
        return cache

    def free_cache(self, cache: Any) -> None:
        assert isinstance(cache, SeqCache)
        self._llama.llama_memory_seq_rm(self._memory, cache.seq_id, -1, -1)
        del self._held[cache.seq_id]
        self._free.append(cache.seq_id)
        self._free.sort(reverse=True)

    def truncate(self, cache: Any, positions: int) -> None:
        """Drop a sequence's positions from `positions` on. llama.cpp frees their cells and
        moves the sequence's slot search back to the first of them (llama-kv-cache.cpp,
        seq_rm), so a position computed again lands in the cell it had: the keys sit in
        the same order, and the attention sums them as it did the first time."""
        assert isinstance(cache, SeqCache)
        if positions < cache.held:
            self._llama.llama_memory_seq_rm(self._memory, cache.seq_id, positions, -1)
            cache.cut(positions)

    def _contiguous(self, seqs: list[SeqCache]) -> None:
        """Give `seqs` consecutive sequence ids, moving as few sequences as it takes.

        llama.cpp runs one micro-batch per run of consecutive ids (llama-batch.cpp,
        split_equal with a KV stream per sequence), and each reads every weight: 8
        decode rows with ids in 4 runs cost 4 passes. Ids go to requests as their
        prompts arrive and come back as they end, while the coordinator groups
        requests by when they join (node_agent/groups.py), so a group's ids soon
        have gaps; measured in the bench at 16 concurrent, 8-row batches ran as 4-5
        micro-batches. A move copies the sequence's KV stream (llama_memory_seq_cp,
        done by the next llama_decode before it computes) and is bit-exact. Where
        no range can be freed, the rows run split, as before.
        """
        ids = sorted(seq.seq_id for seq in seqs)
        if ids[-1] - ids[0] == len(ids) - 1:
            return
        rows, count, free = set(ids), len(ids), set(self._free)
        # Running counts over the ids, so that each candidate range costs O(1).
        blocked = [0, *itertools.accumulate(int(i in self._held and i not in rows)
                                            for i in range(self.max_sequences))]
        freed = [0, *itertools.accumulate(int(i in free) for i in range(self.max_sequences))]
        inside = [0, *itertools.accumulate(int(i in rows) for i in range(self.max_sequences))]
        best: tuple[int, int] | None = None  # (moves, first id of the range)
        for first in range(self.max_sequences - count + 1):
            end = first + count
            blockers = blocked[end] - blocked[first]
            if blockers > len(free) - (freed[end] - freed[first]):
                continue  # no free id outside the range to move its other sequences to
            moves = blockers + count - (inside[end] - inside[first])
            if best is None or moves < best[0]:
                best = (moves, first)
        if best is None:
            return
        span = range(best[1], best[1] + count)
        for seq_id in [i for i in span if i in self._held and i not in rows]:
            self._move(self._held[seq_id], min(i for i in self._free if i not in span))
        for seq in [s for s in seqs if s.seq_id not in span]:
            self._move(seq, min(i for i in self._free if i in span))

    def _move(self, seq: SeqCache, dst: int) -> None:
        """Move a sequence's keys and values to the free id `dst`."""
        lowlevel, src = self._llama, seq.seq_id
        lowlevel.llama_memory_seq_cp(self._memory, src, dst, -1, -1)
        lowlevel.llama_memory_seq_rm(self._memory, src, -1, -1)
        self._free.remove(dst)
        self._free.append(src)
        self._free.sort(reverse=True)
        del self._held[src]
        self._held[dst] = seq
        seq.seq_id = dst
        self.moves += 1

    def _exact_batch(self) -> int:
        """The most one-position rows of as many sequences that one call computes bitwise as
        each alone: PROBE_ROWS together first (every row exact, the common case, costs one
        call); else 2, 3, ... up to the first count that differs. Measured, never assumed
        past PROBE_ROWS: a bigger batch runs as calls of that many rows."""
        most = min(PROBE_ROWS, self.max_sequences, self._batch.capacity)
        if most < 2:
            return 1
        x = self._probe_input(most, seed=1)
        xs = [x[:, i:i + 1] for i in range(most)]
        seqs = [SeqCache(seq_id, 0, self.kv_per_position) for seq_id in range(most)]
        history = self._probe_history(seqs)

        def exact(count: int) -> bool:
            together = self._call(xs[:count], seqs[:count], [history] * count, [True] * count)
            self._back_to(seqs, history)
            return all(a is not None and b is not None and np.array_equal(a, b)
                       for a, b in zip(alone, together, strict=False))

        try:
            alone = []
            for row, seq in zip(xs, seqs, strict=True):
                alone.append(self._call([row], [seq], [history], [True])[0])
                self._back_to([seq], history)
            if exact(most):
                return most
            count = 1
            while count + 1 < most and exact(count + 1):
                count += 1
            return count
        finally:
            self._back_to(seqs, 0)

    def _exact_rows(self) -> tuple[int, tuple[float, ...]]:
        """The most positions of one sequence that one call computes bitwise as one-position
        calls: after a history, 2, 3, ... positions in one call against the same positions
        one call each, up to the first count that differs. Every count is tried, since
        kernels take rows in blocks (ggml's repacked ARM kernels in fours, the rest one by
        one): 4 rows may differ where 5 do not.

        Also what those calls cost against one position's, for 1 to that many positions,
        for the operator (the status's `row_cost_k`), from the probe's own calls: one
        position as the fastest one-position call after the first (which pays for cold
        caches). Each count reads as the least of its own and every larger count's cost,
        so that one call slowed by a neighbour on the box does not make one count look
        dearer than the next."""
        most = min(MAX_DECODE_POSITIONS, self._batch.capacity)
        if most < 2:
            return 1, (1.0,)
        x = self._probe_input(most, seed=1)
        seq = SeqCache(0, 0, self.kv_per_position)
        history = self._probe_history([seq])
        axis = 0 if self.slice.has_head else 1

        def timed(count: int, start: int) -> tuple[np.ndarray | None, float]:
            began = time.perf_counter()
            out = self._call([x[:, start:start + count]], [seq], [start + history], [True],
                             every_row=count > 1)[0]
            return out, time.perf_counter() - began

        try:
            alone, single = zip(*(timed(1, i) for i in range(most)), strict=True)
            costs: list[float] = []
            for count in range(2, most + 1):
                self._back_to([seq], history)
                rows, took = timed(count, 0)
                expected = np.concatenate([a for a in alone[:count] if a is not None], axis)
                if rows is None or not np.array_equal(rows, expected):
                    break
                costs.append(took / min(single[1:]))
        finally:
            self._back_to([seq], 0)
        return 1 + len(costs), (1.0, *(max(1.0, min(costs[k:])) for k in range(len(costs))))

    def _probe_input(self, positions: int, *, seed: int) -> np.ndarray:
        """What the load-time probes feed: token ids on the first stage, else hidden states
        ([1, positions] or [1, positions, H]), random."""
        rng = np.random.default_rng(seed)
        if self.slice.has_embedding:
            return rng.integers(1, self.vocab, size=(1, positions), dtype=np.int64)
        return rng.standard_normal((1, positions, self.hidden)).astype(np.float32)

    def _probe_history(self, seqs: list[SeqCache]) -> int:
        """The same PROBE_HISTORY positions in every one of `seqs`: computed in the first,
        copied to the others; returns how many."""
        history = min(PROBE_HISTORY, self._batch.capacity)
        self._call([self._probe_input(history, seed=0)], seqs[:1], [0], [False])
        for seq in seqs[1:]:
            self._llama.llama_memory_seq_cp(self._memory, seqs[0].seq_id, seq.seq_id, -1, -1)
            seq.held = history
        return history

    def _back_to(self, seqs: list[SeqCache], positions: int) -> None:
        """Drop the probes' sequences' positions from `positions` on."""
        for seq in seqs:
            self._llama.llama_memory_seq_rm(self._memory, seq.seq_id, positions, -1)
            seq.cut(positions)

    # -- forward passes ------------------------------------------------------------

    def step(self, xs: list[torch.Tensor], caches: list[Any], starts: list[int],
             logits: list[bool] | None = None) -> list[torch.Tensor | None]:
        """`run` for callers that hold torch tensors (tests, the bench's tools)."""
        import torch

        outs = self.run([x.numpy() for x in xs], caches, starts, logits)
        return [None if out is None else torch.from_numpy(out) for out in outs]

    def run(self, xs: list[np.ndarray], caches: list[Any], starts: list[int],
            logits: list[bool] | None = None) -> list[np.ndarray | None]:
        seqs = [cache for cache in caches if isinstance(cache, SeqCache)]
        if len(seqs) != len(xs):
            raise EngineError("the llamacpp engine runs only caches it made (new_cache)")
        wanted = logits if logits is not None else [True] * len(xs)
        answer: list[np.ndarray | None] = [None] * len(xs)
        singles = [i for i, x in enumerate(xs) if x.shape[1] == 1]
        if self.exact_batch > 1 and len(singles) > 1:
            self._contiguous([seqs[i] for i in singles])
            singles.sort(key=lambda i: seqs[i].seq_id)
        calls = _even_chunks(singles, self.exact_batch)
        calls += [[i] for i, x in enumerate(xs) if x.shape[1] > 1]
        for rows in calls:
            outputs = self._call([xs[i] for i in rows], [seqs[i] for i in rows],
                                 [starts[i] for i in rows], [wanted[i] for i in rows])
            for i, out in zip(rows, outputs, strict=True):
                answer[i] = out
        return answer

    def verify(self, x: np.ndarray, cache: Any, start: int) -> np.ndarray:
        if x.shape[1] > self.exact_rows or not isinstance(cache, SeqCache):
            return super().verify(x, cache, start)
        out = self._call([x], [cache], [start], [True], every_row=True)[0]
        assert out is not None  # every row asked for
        return out

    def _call(self, xs: list[np.ndarray], seqs: list[SeqCache], starts: list[int],
              wanted: list[bool], *, every_row: bool = False) -> list[np.ndarray | None]:
        """One llama_decode of these rows, in this order. The last stage returns the logits
        of each sequence's last position, or with `every_row` of all its positions."""
        lowlevel, batch = self._llama, self._batch
        lengths = [x.shape[1] for x in xs]
        total = sum(lengths)
        if total > batch.capacity:
            raise EngineError(f"{total} positions in one call, more than the context's "
                              f"batch of {batch.capacity}")
        for seq, start in zip(seqs, starts, strict=True):
            if start != seq.held:
                raise EngineError(f"sequence {seq.seq_id} holds {seq.held} positions, "
                                  f"asked to go on at {start}")
        last_rows = np.cumsum(lengths) - 1
        batch.fill(starts, lengths, [s.seq_id for s in seqs])
        if self.slice.has_embedding:
            batch.tokens(np.concatenate([x[0] for x in xs]))
        else:
            self._hidden_in[:total] = np.concatenate([x[0] for x in xs])
            batch.embeddings(self._hidden_in)
        firsts = last_rows + 1 - np.array(lengths) if every_row else last_rows
        if self.slice.has_head:
            batch.outputs_at(total, [row for a, b, w in zip(firsts, last_rows, wanted, strict=True)
                                     if w for row in range(int(a), int(b) + 1)])
        else:
            batch.outputs_at(total, range(total))  # the capture needs every row
            assert self._capture is not None
            self._capture.off_bytes = 0
        status = lowlevel.llama_decode(self._context, batch.batch)
        if status != 0:
            # The sequences' KV may now hold part of this call: the stage drops them.
            raise EngineError(f"llama_decode returned {status}")
        for seq, length in zip(seqs, lengths, strict=True):
            seq.advance(length)
            seq.touched = time.monotonic()
        if not self.slice.has_head:
            assert self._capture is not None
            if self._capture.off_bytes != total * self.hidden * 4:
                raise EngineError(f"captured {self._capture.off_bytes} bytes of hidden states, "
                                  f"expected {total * self.hidden * 4}")
            hidden = self._hidden_out[:total].copy()
            bounds = np.concatenate([[0], last_rows + 1])
            return [hidden[None, a:b] for a, b in itertools.pairwise(bounds)]
        out: list[np.ndarray | None] = []
        for first, last, want in zip(firsts, last_rows, wanted, strict=True):
            if not want:
                out.append(None)
                continue
            out.append(np.stack([np.ctypeslib.as_array(
                lowlevel.llama_get_logits_ith(self._context, row), shape=(self.vocab,))
                for row in range(int(first), int(last) + 1)]))
        return out

    def close(self) -> None:
        if self._context:
            self._llama.llama_free(self._context)
            self._context = None
        if self._model:
            self._llama.llama_model_free(self._model)
            self._model = None


def _even_chunks(items: list[int], most: int) -> list[list[int]]:
    """`items` in order, in as few runs of at most `most` as there can be, of even sizes: 8
    rows where 7 stay exact go as 4 and 4, each run a call that reads every weight."""
    parts = -(-len(items) // most)
    if not parts:
        return []
    bounds = [len(items) * i // parts for i in range(parts + 1)]
    return [items[a:b] for a, b in itertools.pairwise(bounds)]


class _Batch:
    """A llama_batch over numpy arrays this object owns, reused for every call."""

    def __init__(self, lowlevel: ModuleType, capacity: int) -> None:
        self.capacity = capacity
        self._tokens = np.zeros(capacity, dtype=np.int32)
        self._positions = np.zeros(capacity, dtype=np.int32)
        self._seq_counts = np.ones(capacity, dtype=np.int32)
        self._seq_ids = np.zeros(capacity, dtype=np.int32)
        self._outputs = np.zeros(capacity, dtype=np.int8)
        int32_p = ctypes.POINTER(ctypes.c_int32)
        self._seq_id_rows = (int32_p * capacity)(*[
            ctypes.cast(self._seq_ids.ctypes.data + 4 * i, int32_p) for i in range(capacity)])
        batch = self.batch = lowlevel.llama_batch()
        batch.pos = self._positions.ctypes.data_as(int32_p)
        batch.n_seq_id = self._seq_counts.ctypes.data_as(int32_p)
        batch.seq_id = ctypes.cast(self._seq_id_rows, ctypes.POINTER(int32_p))
        batch.logits = self._outputs.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def fill(self, starts: list[int], lengths: list[int], seq_ids: list[int]) -> None:
        at = 0
        for start, length, seq_id in zip(starts, lengths, seq_ids, strict=True):
            self._positions[at:at + length] = np.arange(start, start + length)
            self._seq_ids[at:at + length] = seq_id
            at += length
        self.batch.n_tokens = at

    def tokens(self, ids: npt.NDArray[np.int64]) -> None:
        self._tokens[:len(ids)] = ids
        self.batch.token = self._tokens.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        self.batch.embd = None

    def embeddings(self, rows: npt.NDArray[np.float32]) -> None:
        self.batch.token = None
        self.batch.embd = rows.ctypes.data_as(ctypes.POINTER(ctypes.c_float))

    def outputs_at(self, total: int, rows: Sequence[int] | range) -> None:
        self._outputs[:total] = 0
        self._outputs[list(rows)] = 1
