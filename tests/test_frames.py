"""The activation frame codec: exact round trips, and clear refusals of anything else."""

from __future__ import annotations

import contextlib
import struct
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgebus import frames
from edgebus.errors import FrameError
from edgebus.frames import HEADER_SIZE, Header, Kind


def _hidden(shape: tuple[int, ...], dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
def test_hidden_round_trip_is_bit_exact(dtype: torch.dtype) -> None:
    h = _hidden((1, 7, 64), dtype)
    frame = frames.decode(frames.encode(Kind.HIDDEN, h, Header(2**63 - 1, 3, 9), start=41,
                                        candidates=5))
    assert frame.kind == Kind.HIDDEN
    assert (frame.request, frame.epoch, frame.step, frame.start, frame.count) == (
        2**63 - 1, 3, 9, 41, 7)
    assert frame.candidates == 5
    assert frame.tensor().dtype == dtype
    assert torch.equal(frame.tensor(), h)


def test_tokens_travel_as_int32() -> None:
    ids = torch.tensor([[1, 49151, 7]])
    frame = frames.decode(frames.encode(Kind.TOKENS, ids, Header(1, 0, 0), start=0))
    assert frame.tensor().dtype == torch.int32
    assert frame.tensor().tolist() == ids.tolist()


def test_incompressible_payload_is_sent_raw() -> None:
    h = _hidden((1, 64, 64))  # random fp16: LZ4 cannot shrink it
    data = frames.encode(Kind.HIDDEN, h, Header(1, 0, 0), start=0)
    frame = frames.decode(data)
    assert not frame.compressed
    assert len(data) == HEADER_SIZE + h.nelement() * 2


def test_compressible_payload_is_compressed() -> None:
    h = torch.zeros(1, 64, 64, dtype=torch.float16)
    data = frames.encode(Kind.HIDDEN, h, Header(1, 0, 0), start=0)
    frame = frames.decode(data)
    assert frame.compressed
    assert len(data) < h.nelement() * 2 / 4
    assert torch.equal(frame.tensor(), h)


def test_candidates_round_trip() -> None:
    ids = torch.tensor([[9, 4, 1]])
    logits = torch.tensor([[3.5, 2.25, -1.0]])
    got_ids, got_logits = frames.decode(frames.encode_candidates(
        ids, logits, Header(5, 0, 2), start=10)).candidates_arrays()
    assert got_ids.tolist() == [[9, 4, 1]]
    assert got_logits.tolist() == [[3.5, 2.25, -1.0]]


def test_route_and_prefill_flag_travel_with_the_frame() -> None:
    h = _hidden((1, 3, 8))
    data = frames.encode(Kind.HIDDEN, h, Header(7, 2, 4, (0, 3, 1)), start=5, prefill=True)
    frame = frames.decode(data)
    assert (frame.route, frame.prefill, frame.epoch) == ((0, 3, 1), True, 2)
    assert torch.equal(frame.tensor(), h)
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
       st.integers(1, 17), st.sampled_from([torch.float16, torch.float32]))
def test_round_trip_property(request: int, epoch: int, count: int, hidden: int,
                             dtype: torch.dtype) -> None:
    h = torch.randn(1, count, hidden).to(dtype)
    frame = frames.decode(frames.encode(Kind.HIDDEN, h, Header(request, epoch, 1), start=count))
    assert (frame.request, frame.epoch) == (request, epoch)
    assert torch.equal(frame.tensor(), h)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.tuples(st.integers(0, HEADER_SIZE + 63), st.integers(0, 255)),
                min_size=1, max_size=6), st.booleans())
def test_mutated_frames_raise_only_frame_error(edits: list[tuple[int, int]],
                                               fix_crc: bool) -> None:
    # Garbage that passes the magic and (with fix_crc) the checksum reaches the
    # shape, dtype and LZ4 checks, which random bytes alone almost never do.
    data = bytearray(frames.encode(Kind.HIDDEN, torch.zeros(1, 64, 64, dtype=torch.float16),
                                   Header(1, 0, 0), start=0))
    for pos, value in edits:
        data[pos % len(data)] = value
    try:
        frame = frames.decode(_with_crc(data) if fix_crc else bytes(data))
        if frame.dtype != frames.DType.CANDIDATES:
            frame.tensor()
    except FrameError:
        pass
