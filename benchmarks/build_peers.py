"""Build llama.cpp's server and RPC tools, the peers the bench compares with, once.

    python benchmarks/build_peers.py [--jobs N]

From the llama.cpp source vendored in the installed llama-cpp-python's sdist, into
$EDGEBUS_HOME/llama.cpp/<version>/ (benchmarks/harness/peers.py); an interrupted build
resumes where it stopped.
"""

from __future__ import annotations

import argparse
import sys

from edgebus.core.errors import EdgebusError
from harness.peers import BUILD_COMMAND, BUILD_MINUTES, build_tools


def main() -> None:
    parser = argparse.ArgumentParser(
        prog=BUILD_COMMAND,
        description=f"build llama.cpp's server and RPC tools (~{BUILD_MINUTES} min on 2 cores)")
    parser.add_argument("--jobs", type=int, metavar="N",
                        help="compile jobs (default: one per usable core)")
    args = parser.parse_args()
    try:
        build_tools(jobs=args.jobs)
    except EdgebusError as exc:
        sys.exit(f"{BUILD_COMMAND}: error: {exc}")


if __name__ == "__main__":
    main()
