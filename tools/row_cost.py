"""What does a row-exact llama.cpp setting cost?  (issue 42, item 1; see docs/row-exactness.md)

    python tools/row_cost.py GGUF [--threads 2] [--variant default|norepack|engine]
        [--repack REGEX] [--reps 15]

Prints the median and the minimum wall time (ms) of four llama_decode calls, on one context
(n_seq_max 8, kv_unified false, n_ubatch 512, flash attention on), each after a 64-token prompt
per sequence, undone after each call so every repetition sees the same cache:
  row1   one decode row;   seq8  one row each of 8 sequences;
  pos4   4 positions of one sequence;   prompt128  a 128-token prompt into an empty sequence.
`--variant engine` places the weights as the llamacpp engine does on this CPU
(node_agent/engines/llamacpp/placement.py). Run the variants in alternating processes (the
GGML_CPU_TILED_MM switch is read once per process), e.g.
for i in 1 2 3; do for v in A B; do ...; done; done.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import llama_cpp
import numpy as np
from row_exactness import load  # the same variants as the exactness probe

from node_agent.engines.llamacpp import library

_QUIET = llama_cpp.llama_log_callback(lambda *_: None)


Row = tuple[int, int, int, bool]  # (token, pos, seq, logits wanted)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variant", default="default", choices=("default", "norepack", "engine"))
    ap.add_argument("--repack", action="append", default=[], metavar="REGEX")
    ap.add_argument("--reps", type=int, default=15)
    a = ap.parse_args(argv)
    llama_cpp.llama_log_set(_QUIET, ctypes.c_void_p())
    llama_cpp.llama_backend_init()
    if a.variant == "engine":
        params, _keep = library.model_params(Path(a.gguf))
        model = llama_cpp.llama_model_load_from_file(a.gguf.encode(), params)
    else:
        model, _keep = load(a.gguf, a.variant, [], a.repack)
    nv: int = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max, cp.kv_unified = 8 * 512, 512, 512, 8, False
    cp.n_threads = cp.n_threads_batch = a.threads
    # on: with F16 KV and FA off, positions of one sequence are not row-exact
    cp.flash_attn_type = 1
    ctx = llama_cpp.llama_init_from_model(model, cp)
    mem = llama_cpp.llama_get_memory(ctx)
    rng = np.random.default_rng(0)
    toks = [int(x) for x in rng.integers(100, nv - 100, 256)]

    def decode(rows: list[Row]) -> float:
        b = llama_cpp.llama_batch_init(len(rows), 0, 1)
        b.n_tokens = len(rows)
        for i, (t, p, s, out) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = t, p, 1, out
            b.seq_id[i][0] = s
        t0 = time.perf_counter()
        assert llama_cpp.llama_decode(ctx, b) == 0
        dt = time.perf_counter() - t0
        llama_cpp.llama_batch_free(b)
        return dt

    for s in range(8):
        decode([(toks[i], i, s, False) for i in range(64)])
    cases: dict[str, Callable[[], list[Row]]] = {
        "row1": lambda: [(toks[64], 64, 0, True)],
        "seq8": lambda: [(toks[64 + s], 64, s, True) for s in range(8)],
        "pos4": lambda: [(toks[64 + j], 64 + j, 0, True) for j in range(4)],
    }
    res: dict[str, tuple[float, float]] = {}
    for name, rows in cases.items():
        ts: list[float] = []
        for _ in range(a.reps):
            ts.append(decode(rows()))
            for s in range(8):
                llama_cpp.llama_memory_seq_rm(mem, s, 64, -1)
        res[name] = (statistics.median(ts) * 1e3, min(ts) * 1e3)
    llama_cpp.llama_memory_seq_rm(mem, 7, 0, -1)
    ts = []
    for _ in range(max(3, a.reps // 3)):
        ts.append(decode([(toks[i], i, 7, i == 127) for i in range(128)]))
        llama_cpp.llama_memory_seq_rm(mem, 7, 0, -1)
    res["prompt128"] = (statistics.median(ts) * 1e3, min(ts) * 1e3)
    print(" ".join(f"{k}={med:.2f}/{low:.2f}" for k, (med, low) in res.items()))  # median/min ms
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
