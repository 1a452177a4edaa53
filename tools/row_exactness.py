"""Are k rows in one llama_decode call bitwise equal to k one-row calls?  (issue 42, item 1)

    python tools/row_exactness.py GGUF [--threads 2] [--fa 0|1] [--ubatch 512]
        [--variant default|norepack] [--override REGEX ...] [--ks 1,2,3,4,5,6,7,8,16,32]

Two questions, each asked for every k in --ks, on a fresh context each time:
  pos: k positions of ONE sequence decoded in one call, against the same k positions
       decoded one per call (after the same 40-token prompt);
  seq: one row each of k sequences (ids 0..k-1, kv_unified = false, one KV stream each,
       prompts of different lengths) in one call, against each row decoded alone.
For each, it compares the logits and the hidden states (the final norm's output, read as
embeddings with pooling NONE) with a bitwise test and prints how many of the k rows are equal.
"largest exact k" is the largest k of --ks such that every k' <= k in --ks was exact.

Variants (llama_model_params):
  default    llama.cpp's defaults (repacked / AMX weights where the CPU has them);
  norepack   use_extra_bufts = false: every weight in the plain CPU buffer;
  --override REGEX  (repeatable) tensor_buft_overrides to ggml_backend_cpu_buffer_type().
             NOTE: llama.cpp reads a CPU override as "CPU or its extra types"
             (llama-model-loader.cpp), so with use_extra_bufts on this still repacks: it is
             here to show that;
  --repack REGEX    (repeatable) use_extra_bufts = false, and the matching tensors go to the
             CPU_REPACK buffer type (an override to a non-CPU type is taken as is): repack
             only those.
Environment knobs of ggml-cpu that matter here are read once, at the first matmul, so they can
be set on the command line: GGML_CPU_TILED_MM=0 (no tiled K-quant matmul for >= 8 rows).
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
from typing import Any, cast

import llama_cpp
import numpy as np
import numpy.typing as npt

from node_agent.engines.llamacpp.library import extra_buffer_type

PROMPT = 40
_QUIET = llama_cpp.llama_log_callback(lambda *_: None)  # kept alive: llama.cpp calls it later
CTX_PER_SEQ = 512

Row = tuple[int, int, int]  # (token, pos, seq)
RowOut = tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]  # (logits, hidden)


class BuftOverride(ctypes.Structure):  # struct llama_model_tensor_buft_override (llama.h)
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _lib(name: str) -> ctypes.CDLL:
    return ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", name))


def buffer_type(name: str) -> int:
    """The CPU device's buffer type called `name`: "CPU", or an extra one ("CPU_REPACK", "AMX")."""
    if name == "CPU":
        base = _lib("libggml-base.so")
        base.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
        return cast(int, base.ggml_backend_cpu_buffer_type())
    found = extra_buffer_type(name.encode())
    if found is None:
        sys.exit(f"no {name} buffer type in this build")
    return found


def load(
    path: str, variant: str, overrides: list[str], repack: list[str]
) -> tuple[Any, ctypes.Array[BuftOverride] | None]:
    mp = llama_cpp.llama_model_default_params()
    if variant == "norepack" or repack:
        mp.use_extra_bufts = False
    keep: ctypes.Array[BuftOverride] | None = None
    pairs = [(p, "CPU") for p in overrides] + [(p, "CPU_REPACK") for p in repack]
    if pairs:
        keep = (BuftOverride * (len(pairs) + 1))()
        for i, (pattern, buft) in enumerate(pairs):
            keep[i].pattern, keep[i].buft = pattern.encode(), buffer_type(buft)
        mp.tensor_buft_overrides = ctypes.cast(keep, ctypes.c_void_p).value
    model = llama_cpp.llama_model_load_from_file(path.encode(), mp)
    if not model:
        sys.exit(f"cannot load {path}")
    return model, keep


class Probe:
    def __init__(self, model: Any, threads: int, fa: int, ubatch: int) -> None:
        self.model, self.threads, self.fa, self.ubatch = model, threads, fa, ubatch
        self.nv: int = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
        self.nd: int = llama_cpp.llama_model_n_embd(model)

    def context(self, nseq: int) -> Any:
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = CTX_PER_SEQ * nseq
        cp.n_batch = 512
        cp.n_ubatch = self.ubatch
        cp.n_seq_max = nseq
        cp.kv_unified = False
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.flash_attn_type = self.fa
        cp.embeddings = True  # the final norm's output too, one row per token
        cp.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE
        return llama_cpp.llama_init_from_model(self.model, cp)

    def decode(self, ctx: Any, rows: list[Row], want: bool) -> list[RowOut]:
        """rows: (token, pos, seq); returns [(logits, hidden)] per row if want."""
        b = llama_cpp.llama_batch_init(len(rows), 0, 1)
        b.n_tokens = len(rows)
        for i, (t, p, s) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, p, 1, want
            b.seq_id[i][0] = s
        assert llama_cpp.llama_decode(ctx, b) == 0
        out: list[RowOut] = []
        for i in range(len(rows) if want else 0):
            lg = np.ctypeslib.as_array(
                llama_cpp.llama_get_logits_ith(ctx, i), shape=(self.nv,)
            ).copy()
            hs = np.ctypeslib.as_array(
                llama_cpp.llama_get_embeddings_ith(ctx, i), shape=(self.nd,)
            ).copy()
            out.append((lg, hs))
        llama_cpp.llama_batch_free(b)
        return out

    def positions(
        self, prompt: list[int], drafts: list[int], k: int
    ) -> tuple[list[RowOut], list[RowOut]]:
        start = [(t, i, 0) for i, t in enumerate(prompt[:PROMPT])]
        rows = [(t, PROMPT + j, 0) for j, t in enumerate(drafts[:k])]
        c = self.context(1)
        self.decode(c, start, False)
        single = [self.decode(c, [r], True)[0] for r in rows]
        llama_cpp.llama_free(c)
        c = self.context(1)
        self.decode(c, start, False)
        batch = self.decode(c, rows, True)
        llama_cpp.llama_free(c)
        return single, batch

    def sequences(self, prompt: list[int], drafts: list[int], k: int) -> list[list[RowOut]]:
        lens = [PROMPT - 10 + s % 11 for s in range(k)]  # different lengths, different positions
        rows = [(drafts[s], lens[s], s) for s in range(k)]
        res: list[list[RowOut]] = []
        for together in (False, True):
            c = self.context(k)
            for s in range(k):
                self.decode(c, [(t, i, s) for i, t in enumerate(prompt[s % 7:][: lens[s]])], False)
            res.append(
                self.decode(c, rows, True)
                if together
                else [self.decode(c, [r], True)[0] for r in rows]
            )
            llama_cpp.llama_free(c)
        return res


def compare(ref: list[RowOut], got: list[RowOut]) -> tuple[int, int, float]:
    lg = sum(bool(np.array_equal(a[0], b[0])) for a, b in zip(ref, got, strict=True))
    hs = sum(bool(np.array_equal(a[1], b[1])) for a, b in zip(ref, got, strict=True))
    diff = max(float(np.abs(a[0] - b[0]).max()) for a, b in zip(ref, got, strict=True))
    return lg, hs, diff


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--fa", type=int, default=0, choices=(0, 1))
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--variant", default="default", choices=("default", "norepack"))
    ap.add_argument("--override", action="append", default=[], metavar="REGEX")
    ap.add_argument("--repack", action="append", default=[], metavar="REGEX")
    ap.add_argument("--ks", default="1,2,3,4,5,6,7,8,16,32")
    ap.add_argument("--no-seq", action="store_true", help="skip the k-sequences test")
    ap.add_argument(
        "--all", action="store_true", help="go on through every k after both tests failed"
    )
    a = ap.parse_args(argv)
    ks = [int(x) for x in a.ks.split(",")]

    if not os.environ.get("ROWS_VERBOSE"):
        llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p())
    llama_cpp.llama_backend_init()
    model, _keep = load(a.gguf, a.variant, a.override, a.repack)
    p = Probe(model, a.threads, a.fa, a.ubatch)
    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(100, p.nv - 100, PROMPT + 8)]
    drafts = [int(x) for x in rng.integers(100, p.nv - 100, max(ks))]

    print(f"# {os.path.basename(a.gguf)} threads={a.threads} fa={a.fa} n_ubatch={a.ubatch} "
          f"variant={a.variant} override={a.override or '-'} repack={a.repack or '-'} "
          f"tiled_mm={os.environ.get('GGML_CPU_TILED_MM', '1')}")
    print(f"{'k':>3} | pos: logits  hidden  max|dlogit| | seq: logits  hidden  max|dlogit|")
    tests = ("pos logits", "pos hidden", "seq logits", "seq hidden")
    best = dict.fromkeys(tests, 0)
    alive = {t: not (a.no_seq and t.startswith("seq")) for t in tests}
    for k in ks:
        cells: list[str] = []
        eq: dict[str, int] = {}
        for name, fn in (("pos", p.positions), ("seq", p.sequences)):
            if name == "seq" and a.no_seq:
                cells.append(f"{'-':>27}")
                continue
            lg, hs, d = compare(*fn(prompt, drafts, k))
            eq[name + " logits"], eq[name + " hidden"] = lg, hs
            cells.append(f"{lg:>6}/{k:<3} {hs:>3}/{k:<3} {d:>10.3g}")
        print(f"{k:>3} | {cells[0]} | {cells[1]}", flush=True)
        for t in tests:
            if alive[t] and eq.get(t) == k:
                best[t] = k
            else:
                alive[t] = False
        if not any(alive.values()) and not a.all:
            break  # every test failed: larger k adds nothing to "largest exact k"
    print("largest exact k: positions of one sequence: logits {} hidden {}; "
          "rows of k sequences: logits {} hidden {}".format(*(best[t] for t in tests)))
    llama_cpp.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
