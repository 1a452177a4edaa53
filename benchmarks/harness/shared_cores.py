"""What sharing one box's cores costs a plant: its llama.cpp stages chained by OS pipes.

The bench runs every agent of a 3-stage plant on one box and holds the plant to
llama.cpp in one process on the same cores. Two things separate them:
- what edgebus adds: frames, the broker, the agents, the coordinator;
- that three processes take turns on shared cores. Each wakes on a core
  another stage has just left, with its caches cold; under load, three of them
  contend for two cores. On a plant, every stage has a box of its own.

This phase measures the second alone. It runs the plant's stages as bare processes:
the llamacpp engine on each stage's own stage GGUF, with a stage's threads, chained by
pipes. There is no broker, no agent and no frame; a driver (this process) stands where
the coordinator stands, so a token makes the plant's 4 hops. Beside it, in the same
phase, it runs the whole model in one process, measured the same way:
- chain / whole: the most any transport reaches on this box, the *floor*;
- pipeline / chain: what edgebus's transport costs on top of it.

The whole model is a chain too, of one process. It feeds its own tokens back for as
many steps as it is asked, as llama.cpp in one process does: no pipe sits between its
steps. Both stay loaded, and the phase alternates between them in blocks of BLOCK_STEPS steps: on
this box one process's step time drifts by 10-25 % from minute to minute (SmolLM2,
1 thread: 14.1 to 18.6 ms), more than the difference measured. Both decode greedily
from the same prompt; the chain's tokens must equal the whole model's (`Floor.exact`),
or it is not the same computation.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import statistics
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from edgebus.core.errors import EdgebusError
from node_agent.engines import ContextShape, load_engine
from node_agent.model_config import kv_bytes_per_token, load_config

# The prompt each row starts from: 32 positions, as stage_steps.py times its steps after.
PROMPT = list(range(100, 132))
# Decode steps timed single stream, after WARMUP_STEPS untimed ones (a context's first
# calls grow its buffers): enough for a median that one preempted step does not move.
SINGLE_STEPS = 64
WARMUP_STEPS = 4
# Decode steps each group takes under load, after WARMUP_STEPS; the rate is their rows
# over the time they took, prompts excluded.
LOAD_STEPS = 32
# Steps one side takes before the other takes its turn: long enough that each runs warm,
# short enough that both see the same minutes of the machine.
BLOCK_STEPS = 16
# A call carries at most a prompt or a group's rows.
BATCH_POSITIONS = 64
# A pipe message's header: group, start position, positions per row, rows, and the steps a
# process holding the whole model runs on its own tokens (1 for a stage).
_HEADER = np.dtype([("group", "<i4"), ("start", "<i4"), ("positions", "<i4"), ("rows", "<i4"),
                    ("repeat", "<i4")])
_STOP = b"stop"
# How often a wait for a stage checks that every stage is still alive.
POLL_S = 1.0
# How long stages get to close their contexts once told to stop.
STOP_S = 30.0


@dataclass(frozen=True)
class Floor:
    """One model's floor on this box, ms a token single stream and tok/s under load."""

    model: str
    layers: list[tuple[int, int]]
    stage_threads: int
    whole_ms: float        # the whole model, one process, stage_threads threads
    chain_ms: float        # the stages chained by pipes, stage_threads each
    exact: bool            # the chain's greedy tokens equal the whole model's
    load_rows: int = 0     # 0: not measured under load
    load_groups: int = 0   # the chain's groups of load_rows / load_groups rows
    whole_threads: int = 0
    whole_tok_s: float | None = None   # load_rows rows a step, whole_threads threads
    chain_tok_s: float | None = None

    @property
    def single_ratio(self) -> float:
        """The chain's single-stream speed as a fraction of the whole model's."""
        return self.whole_ms / self.chain_ms

    @property
    def load_ratio(self) -> float | None:
        if self.whole_tok_s is None or self.chain_tok_s is None:
            return None
        return self.chain_tok_s / self.whole_tok_s


def measure(model: Path, name: str, layers: list[tuple[int, int]], *, stage_threads: int,
            load_rows: int = 0, load_groups: int = 1, whole_threads: int = 1) -> Floor:
    """The floor of `layers` of `model` (a GGUF, or a directory holding one).

    Single stream at `stage_threads` a process; with `load_rows`, also that many rows a
    step: the whole model at `whole_threads`, the chain in `load_groups` groups in flight,
    as the coordinator groups requests (node_agent/groups.py).
    """
    whole_range = [(0, layers[-1][1])]
    steps = SINGLE_STEPS + WARMUP_STEPS
    with _Chain(model, whole_range, stage_threads, rows=1, groups=1, steps=steps) as whole, \
            _Chain(model, layers, stage_threads, rows=1, groups=1, steps=steps) as chain:
        _alternate(whole, chain, steps)
        floor = Floor(model=name, layers=layers, stage_threads=stage_threads,
                      whole_ms=whole.ms_per_step(), chain_ms=chain.ms_per_step(),
                      exact=whole.first_row == chain.first_row)
    if not load_rows:
        return floor
    steps = LOAD_STEPS + WARMUP_STEPS
    with _Chain(model, whole_range, whole_threads, rows=load_rows, groups=1,
                steps=steps) as whole, \
            _Chain(model, layers, stage_threads, rows=load_rows, groups=load_groups,
                   steps=steps) as chain:
        _alternate(whole, chain, steps)
        return dataclasses.replace(floor, load_rows=load_rows, load_groups=load_groups,
                                   whole_threads=whole_threads, whole_tok_s=whole.tok_s(),
                                   chain_tok_s=chain.tok_s())


def _alternate(first: _Chain, second: _Chain, steps: int) -> None:
    first.prefill()
    second.prefill()
    while first.steps_done < steps or second.steps_done < steps:
        for chain in (first, second):
            chain.decode(min(BLOCK_STEPS, steps - chain.steps_done))


class _Chain:
    """`layers` as processes chained by pipes, holding `groups` groups of rows, driven by
    this process: it sends each group's next tokens and reads back the next ones."""

    def __init__(self, model: Path, layers: list[tuple[int, int]], threads: int, *,
                 rows: int, groups: int, steps: int) -> None:
        context = multiprocessing.get_context("spawn")  # no fork of a process using OpenMP
        pipes = [context.Pipe(duplex=False) for _ in range(len(layers) + 1)]
        self.per_group, self.groups = rows // groups, groups
        self._inside = len(layers) == 1  # the whole model: it loops on its own tokens
        self.processes = [context.Process(target=_stage, args=(
            model, first, end, threads, self.per_group * groups, steps, pipes[i][0],
            pipes[i + 1][1])) for i, (first, end) in enumerate(layers)]
        self._send, self._receive = pipes[0][1], pipes[-1][0]
        self.first_row: list[int] = []  # group 0's first row's tokens
        self.steps_done = 0
        self._tokens: dict[int, np.ndarray] = {}
        self._times: list[float] = []  # seconds per round of every group, after the warm-up
        for process in self.processes:
            process.start()

    def __enter__(self) -> _Chain:
        return self

    def __exit__(self, *exc: object) -> None:
        if all(process.is_alive() for process in self.processes):
            self._send.send_bytes(_STOP)
        for process in self.processes:
            process.join(timeout=STOP_S)
            if process.is_alive():
                process.kill()

    def prefill(self) -> None:
        for group in range(self.groups):
            self._send.send_bytes(_message(group, 0, np.array([PROMPT] * self.per_group)))
        for _ in range(self.groups):
            group, ids = self._next()
            self._tokens[group] = ids
        self.first_row.append(int(self._tokens[0][0]))

    def decode(self, steps: int) -> None:
        """`steps` rounds: every group one step further, all groups in flight at once."""
        done = dict.fromkeys(range(self.groups), 0)
        began = time.perf_counter()
        repeat = steps if self._inside else 1
        for group, ids in self._tokens.items():
            self._send.send_bytes(_message(group, self._position(), ids[:, None], repeat))
        while min(done.values()) < steps:
            group, ids = self._next()
            self._tokens[group] = ids
            done[group] += 1
            if group == 0:
                self.first_row.append(int(ids[0]))
                now = time.perf_counter()
                if self.steps_done + done[0] > WARMUP_STEPS:
                    self._times.append(now - began)
                began = now
            if done[group] < steps and not self._inside:
                self._send.send_bytes(_message(group, self._position() + done[group], ids[:, None]))
        self.steps_done += steps

    def ms_per_step(self) -> float:
        return statistics.median(self._times) * 1e3

    def tok_s(self) -> float:
        return self.per_group * self.groups * len(self._times) / sum(self._times)

    def _position(self) -> int:
        return len(PROMPT) + self.steps_done

    def _next(self) -> tuple[int, np.ndarray]:
        """The next group's tokens, or an error once a stage has died."""
        while not self._receive.poll(POLL_S):
            dead = [p for p in self.processes if not p.is_alive()]
            if dead:
                raise EdgebusError(f"a llama.cpp process of the shared-cores phase exited "
                                   f"with code {dead[0].exitcode}: its traceback is above")
        message = self._receive.recv_bytes()
        head = np.frombuffer(message, dtype=_HEADER, count=1)[0]
        return int(head["group"]), np.frombuffer(message[_HEADER.itemsize:], dtype=np.int64)


def _stage(model: Path, first: int, end: int, threads: int, rows: int, steps: int,
           receive: Connection, send: Connection) -> None:
    """One process of a chain: layers [first, end), `rows` sequences, until told to stop."""
    engine = load_engine(model, first, end, weights="gguf", threads=threads,
                         shape=_shape(model, end - first, rows, steps))
    hidden = int(load_config(model).hidden_size)
    caches: dict[int, list[object]] = {}
    while (message := receive.recv_bytes()) != _STOP:
        head = np.frombuffer(message, dtype=_HEADER, count=1).copy()[0]
        group, start = int(head["group"]), int(head["start"])
        count, positions = int(head["rows"]), int(head["positions"])
        repeat = int(head["repeat"])
        body = message[_HEADER.itemsize:]
        if first == 0:
            xs = list(np.frombuffer(body, dtype=np.int64).reshape(count, 1, positions))
        else:
            xs = list(np.frombuffer(body, dtype=np.float32).reshape(
                count, 1, positions, hidden))
        if group not in caches:
            caches[group] = [engine.new_cache(0) for _ in range(count)]
        for step in range(repeat):
            outs = engine.run(xs, caches[group], [start + step] * count)
            if engine.slice.has_head:
                out = np.array([_argmax(o) for o in outs], dtype=np.int64)
                xs = list(out.reshape(count, 1, 1))
            else:
                out = np.stack([o for o in outs if o is not None])  # [rows, 1, positions, H]
            head["start"] = start + step
            send.send_bytes(head.tobytes() + np.ascontiguousarray(out).tobytes())
    send.send_bytes(_STOP)
    engine.close()


def _shape(model: Path, num_layers: int, sequences: int, steps: int) -> ContextShape:
    positions = len(PROMPT) + steps + 1
    per_position = kv_bytes_per_token(load_config(model), (0, num_layers), 2)
    padded = ContextShape(kv_budget_bytes=0, positions=positions,
                          batch_positions=BATCH_POSITIONS).sequence_positions
    return ContextShape(kv_budget_bytes=sequences * padded * per_position, positions=positions,
                        batch_positions=max(BATCH_POSITIONS, sequences))


def _message(group: int, start: int, ids: np.ndarray, repeat: int = 1) -> bytes:
    """Token ids [rows, positions] of one group, as the first stage reads them."""
    head = np.array([(group, start, ids.shape[1], ids.shape[0], repeat)], dtype=_HEADER)
    return head.tobytes() + np.ascontiguousarray(ids, dtype=np.int64).tobytes()


def _argmax(logits: np.ndarray | None) -> int:
    assert logits is not None
    return int(logits[-1].argmax())
