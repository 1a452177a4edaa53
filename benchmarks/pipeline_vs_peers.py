"""docs/benchmarks.md in one run: the pipeline against the model in one process and
llama.cpp's own tools, on this machine.

    python benchmarks/pipeline_vs_peers.py --out docs/benchmarks.md

Every plant runs as real processes over a real broker; the one-process baselines
(transformers, llama.cpp), llama-server, llama.cpp RPC and the seed's model shape run
beside it in the same run (benchmarks/harness/). llama.cpp's tools come from
benchmarks/build_peers.py, run once; without them, their rows say so.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import get_args

from edgebus.core.errors import EdgebusError
from harness.results import (
    BENCH_SCRIPT,
    BROKERS,
    DEFAULT_TOKENS,
    QUICK_TOKENS,
    WEIGHT_MODES,
    BenchSettings,
)
from plant_config.schema import WeightMode


def _names(value: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in value.split(",") if name.strip())


def settings(args: argparse.Namespace) -> BenchSettings:
    """The run the command line asks for; EdgebusError names a weight mode that is none."""
    modes: tuple[WeightMode, ...] = get_args(WeightMode)
    names = _names(args.weights)
    unknown = set(names) - set(modes)
    if unknown:
        raise EdgebusError(f"--weights {args.weights}: {', '.join(sorted(unknown))} is no "
                           f"weight mode; choose from {', '.join(modes)}")
    weights = tuple(mode for name in names for mode in modes if mode == name)
    tokens = args.tokens if args.tokens is not None else (
        QUICK_TOKENS if args.quick else DEFAULT_TOKENS)
    return BenchSettings(out=Path(args.out), quick=args.quick, brokers=_names(args.brokers),
                         tokens=tokens, weights=weights,
                         seed_shape=not args.no_seed_shape)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python {BENCH_SCRIPT}",
                                description="measure the pipeline against one-process "
                                            "baselines and llama.cpp's own tools")
    p.add_argument("--out", default="docs/benchmarks.md",
                   help="markdown report to write; the plot goes beside it as .png")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_TOKENS} tokens, concurrency 1 and 4, no pinned-stage phase, "
                        "no seed shape (~14 min on 2 cores)")
    p.add_argument("--brokers", default=",".join(BROKERS),
                   help="comma-separated: amqtt (embedded) and/or mosquitto")
    p.add_argument("--tokens", type=int,
                   help=f"tokens generated per request (default {DEFAULT_TOKENS}, "
                        f"{QUICK_TOKENS} with --quick)")
    p.add_argument("--weights", default=",".join(WEIGHT_MODES),
                   help="weight modes of the 3-stage pipeline, comma-separated: fp32 runs on "
                        "every broker, the others on Mosquitto (default "
                        f"{','.join(WEIGHT_MODES)}); the pinned-stage phase runs fp32 stages, "
                        "so only with fp32. `--weights gguf --brokers mosquitto "
                        "--no-seed-shape`: the llama.cpp plant beside llama.cpp's own tools only")
    p.add_argument("--no-seed-shape", action="store_true",
                   help="skip the seed's model shape (DeepSeek-Coder-1.3B, random weights; "
                        "~5 GB on disk, ~20 min); --quick skips it too")
    return p


def main() -> None:
    try:
        checked = settings(parser().parse_args())
        # Imported once the command line is checked: the runner loads torch and
        # transformers (~9 s on 2 cores), and a mistyped option is refused at once.
        from harness.runner import run_bench
        run_bench(checked)
    except EdgebusError as exc:
        sys.exit(f"{BENCH_SCRIPT}: error: {exc}")


if __name__ == "__main__":
    main()
