"""The binary activation frame: what travels between stages.

    offset size  field
    0      4     magic  b"EBF\\x00"
    4      1     version (2)
    5      1     kind    TOKENS | HIDDEN | CANDIDATES | RELEASE | ERROR
    6      1     dtype   code of the payload's element type
    7      1     flags   bit 0: payload is LZ4-compressed; bit 1: prefill (prompt or
                 replay positions, any count) rather than one decode step
    8      8     request sequence id (u64, assigned by the coordinator)
    16     4     route epoch (u32): frames of an abandoned route are recognisable
    20     4     step (u32): 0 = prefill, n = n-th decode step
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

Little-endian throughout. The payload is the tensor's raw bytes, or their LZ4
block when that is meaningfully smaller. Hidden states of a trained model are
close to incompressible FP16 (measured: LZ4 saves ~0 %), so we try LZ4 only on
payloads big enough to matter and send raw otherwise, without an extra copy.
A CANDIDATES payload is `count x k` int32 token ids followed by as many float32
logits: the top-k the coordinator samples from, not the whole vocabulary. An
ERROR payload is UTF-8 text: why a stage gave up on the request.
"""

from __future__ import annotations

import enum
import math
import struct
import zlib
from dataclasses import dataclass

import lz4.block
import numpy as np
import torch

from edgebus.errors import FrameError

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
# A frame larger than this is refused before decompression: a prefill chunk of
# 4096 positions of a 4096-wide FP32 model is 64 MiB, well below it.
MAX_PAYLOAD_BYTES = 256 * 1024 * 1024


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


_TORCH_DTYPES = {DType.FLOAT16: torch.float16, DType.FLOAT32: torch.float32,
                 DType.BFLOAT16: torch.bfloat16, DType.INT32: torch.int32}
_ITEM_SIZE = {DType.FLOAT16: 2, DType.FLOAT32: 4, DType.BFLOAT16: 2, DType.INT32: 4,
              DType.CANDIDATES: 8, DType.UTF8: 1}
FLAG_LZ4 = 0x01
FLAG_PREFILL = 0x02
# A route names one node per stage in a byte; no plant has 256 stages or replicas.
MAX_ROUTE = 255


def dtype_code(dtype: torch.dtype) -> DType:
    for code, known in _TORCH_DTYPES.items():
        if known == dtype:
            return code
    raise FrameError(f"activation dtype {dtype} cannot be framed; use float16, bfloat16 or float32")


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

    def tensor(self) -> torch.Tensor:
        """The payload as a tensor (TOKENS, HIDDEN). Shares memory with the payload."""
        if self.dtype == DType.CANDIDATES:
            raise FrameError("a CANDIDATES frame holds two tensors: use candidates_arrays()")
        flat = torch.frombuffer(bytearray(self.payload), dtype=_TORCH_DTYPES[self.dtype])
        return flat.view(self.shape)

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


def encode(kind: Kind, tensor: torch.Tensor, header: Header, *, start: int,
           candidates: int = 1, prefill: bool = False) -> bytes:
    """Frame one tensor (TOKENS: [1, T] ints, HIDDEN: [1, T, H] floats)."""
    if kind == Kind.TOKENS:
        tensor = tensor.to(torch.int32)
    tensor = tensor.contiguous()
    code = dtype_code(tensor.dtype)
    raw = tensor.view(torch.uint8).numpy().data if tensor.dtype == torch.bfloat16 \
        else tensor.numpy().data
    count = tensor.shape[1] if tensor.dim() >= 2 else tensor.shape[0]
    return _pack(kind, code, raw.cast("B"), tuple(tensor.shape), header, start=start,
                 count=count, candidates=candidates, prefill=prefill)


def encode_candidates(ids: torch.Tensor, logits: torch.Tensor, header: Header, *,
                      start: int) -> bytes:
    """Frame the last stage's top-k: ids and logits are [rows, k]."""
    payload = (ids.to(torch.int32).contiguous().numpy().tobytes()
               + logits.to(torch.float32).contiguous().numpy().tobytes())
    return _pack(Kind.CANDIDATES, DType.CANDIDATES, memoryview(payload), tuple(ids.shape),
                 header, start=start, count=1, candidates=ids.shape[-1])


def encode_release(header: Header) -> bytes:
    """Tell a stage the request's route `header.epoch` has ended, so it frees the KV cache."""
    return _pack(Kind.RELEASE, DType.INT32, memoryview(b""), (0,), header, start=0, count=0,
                 candidates=0)


def encode_error(header: Header, reason: str) -> bytes:
    """Tell the coordinator why a stage gave up on the request."""
    text = reason.encode("utf-8")
    return _pack(Kind.ERROR, DType.UTF8, memoryview(text), (len(text),), header, start=0,
                 count=0, candidates=0)


def _pack(kind: Kind, code: DType, raw: memoryview, shape: tuple[int, ...], header: Header, *,
          start: int, count: int, candidates: int, prefill: bool = False) -> bytes:
    if not 1 <= len(shape) <= 3:
        raise FrameError(f"a frame carries a 1-3 dimensional tensor, got shape {shape}")
    if len(header.route) > MAX_ROUTE or any(not 0 <= r <= MAX_ROUTE for r in header.route):
        raise FrameError(f"route {header.route} does not fit a frame")
    flags, wire = FLAG_PREFILL if prefill else 0, raw
    if len(raw) >= LZ4_MIN_BYTES:
        packed = lz4.block.compress(raw, store_size=False)
        if len(packed) <= len(raw) * (1 - LZ4_MIN_SAVING):
            flags, wire = flags | FLAG_LZ4, memoryview(packed)
    dims = (*shape, *([0] * (3 - len(shape))))
    packed_header = _HEADER.pack(MAGIC, VERSION, kind, code, flags, header.request, header.epoch,
                                 header.step, start, count, candidates, len(shape),
                                 len(header.route), *dims, len(wire), 0)
    route = bytes(header.route)
    crc = zlib.crc32(wire, zlib.crc32(route, zlib.crc32(packed_header[:_CRC_SPAN])))
    return b"".join((packed_header[:_CRC_SPAN], crc.to_bytes(4, "little"), route, wire))


def decode(data: bytes) -> Frame:
    """Parse and check exactly one frame. Raises FrameError saying what is wrong."""
    frame, end = _decode_at(data, 0)
    if end != len(data):
        raise FrameError(f"{len(data) - end} bytes follow the frame: truncated or padded")
    return frame


def decode_all(data: bytes) -> list[Frame]:
    """Parse a message of one or more frames back to back (a batch).

    A bad frame ends the parse: without a trustworthy length there is no
    telling where the next one starts. The frames before it are returned
    with the error, so one corrupt row does not cost the batch.
    """
    result: list[Frame] = []
    offset = 0
    while offset < len(data) or not result:
        try:
            frame, offset = _decode_at(data, offset)
        except FrameError as exc:
            raise BatchError(result, exc) from None
        result.append(frame)
    return result


class BatchError(FrameError):
    """A message whose frame number len(good) is bad; `good` holds the ones before it."""

    def __init__(self, good: list[Frame], cause: FrameError) -> None:
        where = f"frame {len(good) + 1} of the message: " if good else ""
        super().__init__(f"{where}{cause}")
        self.good = good


def _decode_at(data: bytes, offset: int) -> tuple[Frame, int]:
    if len(data) - offset < HEADER_SIZE:
        raise FrameError(f"frame of {len(data) - offset} bytes is shorter than the "
                         f"{HEADER_SIZE}-byte header")
    (magic, version, kind, code, flags, request, epoch, step, start, count, candidates, ndim,
     route_len, d0, d1, d2, wire_len, crc) = _HEADER.unpack_from(data, offset)
    if magic != MAGIC:
        raise FrameError(f"bad magic {magic!r}: not an edgebus activation frame")
    if version != VERSION:
        raise FrameError(f"frame version {version}, this agent speaks {VERSION}: "
                         "run the same edgebus version on every box")
    if kind not in Kind.__members__.values() or code not in DType.__members__.values():
        raise FrameError(f"unknown frame kind {kind} or dtype {code}")
    if not 1 <= ndim <= 3:
        raise FrameError(f"frame ndim {ndim} outside 1..3")
    body = offset + HEADER_SIZE + route_len
    end = body + wire_len
    if end > len(data):
        raise FrameError(f"frame says {route_len} route and {wire_len} payload bytes but "
                         f"carries {len(data) - offset - HEADER_SIZE}: truncated")
    view = memoryview(data)
    route, wire = view[offset + HEADER_SIZE:body], view[body:end]
    if zlib.crc32(wire, zlib.crc32(route, zlib.crc32(view[offset:offset + _CRC_SPAN]))) != crc:
        raise FrameError("frame checksum mismatch: corrupted in transit")
    shape = (d0, d1, d2)[:ndim]
    raw_len = math.prod(shape) * _ITEM_SIZE[DType(code)]
    if raw_len > MAX_PAYLOAD_BYTES:
        raise FrameError(f"frame payload of {raw_len} bytes exceeds {MAX_PAYLOAD_BYTES}")
    payload: bytes | memoryview = wire
    if flags & FLAG_LZ4:
        try:
            payload = lz4.block.decompress(wire, uncompressed_size=raw_len)
        except lz4.block.LZ4BlockError as exc:
            raise FrameError(f"LZ4 payload does not decompress: {exc}") from None
    if len(payload) != raw_len:
        raise FrameError(f"payload holds {len(payload)} bytes, shape {shape} needs {raw_len}")
    frame = Frame(Kind(kind), DType(code), request, epoch, step, start, count, candidates, shape,
                  payload, tuple(route), bool(flags & FLAG_PREFILL), bool(flags & FLAG_LZ4),
                  end - offset)
    return frame, end
