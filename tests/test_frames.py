"""The activation frame codec: exact round trips, and clear refusals of anything else."""

from __future__ import annotations

import contextlib
import struct
import tracemalloc
import zlib
from types import ModuleType
from typing import Any

import numpy as np
import optional
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgebus.core import frames
from edgebus.core.errors import FrameError
from edgebus.core.frames import HEADER_SIZE, Header, Kind

# The codec frames numpy arrays (what a llama.cpp box's agents hold) and torch tensors
# (the torch engine's): the tests use numpy, and torch only where the claim is about torch.
DTYPES = ["float16", "float32", "bfloat16"]


def _hidden(shape: tuple[int, ...], dtype: str = "float16") -> np.ndarray:
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


@pytest.fixture
def torch() -> ModuleType:
    optional.require_torch()
    import torch

    return torch


def _hidden_tensor(torch: ModuleType, shape: tuple[int, ...], dtype: str) -> Any:
    return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(
        getattr(torch, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_hidden_round_trip_is_bit_exact(torch: ModuleType, dtype: str) -> None:
    h = _hidden_tensor(torch, (1, 7, 64), dtype)
    frame = frames.decode(frames.encode(Kind.HIDDEN, h, Header(2**63 - 1, 3, 9), start=41,
                                        candidates=5))
    assert frame.kind == Kind.HIDDEN
    assert (frame.request, frame.epoch, frame.step, frame.start, frame.count) == (
        2**63 - 1, 3, 9, 41, 7)
    assert frame.candidates == 5
    assert frame.tensor().dtype == getattr(torch, dtype)
    assert torch.equal(frame.tensor(), h)


@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_and_torch_frame_alike(torch: ModuleType, dtype: str) -> None:
    """The stage agent frames numpy arrays (a llama.cpp box has no torch): the same bytes
    as the torch tensor, and `array()` gives back its values (bfloat16 widened to float32)."""
    h = _hidden_tensor(torch, (1, 7, 64), dtype)
    header = Header(3, 1, 2)
    from_torch = frames.encode(Kind.HIDDEN, h, header, start=4)
    if dtype != "bfloat16":  # numpy has no bfloat16
        assert frames.encode(Kind.HIDDEN, h.numpy(), header, start=4) == from_torch
    array = frames.decode(from_torch).array()
    assert array.flags.writeable
    assert np.array_equal(array, h.to(torch.float32).numpy())


def test_numpy_token_ids_travel_as_int32() -> None:
    frame = frames.decode(frames.encode(Kind.TOKENS, np.array([[1, 49151, 7]]), Header(1, 0, 0),
                                        start=0))
    assert frame.array().dtype == np.int32
    assert frame.array().tolist() == [[1, 49151, 7]]


def test_other_dtypes_are_refused() -> None:
    with pytest.raises(FrameError, match="float64 cannot be framed"):
        frames.encode(Kind.HIDDEN, np.zeros((1, 1, 8)), Header(1, 0, 0), start=0)


def test_tokens_travel_as_int32(torch: ModuleType) -> None:
    ids = torch.tensor([[1, 49151, 7]])
    frame = frames.decode(frames.encode(Kind.TOKENS, ids, Header(1, 0, 0), start=0))
    assert frame.tensor().dtype == torch.int32
    assert frame.tensor().tolist() == ids.tolist()


def test_incompressible_payload_is_sent_raw() -> None:
    h = _hidden((1, 64, 64))  # random fp16: LZ4 cannot shrink it
    data = frames.encode(Kind.HIDDEN, h, Header(1, 0, 0), start=0)
    frame = frames.decode(data)
    assert not frame.compressed
    assert len(data) == HEADER_SIZE + h.size * 2


def test_compressible_payload_is_compressed() -> None:
    h = np.zeros((1, 64, 64), dtype=np.float16)
    data = frames.encode(Kind.HIDDEN, h, Header(1, 0, 0), start=0)
    frame = frames.decode(data)
    assert frame.compressed
    assert len(data) < h.size * 2 / 4
    assert np.array_equal(frame.array(), h)


def test_candidates_round_trip() -> None:
    ids = np.array([[9, 4, 1]])
    logits = np.array([[3.5, 2.25, -1.0]], dtype=np.float32)
    got_ids, got_logits = frames.decode(frames.encode_candidates(
        ids, logits, Header(5, 0, 2), start=10)).candidates_arrays()
    assert got_ids.tolist() == [[9, 4, 1]]
    assert got_logits.tolist() == [[3.5, 2.25, -1.0]]


def test_route_and_prefill_flag_travel_with_the_frame() -> None:
    h = _hidden((1, 3, 8))
    data = frames.encode(Kind.HIDDEN, h, Header(7, 2, 4, (0, 3, 1)), start=5, prefill=True)
    frame = frames.decode(data)
    assert (frame.route, frame.prefill, frame.epoch) == ((0, 3, 1), True, 2)
    assert np.array_equal(frame.array(), h)
    assert not frames.decode(frames.encode(Kind.HIDDEN, h, Header(7, 2, 4), start=5)).prefill
    # The route is covered by the checksum: a flipped replica index is caught.
    corrupt = bytearray(data)
    corrupt[HEADER_SIZE + 1] ^= 1
    with pytest.raises(FrameError, match="checksum"):
        frames.decode(bytes(corrupt))


def test_error_and_release_frames_name_their_route() -> None:
    header = Header(9, 1, 3, (1, 0))
    error = frames.decode(frames.encode_error(header, "KV budget full: ünïcode"))
    assert (error.kind, error.text(), frames.Header.of(error)) == (
        Kind.ERROR, "KV budget full: ünïcode", header)
    release = frames.decode(frames.encode_release(header))
    assert (release.kind, frames.Header.of(release)) == (Kind.RELEASE, header)


def test_a_route_that_does_not_fit_a_frame_is_refused() -> None:
    with pytest.raises(FrameError, match="route"):
        frames.encode_release(Header(1, 0, 0, (256,)))


def _valid() -> bytes:
    return frames.encode(Kind.HIDDEN, _hidden((1, 2, 8)), Header(1, 0, 0), start=0)


def _with_crc(data: bytearray) -> bytes:
    crc = zlib.crc32(bytes(data[HEADER_SIZE:]), zlib.crc32(bytes(data[:HEADER_SIZE - 4])))
    data[HEADER_SIZE - 4:HEADER_SIZE] = crc.to_bytes(4, "little")
    return bytes(data)


@pytest.mark.parametrize(("mangle", "message"), [
    (lambda d: d[:20], "shorter than"),
    (lambda d: d[:-3], "truncated"),
    (lambda d: b"XXXX" + d[4:], "bad magic"),
    (lambda d: _with_crc(bytearray(d[:4] + bytes([99]) + d[5:])), "version 99"),
    (lambda d: d[:-1] + bytes([d[-1] ^ 0xFF]), "checksum"),
    (lambda d: _with_crc(bytearray(d[:36] + struct.pack("<I", 1000) + d[40:])), "needs"),
])
def test_bad_frames_are_refused_with_a_reason(mangle: object, message: str) -> None:
    with pytest.raises(FrameError, match=message):
        frames.decode(mangle(_valid()))  # type: ignore[operator]


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_decoding_garbage_raises_only_frame_error(data: bytes) -> None:
    with contextlib.suppress(FrameError):
        frames.decode(data)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**64 - 1), st.integers(0, 2**32 - 1), st.integers(1, 5),
       st.integers(1, 17), st.sampled_from(["float16", "float32"]), st.integers(0, 2**32 - 1))
def test_round_trip_property(request: int, epoch: int, count: int, hidden: int,
                             dtype: str, seed: int) -> None:
    h = np.random.default_rng(seed).standard_normal((1, count, hidden)).astype(dtype)
    frame = frames.decode(frames.encode(Kind.HIDDEN, h, Header(request, epoch, 1), start=count))
    assert (frame.request, frame.epoch) == (request, epoch)
    assert np.array_equal(frame.array(), h)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.integers(0, HEADER_SIZE + 63), st.integers(0, 255)),
                min_size=1, max_size=6), st.booleans())
def test_mutated_frames_raise_only_frame_error(edits: list[tuple[int, int]],
                                               fix_crc: bool) -> None:
    # Garbage that passes the magic and (with fix_crc) the checksum reaches the
    # shape, dtype and LZ4 checks, which random bytes alone almost never do.
    data = bytearray(frames.encode(Kind.HIDDEN, np.zeros((1, 64, 64), dtype=np.float16),
                                   Header(1, 0, 0), start=0))
    for pos, value in edits:
        data[pos % len(data)] = value
    try:
        frame = frames.decode(_with_crc(data) if fix_crc else bytes(data))
        if frame.dtype != frames.DType.CANDIDATES:
            frame.array()
    except FrameError:
        pass


# -- limits: nothing is allocated for a frame past them ----------------------------

# SmolLM2's width: a plant whose largest legal frame is 128 x 576 float32.
LIMITS = frames.stage_limits(prefill_chunk=128, hidden=576, max_in_flight=64, stages=2)


def lz4_bomb(frames_in_message: int = 8, shape: tuple[int, int, int] = (1, 32768, 1024),
             ) -> bytes:
    """The issue's bomb: frames of zeros that LZ4 squeezes ~255:1, each claiming 128 MiB."""
    zeros = np.zeros(shape, dtype=np.float32)
    return b"".join(frames.encode(Kind.HIDDEN, zeros, Header(0xB0B0 + i, 1, 0, (0, 0)),
                                  start=0, prefill=True) for i in range(frames_in_message))


def test_the_lz4_bomb_is_refused_from_its_headers_before_anything_is_decompressed() -> None:
    bomb = lz4_bomb()
    assert len(bomb) < 5 * 2**20  # 4 MiB on the wire for 1 GiB decompressed
    tracemalloc.start()
    try:
        with pytest.raises(frames.BatchError, match="exceeds the largest legal frame") as caught:
            frames.decode_all(bomb, LIMITS)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"{peak} bytes allocated for a message refused from its headers"
    assert caught.value.good == []
    assert [h.request for h in caught.value.suspects] == [0xB0B0]  # whom to tell


def test_a_frame_of_the_largest_legal_size_passes_and_one_position_more_does_not() -> None:
    legal = _hidden((1, 128, 576), "float32")
    assert frames.decode_all(frames.encode(Kind.HIDDEN, legal, Header(1, 0, 0), start=0),
                             LIMITS)[0].shape == (1, 128, 576)
    with pytest.raises(frames.BatchError, match="exceeds the largest legal frame"):
        frames.decode_all(frames.encode(Kind.HIDDEN, _hidden((1, 129, 576), "float32"),
                                        Header(1, 0, 0), start=0), LIMITS)


def test_a_message_of_more_frames_than_a_legal_one_is_refused_whole() -> None:
    one = frames.encode(Kind.TOKENS, np.array([[7]]), Header(3, 0, 1), start=4)
    assert len(frames.decode_all(one * LIMITS.max_frames, LIMITS)) == LIMITS.max_frames
    with pytest.raises(frames.BatchError, match=f"more than {LIMITS.max_frames} frames") as caught:
        frames.decode_all(one * (LIMITS.max_frames + 1), LIMITS)
    assert caught.value.good == [] and len(caught.value.suspects) == LIMITS.max_frames


def test_a_message_larger_than_the_largest_legal_one_is_refused_unread() -> None:
    with pytest.raises(frames.BatchError, match="larger than the largest legal one"):
        frames.scan(bytes(LIMITS.max_message + 1), LIMITS)


def test_scan_reads_headers_only_and_names_the_frames_before_a_bad_one() -> None:
    good = frames.encode(Kind.TOKENS, np.array([[1, 2]]), Header(5, 2, 0, (0, 1)), start=0,
                         prefill=True)
    with pytest.raises(frames.BadTail, match="bad magic") as caught:
        frames.scan(good + b"XXXX" + bytes(60), LIMITS)
    assert [(p.request, p.epoch, p.route, p.count) for p in caught.value.peeks] == [
        (5, 2, (0, 1), 2)]
    # A corrupt payload after good frames: those before it are kept, it and the rest named.
    bad = bytearray(good)
    bad[-1] ^= 0xFF
    with pytest.raises(frames.BatchError, match="checksum") as batch:
        frames.decode_all(good + bytes(bad) + good, LIMITS)
    assert len(batch.value.good) == 1 and len(batch.value.suspects) == 2


def test_error_frames_say_whether_a_replay_recovers_the_request() -> None:
    header = Header(9, 1, 3, (1, 0))
    plain = frames.decode(frames.encode_error(header, "KV budget full"))
    lost = frames.decode(frames.encode_error(header, "a frame was lost", retry=True))
    busy = frames.decode(frames.encode_error(header, "inbox full", busy=True))
    assert [(f.retry, f.busy) for f in (plain, lost, busy)] == [
        (False, False), (True, False), (True, True)]
    # Only ERROR frames carry the meaning: the bits are ignored on any other kind.
    assert not frames.decode(frames.encode_release(header)).retry


def test_an_error_reason_is_cut_to_its_limit_at_a_character_boundary() -> None:
    frame = frames.decode(frames.encode_error(Header(1, 0, 0), "é" * frames.MAX_ERROR_BYTES))
    assert len(frame.payload) <= frames.MAX_ERROR_BYTES
    assert frame.text() == "é" * (frames.MAX_ERROR_BYTES // 2)


def test_coordinator_limits_fit_a_whole_vocabulary_of_candidates() -> None:
    limits = frames.coordinator_limits(vocab=49152, max_in_flight=64, stages=2)
    ids = np.arange(49152).reshape(1, -1)
    data = frames.encode_candidates(ids, np.zeros((1, 49152)), Header(1, 0, 0), start=3)
    assert frames.decode_all(data, limits)[0].candidates_arrays()[0].shape == (1, 49152)
