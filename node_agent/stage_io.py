"""What a stage takes in and sends out: a frame's tensor checked as its engine's input, and
the engine's output framed for the next stage or, from the last, for the coordinator.

Three kinds of frame carry positions: a prompt chunk (`prefill`, up to `prefill_chunk`
positions), a decode step of one position, and a decode frame of several: a request's token
and the drafts behind it (`Frame.verifies`, up to MAX_DECODE_POSITIONS), for which the last
stage returns candidates at every position (node_agent/speculation.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from edgebus.core import frames
from edgebus.core.errors import FrameError
from edgebus.core.frames import Frame, Header, Kind
from node_agent.engines import StageEngine
from node_agent.sampling import top_candidates

WIRE_DTYPES: dict[str, np.dtype[Any]] = {"float16": np.dtype(np.float16),
                                          "float32": np.dtype(np.float32)}


def check_input(frame: Frame, model: StageEngine, stage: int, prefill_chunk: int
                ) -> np.ndarray:
    """The frame's tensor, or FrameError if it cannot be stage `stage`'s input."""
    first = model.slice.has_embedding
    expected = Kind.TOKENS if first else Kind.HIDDEN
    if frame.kind != expected:
        raise FrameError(f"stage {stage} takes {expected.name} frames, got {frame.kind.name}")
    most = prefill_chunk if frame.prefill else frames.MAX_DECODE_POSITIONS
    if not 1 <= frame.count <= most:
        raise FrameError(f"{'prefill' if frame.prefill else 'decode'} frame carries "
                         f"{frame.count} positions, more than {most}: run the same plant file "
                         "and edgebus version on every box")
    if frame.candidates > model.config.vocab_size or (
            not frame.prefill and frame.candidates == 0):
        raise FrameError(f"asks for {frame.candidates} candidates")
    x = frame.array()
    if first:
        if x.shape != (1, frame.count):
            raise FrameError(f"token frame of shape {tuple(x.shape)}, expected "
                             f"(1, {frame.count})")
        if int(x.min()) < 0 or int(x.max()) >= model.config.vocab_size:
            raise FrameError("token id outside the vocabulary")
        return x.astype(np.int64)
    if x.shape != (1, frame.count, model.config.hidden_size):
        raise FrameError(f"hidden-state frame of shape {tuple(x.shape)}, expected "
                         f"(1, {frame.count}, {model.config.hidden_size})")
    if not np.isfinite(x).all():
        raise FrameError("hidden states hold NaN or Inf")
    return x


def encode_output(frame: Frame, out: np.ndarray | None, model: StageEngine,
                  wire_dtype: np.dtype[Any]) -> bytes:
    """out: [1, T, H] hidden states, [rows, V] logits (the last position's, or every
    position's of a decode frame of several), or None: a prompt chunk before the last on the
    last stage, which sends nothing."""
    header = Header.of(frame)
    if out is None:
        return b""
    if not model.slice.has_head:
        return frames.encode(Kind.HIDDEN, out.astype(wire_dtype, copy=False), header,
                             start=frame.start, candidates=frame.candidates,
                             prefill=frame.prefill, rollback=frame.rollback)
    ids, logits = top_candidates(out, frame.candidates)
    return frames.encode_candidates(ids, logits, header, start=frame.start)
