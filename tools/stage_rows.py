"""What each stage of a split measures at load: `exact_batch` and `exact_rows` (issue 42, item 1).

    python tools/stage_rows.py [GGUF | --random TYPE] [--stages 3] [--threads 1]
        [--placement engine|default]

Loads each stage of an even split of the model's layers with the llamacpp engine, one after
another in this process, and prints the two counts its load-time probes found
(node_agent/engines/llamacpp/engine.py), with the block types it repacked and kept plain.
GGUF defaults to the bundled SmolLM2; `--random TYPE` writes a small random Llama instead
(tools/random_gguf.py's llama-3-8b family cut to SMALL: Q4_K is llama-quantize's mix, Q4_K
matrices and a Q6_K head). `--placement default` loads with llama.cpp's own placement (every
matrix its CPU has a repacked kernel for repacked), which is what the engine did before
placement.py: the two side by side say what the placement buys on this CPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import tempfile
import time
from pathlib import Path
from typing import Any

from random_gguf import SHAPES, write

from edgebus.model_import import bundled_gguf
from node_agent.engines import ContextShape, load_engine
from node_agent.engines.llamacpp import library, placement
from node_agent.gguf_model import layout
from node_agent.model_config import load_config

# A Llama small enough for emulation (a few MB): llama-3-8b's family, 512 wide, 4 layers.
SMALL = dataclasses.replace(SHAPES["llama-3-8b"], hidden=512, layers=4, heads=8, kv_heads=4,
                            intermediate=1536, vocab=16384)
# Room for the probes' 16 sequences of 16 positions of history and a few rows more.
SHAPE = ContextShape(kv_budget_bytes=256 * 2**20, positions=64, batch_positions=64)


def llama_cpp_default(gguf: Path) -> tuple[Any, Any]:
    """llama.cpp's own placement: the process's default model parameters, no overrides."""
    return library.llama().llama_model_default_params(), None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", nargs="?", type=Path)
    parser.add_argument("--random", metavar="TYPE", help="a small random Llama of this type")
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--placement", choices=["engine", "default"], default="engine")
    args = parser.parse_args()
    if args.placement == "default":
        setattr(library, "model_params", llama_cpp_default)  # noqa: B010  (this process)
    with tempfile.TemporaryDirectory(prefix="stage-rows-") as tmp:
        gguf = args.gguf or bundled_gguf()
        if args.random:
            gguf = write(SMALL, args.random, Path(tmp) / f"small-{args.random}.gguf")
        chosen = placement.choose(placement.features(library.system_info()),
                                  layout(gguf).tensors)
        table = ("not measured: llama.cpp's own" if chosen is None else
                 f"repacks {', '.join(chosen.repacked) or 'nothing'}")
        print(f"{gguf.name}, {args.placement} placement, {args.threads} thread(s); the "
              f"engine's placement on this build: {table}", flush=True)
        layers = load_config(gguf).num_hidden_layers
        bounds = [layers * i // args.stages for i in range(args.stages + 1)]
        for stage, (first, end) in enumerate(itertools.pairwise(bounds)):
            start = time.monotonic()
            engine = load_engine(gguf, first, end, weights="gguf", threads=args.threads,
                                 shape=SHAPE)
            described = engine.describe()
            print(f"stage-{stage} layers [{first}, {end}): exact_batch "
                  f"{described['exact_batch']}, exact_rows {described['exact_rows']} "
                  f"({time.monotonic() - start:.0f} s)", flush=True)
            engine.close()


if __name__ == "__main__":
    main()
