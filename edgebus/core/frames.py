"""The binary activation frame: what travels between stages.

    offset size  field
    0      4     magic  b"EBF\\x00"
    4      1     version (2)
    5      1     kind    TOKENS | HIDDEN | CANDIDATES | RELEASE | ERROR
    6      1     dtype   code of the payload's element type
    7      1     flags   bit 0: payload is LZ4-compressed; bit 1: prefill (prompt or
                 replay positions, any count) rather than one decode step; bit 2
                 (ERROR only): a replay can recover the request; bit 3 (ERROR
                 only): ... once the stage has room again (it refused the frame);
                 bit 4 (TOKENS, HIDDEN): rollback, the positions from `start` on
                 that a stage holds were drafts the coordinator rejected: drop
                 them, then compute this one (node_agent/speculation.py)
    8      8     request sequence id (u64, assigned by the coordinator)
    16     4     route epoch (u32): frames of an abandoned route are recognisable
    20     4     step (u32): the request's frame counter, growing with every decode
                 frame the coordinator sends it: a stage takes a request's decode
                 frames in step order and drops one whose step it has passed
    24     4     start: position of the first token in this frame
    28     4     count: token positions in this frame
    32     2     candidates the last stage should return (1 = greedy argmax,
                 0 = none: a prefill chunk that is not the prompt's last)
    34     1     ndim (1..3)
    35     1     route length R: the number of stages
    36     12    shape, 3 x u32 (unused dims 0)
    48     4     payload bytes on the wire
    52     4     CRC-32 of header bytes 0..51, the route and the wire payload
    56     R     route: the replica index of the node chosen at each stage
    56+R   ...   payload

The route travels with every frame, so a stage needs no per-request routing
state to know which replica of the next stage holds the request's KV cache:
the coordinator picks the chain, and a failover is a new route and epoch.

An MQTT message carries one frame or several back to back: a stage sends a
batched decode step's rows as one message (one broker hop, not B).

The magic and the version (bytes 0-4) stay where they are in every version, so
a receiver tells a frame of another edgebus release from garbage and refuses it
naming both releases (`FrameVersionError`; edgebus/core/versions.py), whatever
else that version changed. Bump VERSION with any change an older receiver would
misread; a change it never receives unless it says it takes it (as a stage's
`exact_rows` in its status gates decode frames of several positions) needs none.

Little-endian throughout. The payload is the tensor's raw bytes, or their LZ4
block when that is meaningfully smaller. Hidden states of a trained model are
close to incompressible FP16 (measured: LZ4 saves ~0 %), so we try LZ4 only on
payloads big enough to matter and send raw otherwise, without an extra copy.
A CANDIDATES payload is `count x k` int32 token ids followed by as many float32
logits: the top-k the coordinator samples from, not the whole vocabulary. An
ERROR payload is UTF-8 text: why a stage gave up on the request, or (flag
bit 2) why it could not go on with it, such as a frame that never arrived,
which the coordinator answers with a replay.

Nothing a message says is allocated before it is checked against the
receiver's `FrameLimits`, derived from the plant: how big a legal frame can be
and how many frames a legal message carries. `scan` reads only the headers,
so a message past either limit (say, an LZ4 bomb: 4 MiB that claim 1 GiB) is
refused before any payload is decompressed.
"""

from __future__ import annotations

import enum
import math
import struct
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import lz4.block
import numpy as np

from edgebus.core import versions
from edgebus.core.errors import FrameError, FrameVersionError

if TYPE_CHECKING:
    # Only the torch engine's callers hand torch tensors in: a llama.cpp box has no torch.
    import torch

MAGIC = b"EBF\x00"
VERSION = 2
_HEADER = struct.Struct("<4sBBBBQIIIIHBB3III")
HEADER_SIZE = _HEADER.size  # 56
_CRC_SPAN = HEADER_SIZE - 4

# Below this many payload bytes LZ4 cannot win back the cost of trying: a
# single decode-step activation (one token, H fp16 values) is sent raw.
LZ4_MIN_BYTES = 4096
# Keep the compressed form only if it saves at least 1/8: a smaller gain is not
# worth the decompression on a slow box.
LZ4_MIN_SAVING = 0.125
# An ERROR frame's reason is cut to this many bytes: a sentence or two, and
# an error about a hostile frame must not be a way to send big ones.
MAX_ERROR_BYTES = 1024
# Most decode rows a stage runs as one forward pass (node_agent/stage.py); a
# batch's output message carries at most one frame per row and one prompt chunk.
MAX_BATCH_ROWS = 32
# Most positions a decode frame carries: a request's token and the drafts behind it, which
# the stages verify in one call where their rows stay exact (node_agent/speculation.py).
# A k-row call costs about k/2 one-row steps at 8 rows on a 2-core EPYC (4.9x one row), and
# prompt lookup rarely gets a longer run of drafts taken.
MAX_DECODE_POSITIONS = 8
# Bytes a frame's dtype may take per element at most: float32 activations
# (wire_dtype float16 halves it, token ids are int32 too).
_WIDEST_ITEM = 4


class Kind(enum.IntEnum):
    TOKENS = 1      # int32 token ids into the first stage
    HIDDEN = 2      # hidden states between stages
    CANDIDATES = 3  # top-k (ids, logits) from the last stage to the coordinator
    RELEASE = 4     # the request is over: free its KV cache (empty payload)
    ERROR = 5       # a stage gave up on the request (UTF-8 reason), to the coordinator


class DType(enum.IntEnum):
    FLOAT16 = 1
    FLOAT32 = 2
    BFLOAT16 = 3
    INT32 = 4
    CANDIDATES = 5  # int32 ids then float32 logits, same shape each
    UTF8 = 6


# Little-endian, as the wire is. bfloat16 has no numpy dtype: it travels as its bits.
_NUMPY_DTYPES: dict[DType, np.dtype[Any]] = {
    DType.FLOAT16: np.dtype("<f2"), DType.FLOAT32: np.dtype("<f4"),
    DType.BFLOAT16: np.dtype("<u2"), DType.INT32: np.dtype("<i4")}
_ITEM_SIZE = {DType.FLOAT16: 2, DType.FLOAT32: 4, DType.BFLOAT16: 2, DType.INT32: 4,
              DType.CANDIDATES: 8, DType.UTF8: 1}
# A header's kind and dtype bytes to their enums, and a tensor's dtype to its wire code: dict
# lookups, since an enum's constructor, its __members__ and numpy's dtype comparison took
# ~1 us each, several times a frame, on every hop of every token.
_KINDS = {kind.value: kind for kind in Kind}
_DTYPES = {code.value: code for code in DType}
_WIRE_CODES = {known: code for code, known in _NUMPY_DTYPES.items() if code != DType.BFLOAT16}
FLAG_LZ4 = 0x01
FLAG_PREFILL = 0x02
FLAG_RETRY = 0x04
FLAG_BUSY = 0x08
FLAG_ROLLBACK = 0x10
# A route names one node per stage in a byte; no plant has 256 stages or replicas.
MAX_ROUTE = 255


def _wire_array(tensor: np.ndarray | torch.Tensor, kind: Kind) -> tuple[np.ndarray, DType]:
    """A tensor as the contiguous array its payload is, and that array's wire dtype."""
    if not isinstance(tensor, np.ndarray):
        # A torch tensor: torch is loaded already, by whoever made it.
        import torch

        if tensor.dtype == torch.bfloat16:
            return tensor.contiguous().view(torch.int16).numpy().view("<u2"), DType.BFLOAT16
        tensor = tensor.detach().numpy()
    if kind == Kind.TOKENS:
        tensor = tensor.astype("<i4", copy=False)
    code = _WIRE_CODES.get(tensor.dtype)
    if code is not None:
        return np.ascontiguousarray(tensor), code
    raise FrameError(f"activation dtype {tensor.dtype} cannot be framed; use float16, "
                     "bfloat16 or float32")


@dataclass(frozen=True)
class Frame:
    """A decoded frame. `payload` is the uncompressed tensor bytes."""

    kind: Kind
    dtype: DType
    request: int
    epoch: int
    step: int
    start: int
    count: int
    candidates: int
    shape: tuple[int, ...]
    payload: bytes | memoryview
    route: tuple[int, ...] = ()
    prefill: bool = False
    compressed: bool = False
    wire_bytes: int = 0
    retry: bool = False  # an ERROR that a replay of the request can recover from
    busy: bool = False  # ... once the stage has room again: a refusal for lack of it
    rollback: bool = False  # drop the positions from `start` on first (rejected drafts)

    @property
    def verifies(self) -> bool:
        """A decode frame of several positions: a token and the drafts behind it."""
        return not self.prefill and self.count > 1

    def array(self) -> np.ndarray:
        """The payload as a writable numpy array of its own (TOKENS int32, HIDDEN float16 or
        float32; bfloat16 comes as the float32 it widens to exactly)."""
        if self.dtype not in _NUMPY_DTYPES:
            raise FrameError(f"a {self.kind.name} frame holds no tensor: use "
                             "candidates_arrays() or text()")
        flat = np.frombuffer(bytearray(self.payload), dtype=_NUMPY_DTYPES[self.dtype])
        if self.dtype == DType.BFLOAT16:
            flat = (flat.astype("<u4") << 16).view("<f4")
        shaped: np.ndarray = flat.reshape(self.shape)
        return shaped

    def tensor(self) -> torch.Tensor:
        """The payload as a torch tensor (TOKENS, HIDDEN), for the torch engine's callers."""
        import torch

        if self.dtype == DType.BFLOAT16:
            bits = np.frombuffer(bytearray(self.payload), dtype="<i2").reshape(self.shape)
            return torch.from_numpy(bits).view(torch.bfloat16)
        return torch.from_numpy(self.array())

    def candidates_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32, logits float32), each of `shape`."""
        half = len(self.payload) // 2
        ids = np.frombuffer(self.payload, dtype="<i4", count=half // 4).reshape(self.shape)
        logits = np.frombuffer(self.payload, dtype="<f4", offset=half).reshape(self.shape)
        return ids, logits

    def text(self) -> str:
        """The reason an ERROR frame carries."""
        return bytes(self.payload).decode("utf-8", errors="replace")


@dataclass(frozen=True)
class Header:
    """Which request, route attempt and position a frame belongs to."""

    request: int
    epoch: int
    step: int
    route: tuple[int, ...] = ()

    @classmethod
    def of(cls, frame: Frame) -> Header:
        return cls(frame.request, frame.epoch, frame.step, frame.route)


def encode(kind: Kind, tensor: np.ndarray | torch.Tensor, header: Header, *, start: int,
           candidates: int = 1, prefill: bool = False, rollback: bool = False) -> bytes:
    """Frame one tensor, numpy or torch (TOKENS: [1, T] ints, HIDDEN: [1, T, H] floats)."""
    array, code = _wire_array(tensor, kind)
    count = array.shape[1] if array.ndim >= 2 else array.shape[0]
    return _pack(kind, code, memoryview(array.data).cast("B"), tuple(array.shape), header,
                 start=start, count=count, candidates=candidates, prefill=prefill,
                 flags=FLAG_ROLLBACK if rollback else 0)


def encode_candidates(ids: np.ndarray, logits: np.ndarray, header: Header, *,
                      start: int) -> bytes:
    """Frame the last stage's top-k: ids and logits are [rows, k], a row per position
    computed (several for a decode frame of a token and its drafts)."""
    payload = (np.ascontiguousarray(ids, dtype="<i4").tobytes()
               + np.ascontiguousarray(logits, dtype="<f4").tobytes())
    return _pack(Kind.CANDIDATES, DType.CANDIDATES, memoryview(payload), tuple(ids.shape),
                 header, start=start, count=ids.shape[0], candidates=ids.shape[-1])


def encode_release(header: Header) -> bytes:
    """Tell a stage the request's route `header.epoch` has ended, so it frees the KV cache."""
    return _pack(Kind.RELEASE, DType.INT32, memoryview(b""), (0,), header, start=0, count=0,
                 candidates=0)


def encode_error(header: Header, reason: str, *, retry: bool = False,
                 busy: bool = False) -> bytes:
    """Tell the coordinator why a stage gave up on the request; `retry`: why it cannot go on
    with it as sent (a frame lost or bad), which a replay of the request recovers; `busy`:
    the stage refused the frame for lack of room, so a replay should wait a little."""
    text = reason.encode("utf-8")[:MAX_ERROR_BYTES].decode("utf-8", errors="ignore").encode()
    flags = (FLAG_RETRY if retry or busy else 0) | (FLAG_BUSY if busy else 0)
    return _pack(Kind.ERROR, DType.UTF8, memoryview(text), (len(text),), header, start=0,
                 count=0, candidates=0, flags=flags)


def _pack(kind: Kind, code: DType, raw: memoryview, shape: tuple[int, ...], header: Header, *,
          start: int, count: int, candidates: int, prefill: bool = False, flags: int = 0) -> bytes:
    if not 1 <= len(shape) <= 3:
        raise FrameError(f"a frame carries a 1-3 dimensional tensor, got shape {shape}")
    route: bytes | None
    try:
        route = bytes(header.route)  # a byte a stage: raises for a replica past 0..255
    except ValueError:
        route = None
    if route is None or len(route) > MAX_ROUTE:
        raise FrameError(f"route {header.route} does not fit a frame")
    flags, wire = flags | (FLAG_PREFILL if prefill else 0), raw
    if len(raw) >= LZ4_MIN_BYTES:
        packed = lz4.block.compress(raw, store_size=False)
        if len(packed) <= len(raw) * (1 - LZ4_MIN_SAVING):
            flags, wire = flags | FLAG_LZ4, memoryview(packed)
    dims = (*shape, *([0] * (3 - len(shape))))
    packed_header = _HEADER.pack(MAGIC, VERSION, kind, code, flags, header.request, header.epoch,
                                 header.step, start, count, candidates, len(shape),
                                 len(route), *dims, len(wire), 0)[:_CRC_SPAN]
    crc = zlib.crc32(wire, zlib.crc32(route, zlib.crc32(packed_header)))
    return b"".join((packed_header, crc.to_bytes(4, "little"), route, wire))


@dataclass(frozen=True)
class FrameLimits:
    """What a receiver accepts: the largest legal frame, and the most frames in one message.

    Derived from the plant (`stage_limits`, `coordinator_limits`), so a message
    past either is refused from its headers, before anything is decompressed.
    """

    max_payload: int  # decompressed payload bytes of one frame
    max_frames: int  # frames in one message
    max_route: int = MAX_ROUTE  # stages a route names

    @property
    def max_message(self) -> int:
        """Bytes of the largest legal message: that many frames of the largest size."""
        return self.max_frames * (HEADER_SIZE + self.max_route + self.max_payload)


def frames_per_message(max_in_flight: int) -> int:
    """The most frames a legal message carries: a decode group holds at most every request
    in flight (node_agent/groups.py), a batch's output one frame per row and a prompt chunk."""
    return max(max_in_flight, MAX_BATCH_ROWS + 1)


def stage_limits(*, prefill_chunk: int, hidden: int, max_in_flight: int,
                 stages: int) -> FrameLimits:
    """What a stage takes: TOKENS or HIDDEN frames of at most one prefill chunk."""
    return FrameLimits(prefill_chunk * max(hidden, 1) * _WIDEST_ITEM,
                       frames_per_message(max_in_flight), stages)


def coordinator_limits(*, vocab: int, max_in_flight: int, stages: int) -> FrameLimits:
    """What the coordinator takes: CANDIDATES (at most the whole vocabulary, when a request
    asks top_k that high; 8 bytes each) for each position of a decode frame, and ERROR
    frames."""
    return FrameLimits(max(vocab * _ITEM_SIZE[DType.CANDIDATES] * MAX_DECODE_POSITIONS,
                           MAX_ERROR_BYTES),
                       frames_per_message(max_in_flight), stages)


# For a single frame read outside any plant (tools, tests): a prefill chunk of
# 4096 positions of a 4096-wide FP32 model is 64 MiB.
SINGLE_FRAME = FrameLimits(64 * 1024 * 1024, 1)


@dataclass(frozen=True)
class Peek:
    """A frame's header, read without checking the checksum or touching the payload."""

    kind: Kind
    dtype: DType
    flags: int
    request: int
    epoch: int
    step: int
    start: int
    count: int
    candidates: int
    shape: tuple[int, ...]
    route: tuple[int, ...]
    raw_bytes: int  # payload bytes once decompressed
    offset: int  # where the frame starts in its message
    body: int  # where its payload starts
    end: int  # where it ends
    crc: int

    @property
    def compressed(self) -> bool:
        return bool(self.flags & FLAG_LZ4)

    @property
    def prefill(self) -> bool:
        return bool(self.flags & FLAG_PREFILL)

    @property
    def rollback(self) -> bool:
        return bool(self.flags & FLAG_ROLLBACK) and self.kind in (Kind.TOKENS, Kind.HIDDEN)

    @property
    def wire_bytes(self) -> int:
        return self.end - self.offset

    def header(self) -> Header:
        return Header(self.request, self.epoch, self.step, self.route)


class BatchError(FrameError):
    """A message that is bad from frame len(good) + 1 on.

    `good`: the frames before the bad one, decoded and checked. `suspects`: the
    headers of the frames from the bad one on that could be read, unverified:
    whom to tell that their frames did not make it. `cause`: what is wrong.
    """

    def __init__(self, good: list[Frame], cause: FrameError,
                 suspects: list[Peek] | None = None) -> None:
        where = f"frame {len(good) + 1} of the message: " if good else ""
        super().__init__(f"{where}{cause}")
        self.good = good
        self.suspects = suspects or []
        self.cause = cause


def decode(data: bytes, limits: FrameLimits = SINGLE_FRAME) -> Frame:
    """Parse and check exactly one frame. Raises FrameError saying what is wrong."""
    peek, error = _scan_one(data, 0, limits)
    if error is not None:
        raise error
    assert peek is not None
    if peek.end != len(data):
        raise FrameError(f"{len(data) - peek.end} bytes follow the frame: truncated or padded")
    return _finish(data, peek)


def scan(data: bytes, limits: FrameLimits) -> list[Peek]:
    """Read the headers of a message of one or more frames back to back (a batch).

    Checks everything but the checksums and the payloads: structure, sizes
    against `limits`, frame count. Nothing is allocated beyond the headers.
    A message past a limit raises BatchError; a frame that cannot be read
    raises BadTail, whose `peeks` are the frames before it (the caller may
    still decode them with `decode_scanned`).
    """
    if len(data) > limits.max_message:
        raise BatchError([], FrameError(
            f"message of {len(data)} bytes is larger than the largest legal one "
            f"({limits.max_message} bytes: {limits.max_frames} frames of at most "
            f"{limits.max_payload} payload bytes)"))
    peeks: list[Peek] = []
    offset = 0
    while offset < len(data) or not peeks:
        if len(peeks) == limits.max_frames:
            raise BatchError([], FrameError(
                f"message carries more than {limits.max_frames} frames, the most a legal "
                "one does"), peeks)
        peek, error = _scan_one(data, offset, limits)
        if error is not None:
            raise BadTail(peeks, error, [] if peek is None else [peek])
        assert peek is not None
        peeks.append(peek)
        offset = peek.end
    return peeks


class BadTail(BatchError):
    """A message whose frame len(peeks) + 1 cannot be read, after `peeks` that could."""

    def __init__(self, peeks: list[Peek], cause: FrameError, suspects: list[Peek]) -> None:
        super().__init__([], cause, suspects)
        self.peeks = peeks


def decode_scanned(data: bytes, peeks: list[Peek]) -> list[Frame]:
    """Check the checksums of scanned frames and decompress them (`decode_all`'s second half,
    which a receiver may run on a worker thread: decompression is what costs)."""
    result: list[Frame] = []
    for index, peek in enumerate(peeks):
        try:
            result.append(_finish(data, peek))
        except FrameError as exc:
            raise BatchError(result, exc, peeks[index:]) from None
    return result


def decode_all(data: bytes, limits: FrameLimits) -> list[Frame]:
    """Parse a message of one or more frames back to back (a batch).

    A bad frame ends the parse: without a trustworthy length there is no
    telling where the next one starts. The frames before it are returned
    with the error, so one corrupt row does not cost the batch; a message
    past `limits` is refused whole.
    """
    try:
        peeks = scan(data, limits)
    except BadTail as exc:
        good = decode_scanned(data, exc.peeks)  # raises for a bad one among them instead
        raise BatchError(good, FrameError(str(exc)), exc.suspects) from None
    return decode_scanned(data, peeks)


def _scan_one(data: bytes, offset: int,
              limits: FrameLimits) -> tuple[Peek | None, FrameError | None]:
    """The header at `offset`, and what is wrong with the frame (None: nothing seen so far).

    The peek is returned with an error where the header itself could be read,
    so the sender of a frame refused for its size can still be named.
    """
    if len(data) - offset < HEADER_SIZE:
        return None, FrameError(f"frame of {len(data) - offset} bytes is shorter than the "
                                f"{HEADER_SIZE}-byte header")
    (magic, version, kind_byte, dtype_byte, flags, request, epoch, step, start, count,
     candidates, ndim, route_len, d0, d1, d2, wire_len, crc) = _HEADER.unpack_from(data, offset)
    if magic != MAGIC:
        return None, FrameError(f"bad magic {magic!r}: not an edgebus activation frame")
    if version != VERSION:
        return None, version_error(version)
    kind, dtype = _KINDS.get(kind_byte), _DTYPES.get(dtype_byte)
    if kind is None or dtype is None:
        return None, FrameError(f"unknown frame kind {kind_byte} or dtype {dtype_byte}")
    if not 1 <= ndim <= 3:
        return None, FrameError(f"frame ndim {ndim} outside 1..3")
    body = offset + HEADER_SIZE + route_len
    end = body + wire_len
    if end > len(data):
        return None, FrameError(f"frame says {route_len} route and {wire_len} payload bytes "
                                f"but carries {len(data) - offset - HEADER_SIZE}: truncated")
    shape = (d0, d1, d2)[:ndim]
    raw_len = math.prod(shape) * _ITEM_SIZE[dtype]
    peek = Peek(kind, dtype, flags, request, epoch, step, start, count, candidates,
                shape, tuple(data[offset + HEADER_SIZE:body]), raw_len, offset, body, end, crc)
    if route_len > limits.max_route:
        return peek, FrameError(f"route of {route_len} stages; this plant has "
                                f"{limits.max_route}: run the same plant file on every box")
    if raw_len > limits.max_payload:
        return peek, FrameError(f"frame payload of {raw_len} bytes exceeds the largest legal "
                                f"frame's {limits.max_payload} (prefill_chunk positions of "
                                "the model's width in float32)")
    if (wire_len > raw_len) if flags & FLAG_LZ4 else (wire_len != raw_len):
        return peek, FrameError(f"payload holds {wire_len} bytes, shape {shape} needs "
                                f"{raw_len}")
    return peek, None


def version_error(version: int) -> FrameVersionError:
    """The refusal of a frame of `version`: both releases, both frame versions, and which box
    to upgrade."""
    upgrade = "this box" if version > VERSION else "the sender's box"
    return FrameVersionError(
        f"frame version {version} (sent by {versions.frame_sender(version, VERSION)}); this "
        f"agent runs edgebus {versions.EDGEBUS} and speaks frame version {VERSION}: upgrade "
        f"{upgrade} (docs/upgrades.md says in what order)", version)


def _finish(data: bytes, peek: Peek) -> Frame:
    """Check a scanned frame's checksum and decompress its payload."""
    view = memoryview(data)
    route, wire = view[peek.offset + HEADER_SIZE:peek.body], view[peek.body:peek.end]
    head = view[peek.offset:peek.offset + _CRC_SPAN]
    if zlib.crc32(wire, zlib.crc32(route, zlib.crc32(head))) != peek.crc:
        raise FrameError("frame checksum mismatch: corrupted in transit")
    payload: bytes | memoryview = wire
    if peek.compressed:
        try:
            payload = lz4.block.decompress(wire, uncompressed_size=peek.raw_bytes)
        except lz4.block.LZ4BlockError as exc:
            raise FrameError(f"LZ4 payload does not decompress: {exc}") from None
        if len(payload) != peek.raw_bytes:
            raise FrameError(f"LZ4 payload holds {len(payload)} bytes, shape {peek.shape} "
                             f"needs {peek.raw_bytes}")
    return Frame(peek.kind, peek.dtype, peek.request, peek.epoch, peek.step, peek.start,
                 peek.count, peek.candidates, peek.shape, payload, peek.route,
                 bool(peek.flags & FLAG_PREFILL), peek.compressed, peek.wire_bytes,
                 bool(peek.flags & FLAG_RETRY) and peek.kind == Kind.ERROR,
                 bool(peek.flags & FLAG_BUSY) and peek.kind == Kind.ERROR, peek.rollback)
