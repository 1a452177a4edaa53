"""Run llama.cpp's convert_hf_to_gguf.py from a vendored source tree, as a child process.

    python benchmarks/harness/converter.py [--pre-tokenizer NAME] SOURCE -- CONVERTER-ARGS...
        [-- CONVERTER-ARGS...]

Each `--` starts one conversion; several run in turn in this one process, which imports
the converter, torch and transformers once (3.5 of a tiny model's 5 CPU-seconds of
conversion on the 2-core AMD EPYC).

`--pre-tokenizer` names the pre-tokenizer of a tokenizer the converter does
not recognise by its hash (a random test model borrowing SmolLM2's tokenizer,
as imported by edgebus); a llama.cpp stage tokenizes nothing, so the GGUF's
vocabulary only has to load.
"""

from __future__ import annotations

import argparse
import runpy
import sys


def main() -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/harness/converter.py")
    parser.add_argument("source", help="the vendored llama.cpp: convert_hf_to_gguf.py, gguf-py")
    parser.add_argument("--pre-tokenizer")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    sys.path[:0] = [f"{args.source}/gguf-py", args.source]
    if args.pre_tokenizer:
        import conversion.base as base  # the converter's own package, from `source`

        name = args.pre_tokenizer
        base.TextModel.get_vocab_base_pre = lambda self, tokenizer: name
    script = f"{args.source}/convert_hf_to_gguf.py"
    # argparse drops the first `--` on some Pythons and keeps it on others: split on every
    # `--` and drop the empty groups.
    conversions: list[list[str]] = [[]]
    for arg in args.args:
        if arg == "--":
            conversions.append([])
        else:
            conversions[-1].append(arg)
    for conversion in filter(None, conversions):
        sys.argv = [script, *conversion]
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
