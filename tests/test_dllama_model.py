"""tools/dllama_model.py against distributed-llama itself, and the bench's reading of its output.

distributed-llama is a peer the bench builds by hand (docs/benchmarks.md, "Models bigger than
any box"), not a tool of the README's install: these tests run where DLLAMA_DIR names a
checkout with `dllama` built (`make dllama`), and skip elsewhere, CI included.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from dev_tools import dev_tool

from edgebus.core.processes import LOOPBACK, free_port

DLLAMA_DIR = os.environ.get("DLLAMA_DIR")
TOKENS = 8


@pytest.mark.skipif(DLLAMA_DIR is None, reason="DLLAMA_DIR names no distributed-llama build")
def test_distributed_llama_runs_the_written_model_on_a_root_and_a_worker(tmp_path: Path) -> None:
    writer = dev_tool("tools/dllama_model.py")
    bench = dev_tool("benchmarks/bigger_than_any_box.py")
    shape = writer.SHAPES["tiny"]
    writer.write_tokenizer(shape, tmp_path / "tokenizer.t")
    writer.write_model(shape, tmp_path / "model.m")
    binary = str(Path(str(DLLAMA_DIR)) / "dllama")
    prompt_tokens = bench.dllama_prompt_tokens(bench.PROMPT, set(writer.vocabulary(shape)),
                                               shape.add_bos)
    port = free_port()
    worker = subprocess.Popen(["stdbuf", "-oL", binary, "worker", "--host", LOOPBACK,
                               "--port", str(port), "--nthreads", "1"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert worker.stdout is not None
        assert "Listening on" in worker.stdout.readline()
        root = subprocess.run(
            [binary, "inference", "--model", str(tmp_path / "model.m"),
             "--tokenizer", str(tmp_path / "tokenizer.t"), "--buffer-float-type", "q80",
             "--prompt", bench.PROMPT, "--steps", str(prompt_tokens - 1 + TOKENS),
             "--nthreads", "1", "--workers", f"{LOOPBACK}:{port}"],
            capture_output=True, text=True, timeout=120, check=False)
    finally:
        worker.kill()
        worker.wait()
    assert root.returncode == 0, root.stdout[-2000:]
    # The loader found every byte where llm.cpp looks for it (it checks the file's size),
    # the tokenizer split the prompt as the bench counts it, and every token was generated.
    assert "Weights loaded" in root.stdout
    assert f"nTokens: {prompt_tokens - 1}" in root.stdout.split("Evaluation")[1]
    parsed = bench.parse_dllama(root.stdout)
    assert parsed["tokens"] == TOKENS
    assert parsed["decode_tok_s"] > 0 and parsed["root_kb_per_token"] > 0


def test_the_model_file_is_as_long_as_its_header_and_tensors(tmp_path: Path) -> None:
    writer = dev_tool("tools/dllama_model.py")
    shape = writer.SHAPES["tiny"]
    writer.write_model(shape, tmp_path / "model.m")
    data = (tmp_path / "model.m").read_bytes()
    magic, header_size = (int.from_bytes(data[i:i + 4], "little") for i in (0, 4))
    assert magic == writer.MODEL_MAGIC and header_size == 8 + 8 * len(shape.header())
    assert len(data) == writer.model_bytes(shape)
