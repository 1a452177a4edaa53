"""The peers the bench compares with: llama.cpp's own tools, built once into a cache.

llama.cpp's server and RPC tools do not ship in any wheel, so BUILD_COMMAND
(benchmarks/build_peers.py) builds them from the source vendored in the llama-cpp-python
sdist of the installed version, into `$EDGEBUS_HOME/llama.cpp/<version>/`:

    <version>/src/            the vendored llama.cpp (convert_hf_to_gguf.py, gguf-py)
    <version>/build/bin/      llama-server, ggml-rpc-server, llama-bench, llama-quantize
    <version>/build.json      written last: what was built, and how

The build runs in a hidden `.<version>.partial` directory beside it and is
renamed into place only once complete, so a killed build never looks usable;
the next build resumes it.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import multiprocessing
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from http import HTTPStatus
from importlib.metadata import PackageNotFoundError, version
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TextIO, TypeVar

from edgebus.core.errors import EdgebusError
from edgebus.core.locks import exclusive
from edgebus.core.paths import edgebus_home
from edgebus.core.processes import LOOPBACK, child_setup, free_port
from harness.metrics import (
    LoadStats,
    StreamStats,
    Trace,
    load_stats,
    marginal_rate,
    stream_stats,
)

T = TypeVar("T")

# The PyPI distribution whose sdist vendors the llama.cpp the bench's in-process
# baseline runs: the peers are then the very same llama.cpp commit.
LLAMA_CPP_PYTHON = "llama-cpp-python"
# The tools the bench runs: single process and parallel slots, RPC workers,
# llama.cpp's own speed check, and quantizing a converted GGUF.
TARGETS = ("llama-server", "ggml-rpc-server", "llama-bench", "llama-quantize")
# On Intel VMs that advertise AMX but do not execute it, llama.cpp's AMX kernels
# die with SIGILL; with GGML_NATIVE the compiler would otherwise enable them.
NO_AMX_FLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# Release with the RPC backend, tuned for this CPU; no curl (nothing may
# download at run time), no tests or examples (minutes of build for nothing).
# RPATH_USE_ORIGIN: the binaries find their shared libraries relative to
# themselves, so they still run after the finished build is renamed into place.
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release", "-DGGML_RPC=ON", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
    f"-DCMAKE_C_FLAGS={NO_AMX_FLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_FLAGS}",
    "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
)
# What the build takes on 2 cores, measured; said up front so nobody kills it as hung.
BUILD_MINUTES = 24
BUILD_COMMAND = "python benchmarks/build_peers.py"
NOT_BUILT = f"not built: run `{BUILD_COMMAND}` (about {BUILD_MINUTES} minutes)"
MARKER_FILE = "build.json"
# Bump when the cache layout or the build's options change, so old caches get rebuilt.
_CACHE_FORMAT = 1
# The build's own progress lines ("[ 42%] Building CXX object ...").
_PROGRESS = re.compile(r"^\[\s*\d+%\]")
# Lines of the build log shown when a step fails: the compiler's error is near the end.
_LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class LlamaTools:
    """A llama.cpp build: its binaries, and the source it was built from."""

    version: str   # of llama-cpp-python, whose sdist vendored the source
    bin_dir: Path  # llama-server, ggml-rpc-server, llama-bench, llama-quantize
    source: Path   # the vendored llama.cpp: convert_hf_to_gguf.py, gguf-py/

    def binary(self, name: str) -> Path:
        return self.bin_dir / name

    @property
    def converter(self) -> Path:
        return self.source / "convert_hf_to_gguf.py"

    @property
    def gguf_py(self) -> Path:
        return self.source / "gguf-py"

    def env(self) -> dict[str, str]:
        """The environment the tools run in: their shared libraries first on the search path."""
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            [str(self.bin_dir), *filter(None, [env.get("LD_LIBRARY_PATH")])])
        return env


@dataclass(frozen=True)
class Skipped:
    """A peer the bench could not measure, and why: the report prints the reason, not a number."""

    reason: str
    crashed: bool = False  # the tool died of a signal (SIGILL on an unsupported CPU, ...)


def installed_version() -> str | None:
    """The installed llama-cpp-python's version, or None if it is not installed."""
    try:
        return version(LLAMA_CPP_PYTHON)
    except PackageNotFoundError:
        return None


def tools_dir(llama_version: str, home: Path | None = None) -> Path:
    """Where the build for `llama_version` lives once complete."""
    return (edgebus_home() if home is None else home) / "llama.cpp" / llama_version


def find_tools(home: Path | None = None) -> LlamaTools | Skipped:
    """The cached build for the installed llama-cpp-python, or why there is none."""
    llama_version = installed_version()
    if llama_version is None:
        return Skipped("llama-cpp-python is not installed (pip install llama-cpp-python), so "
                       "no version to build llama.cpp's tools from")
    root = tools_dir(llama_version, home)
    marker = _read_marker(root)
    if marker is None or marker.get("format") != _CACHE_FORMAT:
        return Skipped(NOT_BUILT)
    tools = _layout(llama_version, root)
    missing = [name for name in TARGETS if not os.access(tools.binary(name), os.X_OK)]
    if missing or not tools.converter.is_file():
        return Skipped(f"{root} lacks {', '.join(missing) or tools.converter.name}: delete it "
                       f"and run `{BUILD_COMMAND}` again")
    return tools


def _layout(llama_version: str, root: Path) -> LlamaTools:
    return LlamaTools(version=llama_version, bin_dir=root / "build" / "bin", source=root / "src")


def _read_marker(root: Path) -> dict[str, object] | None:
    try:
        marker = json.loads((root / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


# -- building ---------------------------------------------------------------------------


def build_tools(*, jobs: int | None = None, home: Path | None = None,
                out: TextIO = sys.stdout) -> LlamaTools:
    """Build llama.cpp's tools for the installed llama-cpp-python into the cache.

    Downloads the matching sdist from PyPI, extracts its vendored llama.cpp and
    builds TARGETS with CMAKE_OPTIONS, `jobs` compile jobs at once (default: one
    per usable core). Returns the tools at once if they are already built.
    Raises EdgebusError saying what to fix.
    """
    llama_version = installed_version()
    if llama_version is None:
        raise EdgebusError("llama-cpp-python is not installed, and its version picks the "
                           "llama.cpp source to build: pip install llama-cpp-python")
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise EdgebusError(f"building llama.cpp needs {tool}, which is not on PATH: "
                               "apt-get install cmake build-essential")
    final = tools_dir(llama_version, home)
    final.parent.mkdir(parents=True, exist_ok=True)
    # One build per version at a time: a second build waits for the first.
    lock = final.parent / f".{llama_version}.lock"
    with exclusive(lock, waiting=lambda: print(f"another build holds {lock}; waiting for it",
                                               file=out, flush=True)):
        found = find_tools(home)
        if isinstance(found, LlamaTools):
            print(f"llama.cpp tools for llama-cpp-python {llama_version} are already built in "
                  f"{final}", file=out)
            return found
        if final.exists():
            raise EdgebusError(f"{final} exists but is not a complete build: delete it and run "
                               f"`{BUILD_COMMAND}` again")
        partial = final.with_name(f".{llama_version}.partial")
        started = time.monotonic()
        print(f"building llama.cpp's tools for llama-cpp-python {llama_version} in {partial} "
              f"(about {BUILD_MINUTES} minutes on 2 cores); an interrupted build resumes here",
              file=out, flush=True)
        tools = _layout(llama_version, partial)
        if not tools.converter.is_file():
            _fetch_source(llama_version, partial, out)
        commit = _compile(tools, partial, jobs or len(os.sched_getaffinity(0)), out)
        marker = {"format": _CACHE_FORMAT, "llama_cpp_python": llama_version,
                  "llama_cpp_commit": commit, "targets": list(TARGETS),
                  "cmake_options": list(CMAKE_OPTIONS),
                  "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
                  "minutes_this_run": round((time.monotonic() - started) / 60, 1)}
        for leftover in partial.glob("sdist-*"):  # an interrupted download's
            shutil.rmtree(leftover, ignore_errors=True)
        (partial / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        os.rename(partial, final)  # atomic: the cache is complete or absent
    print(f"built {', '.join(TARGETS)} (llama.cpp commit {commit}) in {final / 'build' / 'bin'}; "
          f"source in {final / 'src'}", file=out, flush=True)
    return _layout(llama_version, final)


def _fetch_source(llama_version: str, partial: Path, out: TextIO) -> None:
    """Download the sdist and keep its vendored llama.cpp as `partial`/src."""
    partial.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=partial, prefix="sdist-") as tmp:
        print(f"downloading the {LLAMA_CPP_PYTHON} {llama_version} sdist from PyPI", file=out,
              flush=True)
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              "--dest", tmp, f"{LLAMA_CPP_PYTHON}=={llama_version}"], partial / "download.log",
             what=f"downloading the {LLAMA_CPP_PYTHON} {llama_version} sdist (pip download)")
        archives = sorted(Path(tmp).glob("*.tar.gz"))
        if len(archives) != 1:
            raise EdgebusError(f"pip download left {[a.name for a in archives]} in {tmp}, not "
                               f"one {LLAMA_CPP_PYTHON} sdist: check pip's configuration")
        with tarfile.open(archives[0]) as tar:
            tar.extractall(tmp, filter="data")
        vendored = [path for path in Path(tmp).glob("*/vendor/llama.cpp")
                    if (path / "CMakeLists.txt").is_file()]
        if len(vendored) != 1:
            raise EdgebusError(f"{archives[0].name} has no vendor/llama.cpp with a "
                               "CMakeLists.txt: this llama-cpp-python release does not vendor "
                               "llama.cpp the way the bench expects")
        shutil.rmtree(partial / "src", ignore_errors=True)
        os.rename(vendored[0], partial / "src")


def _compile(tools: LlamaTools, partial: Path, jobs: int, out: TextIO) -> str:
    """Configure and build TARGETS in `partial`/build; the llama.cpp commit they report
    ("unknown" when built from an sdist)."""
    build = partial / "build"
    log = partial / "build.log"
    print(f"configuring with CMake (log: {log})", file=out, flush=True)
    _run(["cmake", "-S", str(tools.source), "-B", str(build), *CMAKE_OPTIONS], log,
         what="configuring llama.cpp (cmake)", append=True)  # a resumed build keeps its log
    print(f"compiling {', '.join(TARGETS)} with {jobs} job(s)", file=out, flush=True)
    _run(["cmake", "--build", str(build), "--config", "Release", "-j", str(jobs),
          "--target", *TARGETS], log, what="compiling llama.cpp", out=out, append=True)
    result = subprocess.run([str(tools.binary("llama-server")), "--version"], env=tools.env(),
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise EdgebusError(f"the freshly built llama-server does not run ({result.returncode}): "
                           f"{(result.stderr or result.stdout).strip()[-500:]} — delete "
                           f"{partial} and build again")
    # "unknown" from an sdist: its vendored copy has no git history to read a commit from.
    found = re.search(r"commit ([^\s)]+)", result.stdout + result.stderr)
    return "unknown" if found is None else found.group(1)


def _run(argv: Sequence[str], log: Path, *, what: str, out: TextIO | None = None,
         append: bool = False, env: dict[str, str] | None = None) -> None:
    """Run `argv`, its output into `log`; progress lines also to `out`. Raises with the log's
    tail on failure."""
    with log.open("a" if append else "w") as sink:
        sink.write(f"$ {' '.join(argv)}\n")
        sink.flush()
        with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, bufsize=1, env=env) as proc:
            assert proc.stdout is not None  # stdout=PIPE
            for line in proc.stdout:
                sink.write(line)
                if out is not None and _PROGRESS.match(line):
                    out.write(line)
                    out.flush()
        code = proc.returncode
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
        raise EdgebusError(f"{what} failed (exit {code}); the end of {log}:\n"
                           + "\n".join(tail))


# -- running the tools ------------------------------------------------------------------

# Loading is seconds on one box; over RPC the weights cross loopback first, and a
# 1.3B model on a busy 2-core box needs a minute or more. Only a hung tool takes longer.
READY_TIMEOUT_S = 600.0
# How often a starting tool is asked whether it is up.
_POLL_S = 0.05
# A tool gets this long to exit on SIGTERM (llama-server finishes its slots) before SIGKILL.
STOP_TIMEOUT_S = 10.0
# Far beyond a 256-token completion at concurrency 16 on a slow box: only a stuck server
# (or a dead RPC worker) takes longer.
REQUEST_TIMEOUT_S = 900.0
# Untimed requests after a server comes up: its first pass pays for allocation and
# for ggml building its graphs, as the pipeline's first request does (bench WARMUP_REQUESTS).
WARMUP_REQUESTS = 1
# Context positions per slot beyond prompt + generated tokens: llama-server refuses a
# request that does not fit its slot, and rounding up keeps KV sizes regular.
_CONTEXT_ROUND = 256
# Closed-loop clients start at seeded random offsets, as the pipeline's do
# (harness.runner.ARRIVAL_SEED), so both see the same arrivals.
ARRIVAL_SEED = 20240611
# Independent arrivals: each client starts somewhere in this window (gateway.ARRIVAL_SPREAD_S).
ARRIVAL_SPREAD_S = 0.25
# Lines of a tool's log quoted in an error message.
_TOOL_TAIL_LINES = 25


class ToolProcess:
    """One llama.cpp tool, started on entering and stopped (SIGTERM, then SIGKILL) on leaving,
    Ctrl-C or error included. Its output goes to `log`, quoted when it fails. The kernel
    SIGTERMs it if this process dies first (edgebus.core.processes.child_setup): no orphans."""

    def __init__(self, name: str, argv: Sequence[str], *, env: dict[str, str], log: Path) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = env
        self.log = log
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ToolProcess:
        with self.log.open("wb") as sink:  # the child keeps its own descriptor
            try:
                self._proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=sink,
                                              stderr=subprocess.STDOUT, env=self.env,
                                              preexec_fn=child_setup())
            except OSError as exc:
                raise EdgebusError(f"cannot start {self.argv[0]}: {exc.strerror}: run "
                                   f"`{BUILD_COMMAND}` again") from exc
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self._proc is not None, "not started"
        return self._proc.pid

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def failure(self, what: str) -> EdgebusError:
        """An error saying `what` went wrong, how the tool ended (if it did), and its last lines."""
        code = None if self._proc is None else self._proc.poll()
        if code is None:
            ended = "still running"
        elif code < 0:
            ended = f"killed by {_signal_name(-code)}"
            if -code == signal.SIGILL:
                ended += (" (an instruction this CPU does not execute: rebuild with "
                          f"`{BUILD_COMMAND}` on this machine)")
        else:
            ended = f"exited with {code}"
        try:
            tail = self.log.read_text(errors="replace").splitlines()[-_TOOL_TAIL_LINES:]
        except OSError:
            tail = []
        return EdgebusError(f"{what}: {self.name} {ended}; the end of {self.log}:\n"
                            + "\n".join(tail))


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def context_size(prompt_tokens: int, tokens: int, slots: int) -> int:
    """llama-server's -c: every slot holds a prompt plus its generated tokens (KV is split
    evenly between the slots), rounded up to a multiple of _CONTEXT_ROUND."""
    per_slot = -(-(prompt_tokens + tokens + 1) // _CONTEXT_ROUND) * _CONTEXT_ROUND
    return slots * per_slot


def server_argv(tools: LlamaTools, gguf: Path, *, port: int, threads: int, slots: int,
                context: int, rpc: Sequence[str] = (),
                speculative: Sequence[str] = (), host: str = LOOPBACK,
                tensor_split: Sequence[int] = ()) -> list[str]:
    """The llama-server command line: `slots` parallel slots sharing `context` positions,
    `threads` threads for prompt and generation, with `rpc` every layer on those workers,
    and `speculative` options (LOOKUP_DECODING) added as given; `tensor_split`: the
    layers each RPC worker takes, in proportion (default: by their free memory)."""
    argv = [str(tools.binary("llama-server")), "-m", str(gguf), "--host", host,
            "--port", str(port), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
            "-c", str(context),
            # Every request pays its whole prefill, as in the pipeline: no prompt reuse from
            # the KV cache or from the host-memory prompt cache.
            "--no-cache-prompt", "--cache-ram", "0",
            # The sizes asked for, not ones --fit picks from free memory.
            "-fit", "off", "--no-webui"]
    if rpc:
        argv += ["--rpc", ",".join(rpc), "-ngl", "all"]
    if tensor_split:
        argv += ["--tensor-split", ",".join(map(str, tensor_split))]
    return argv + list(speculative)


def rpc_server_argv(tools: LlamaTools, *, port: int, threads: int,
                    host: str = LOOPBACK) -> list[str]:
    """One ggml-rpc-server on `host`: a CPU device with `threads` threads."""
    return [str(tools.binary("ggml-rpc-server")), "-H", host, "-p", str(port),
            "-t", str(threads)]


# llama.cpp's own prompt-lookup decoding, as llama-server runs it: drafts from n-grams of
# the request's own text, verified k positions in one call. Lookup n-grams of 3 and drafts
# of 10 are prompt lookup's usual setting (transformers' max_ngram_size and
# prompt_lookup_num_tokens); llama-server's defaults (12 and 48) are for long repeats.
LOOKUP_DECODING = ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                   "--spec-ngram-simple-size-m", "10")


def completion_body(ids: Sequence[int], tokens: int) -> dict[str, object]:
    """A /completion request as the bench's are: the token ids as given (no BOS added, no
    template), greedy, exactly `tokens` tokens (EOS ignored), streamed, no prompt cache."""
    return {"prompt": list(ids), "n_predict": tokens, "ignore_eos": True, "temperature": 0.0,
            "top_k": 1, "stream": True, "cache_prompt": False, "return_tokens": True}


class LlamaServer:
    """A running llama-server, and the client the bench measures it with."""

    def __init__(self, process: ToolProcess | Callable[[], int | None], port: int,
                 host: str = LOOPBACK, name: str = "llama-server") -> None:
        self.process = process
        self.port = port
        self.host = host
        self.name = name

    def _running(self) -> bool:
        if isinstance(self.process, ToolProcess):
            return self.process.running()
        return self.process() is None

    def _failure(self, what: str) -> EdgebusError:
        if isinstance(self.process, ToolProcess):
            return self.process.failure(what)
        return EdgebusError(f"{what}: see {self.name}'s log")

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._running():
                raise self._failure("llama-server did not come up")
            try:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=1.0)
                try:
                    conn.request("GET", "/health")
                    if conn.getresponse().status == HTTPStatus.OK:  # 503 while loading
                        return
                finally:
                    conn.close()
            except OSError:
                pass  # not listening yet
            time.sleep(_POLL_S)
        raise self._failure(f"llama-server was not ready after {timeout:.0f} s")

    def complete(self, ids: Sequence[int], tokens: int) -> Trace:
        """One streamed completion, timed where the client sees it."""
        try:
            return _streamed_completion(self.port, ids, tokens, self.host)
        except (OSError, http.client.HTTPException) as exc:
            raise self._failure(f"a completion failed ({exc})") from exc


def _streamed_completion(port: int, ids: Sequence[int], tokens: int,
                         host: str = LOOPBACK) -> Trace:
    body = json.dumps(completion_body(ids, tokens)).encode()
    conn = http.client.HTTPConnection(host, port, timeout=REQUEST_TIMEOUT_S)
    try:
        sent = time.perf_counter()
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != HTTPStatus.OK:
            raise EdgebusError(f"llama-server answered {response.status}: "
                               f"{response.read()[:500].decode(errors='replace')}")
        arrivals: list[tuple[int, float]] = []
        count = 0  # tokens generated so far, as the server counts them
        while line := response.readline():
            now = time.perf_counter()
            if line.startswith(b"error:"):
                raise EdgebusError(f"llama-server stopped the stream: {line.decode().strip()}")
            if not line.startswith(b"data:"):
                continue  # the blank line between events
            event = json.loads(line[len(b"data:"):])
            if "error" in event:
                raise EdgebusError(f"llama-server stopped the stream: {event['error']}")
            # Not len(event["tokens"]): a token that ends inside a UTF-8 character is held
            # back and sent with the next one, and its id is missing from `tokens`.
            predicted = int(event.get("tokens_predicted", count))
            if predicted > count:
                arrivals.append((count, now))
                count = predicted
            if event.get("stop"):
                if count != tokens:
                    raise EdgebusError(
                        f"llama-server generated {count} tokens, not the {tokens} asked for "
                        f"(stop type {event.get('stop_type')!r}): the comparison would be of "
                        "different work")
                return Trace(sent=sent, arrivals=arrivals, done=now, tokens=count)
    finally:
        conn.close()
    raise EdgebusError(f"llama-server closed the stream after {count} of {tokens} tokens, "
                       "without its final event")


@contextmanager
def kept_or_temporary(keep: Path | None, prefix: str = "edgebus-peers-") -> Iterator[Path]:
    """`keep` (kept for a post-mortem), or a temporary directory removed afterwards (errors
    quote the logs' tails, so nothing is lost)."""
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


@contextmanager
def llama_server(tools: LlamaTools, gguf: Path, *, threads: int, slots: int, context: int,
                 logs: Path, rpc: Sequence[str] = (), name: str = "llama-server",
                 speculative: Sequence[str] = ()) -> Iterator[LlamaServer]:
    """A llama-server on a free loopback port, ready to answer; stopped on leaving."""
    _check_gguf(gguf)
    port = free_port()
    argv = server_argv(tools, gguf, port=port, threads=threads, slots=slots, context=context,
                       rpc=rpc, speculative=speculative)
    with ToolProcess(name, argv, env=tools.env(), log=logs / f"{name}.log") as process:
        server = LlamaServer(process, port)
        server.wait_ready()
        yield server


@contextmanager
def rpc_servers(tools: LlamaTools, count: int, *, threads: int,
                logs: Path) -> Iterator[list[int]]:
    """`count` ggml-rpc-servers on free loopback ports, each accepting; yields their ports."""
    with ExitStack() as stack:
        ports: list[int] = []
        for index in range(count):
            port = free_port()
            process = stack.enter_context(ToolProcess(
                f"ggml-rpc-server-{index}", rpc_server_argv(tools, port=port, threads=threads),
                env=tools.env(), log=logs / f"ggml-rpc-server-{index}.log"))
            _wait_listening(process, port)
            ports.append(port)
        yield ports


def _wait_listening(process: ToolProcess, port: int) -> None:
    """Until `port` accepts a connection. The probe's connection is harmless: the server reads
    no hello from it, drops it and accepts the next client."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if not process.running():
            raise process.failure("ggml-rpc-server did not come up")
        try:
            with socket.create_connection((LOOPBACK, port), timeout=1.0):
                return
        except OSError:
            time.sleep(_POLL_S)
    raise process.failure(f"ggml-rpc-server did not listen within {READY_TIMEOUT_S:.0f} s")


def _check_gguf(gguf: Path) -> None:
    if not gguf.is_file():
        raise EdgebusError(f"{gguf} is not a file: give the GGUF the peers should run")


def closed_loop(server: LlamaServer, ids: Sequence[int], tokens: int, *, concurrency: int,
                requests_each: int, seed: int = ARRIVAL_SEED) -> list[Trace]:
    """`concurrency` clients, each sending its next request when its last is answered, starting
    at seeded offsets in the first ARRIVAL_SPREAD_S: harness.gateway.closed_loop's
    arrivals, over HTTP. One thread per client: each waits on its socket."""
    rng = random.Random(seed)
    offsets = [rng.uniform(0.0, ARRIVAL_SPREAD_S) for _ in range(concurrency)]

    def client(offset: float) -> list[Trace]:
        time.sleep(offset)
        return [server.complete(ids, tokens) for _ in range(requests_each)]

    pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="peer-client")
    try:
        futures = [pool.submit(client, offset) for offset in offsets]
        return [trace for future in futures for trace in future.result()]
    finally:
        # On an error or Ctrl-C, do not wait for the other clients: stopping the server
        # (the caller's context) ends their requests.
        pool.shutdown(wait=False, cancel_futures=True)


# -- the measurements -------------------------------------------------------------------


def measure_single(tools: LlamaTools, gguf: Path, ids: Sequence[int], *, tokens: int, runs: int,
                   threads: int, log_dir: Path | None = None) -> StreamStats:
    """llama.cpp in one process: llama-server with one slot, `runs` requests one at a time
    after a warm-up. Raises EdgebusError (with the server's log) if it fails."""
    with kept_or_temporary(log_dir) as logs, llama_server(
            tools, gguf, threads=threads, slots=1, context=context_size(len(ids), tokens, 1),
            logs=logs, name=f"llama-server-t{threads}") as server:
        for _ in range(WARMUP_REQUESTS):
            server.complete(ids, tokens)
        return stream_stats([server.complete(ids, tokens) for _ in range(runs)])


def measure_slots(tools: LlamaTools, gguf: Path, ids: Sequence[int], *, tokens: int,
                  concurrency: Sequence[int], requests_each: int, threads: int,
                  slots: int = 16, seed: int = ARRIVAL_SEED,
                  log_dir: Path | None = None) -> list[LoadStats]:
    """llama-server with `slots` parallel slots (continuous batching), one LoadStats per
    concurrency level, closed-loop clients as the pipeline's bench drives them."""
    _check_concurrency(concurrency, slots)
    with kept_or_temporary(log_dir) as logs, llama_server(
            tools, gguf, threads=threads, slots=slots,
            context=context_size(len(ids), tokens, slots), logs=logs,
            name=f"llama-server-np{slots}-t{threads}") as server:
        for _ in range(WARMUP_REQUESTS):
            server.complete(ids, tokens)
        return [load_stats(level, closed_loop(server, ids, tokens, concurrency=level,
                                              requests_each=requests_each, seed=seed))
                for level in concurrency]


def _check_concurrency(concurrency: Sequence[int], slots: int) -> None:
    if not concurrency or min(concurrency) < 1 or max(concurrency) > slots:
        raise EdgebusError(f"concurrency {list(concurrency)}: give levels from 1 to the "
                           f"server's {slots} slots (more would queue in the server)")


@dataclass(frozen=True)
class RpcRun:
    """llama.cpp RPC: the model's layers split over `servers` ggml-rpc-servers on loopback,
    driven by one llama-server that holds none of them."""

    servers: int
    server_threads: int
    single: StreamStats       # one request at a time
    load: list[LoadStats]     # closed-loop clients, one entry per concurrency level
    wire_bytes_per_token: float | None  # both directions, all RPC connections, decode only
    wire_note: str | None     # why wire_bytes_per_token is None


def measure_rpc(tools: LlamaTools, gguf: Path, ids: Sequence[int], *, tokens: int, runs: int,
                concurrency: Sequence[int], requests_each: int, servers: int = 3,
                server_threads: int = 1, main_threads: int = 1, seed: int = ARRIVAL_SEED,
                log_dir: Path | None = None) -> RpcRun:
    """llama.cpp RPC over `servers` workers of `server_threads` threads each.

    llama-server runs with `-ngl all`, so every layer (and the output head) lives on
    the workers, split by their free memory (evenly, on one box); it keeps the token
    embedding, samples and serves HTTP on `main_threads` threads. It has
    max(concurrency) slots; the single-stream numbers use one of them.
    """
    if servers < 1:
        raise EdgebusError(f"{servers} RPC servers: give at least 1 (2 or 3 to compare with "
                           "a pipeline of as many stages)")
    slots = max(concurrency)
    _check_concurrency(concurrency, slots)
    _check_gguf(gguf)  # before the workers start
    with (kept_or_temporary(log_dir) as logs,
          rpc_servers(tools, servers, threads=server_threads, logs=logs) as ports,
          llama_server(tools, gguf, threads=main_threads, slots=slots,
                       context=context_size(len(ids), tokens, slots), logs=logs,
                       rpc=[f"{LOOPBACK}:{port}" for port in ports],
                       name=f"llama-server-rpc{servers}") as server):
        for _ in range(WARMUP_REQUESTS):
            server.complete(ids, tokens)
        wire, note = _rpc_wire(server, ports, ids, tokens)
        single = stream_stats([server.complete(ids, tokens) for _ in range(runs)])
        load = [load_stats(level, closed_loop(server, ids, tokens, concurrency=level,
                                              requests_each=requests_each, seed=seed))
                for level in concurrency]
    return RpcRun(servers=servers, server_threads=server_threads, single=single, load=load,
                  wire_bytes_per_token=wire, wire_note=note)


def _rpc_wire(server: LlamaServer, ports: Sequence[int], ids: Sequence[int],
              tokens: int) -> tuple[float | None, str | None]:
    """Bytes per decode token on the RPC connections: a 1-token and a `tokens`-token request
    of the same prompt, whose difference is `tokens - 1` decode steps (metrics.marginal_rate),
    counted by the kernel per socket (`ss`), so no other traffic on loopback is counted."""
    if tokens < 2:
        return None, "a 1-token request has no decode step to count"
    counts = [socket_bytes(ports)]
    for count in (1, tokens):
        server.complete(ids, count)
        counts.append(socket_bytes(ports))
    if any(count is None for count in counts):
        return None, "`ss` (iproute2) is not installed, which reads the sockets' byte counters"
    before, short, long = (count for count in counts if count is not None)
    return marginal_rate((short - before, 1), (long - short, tokens)), None


# ss -i prints the kernel's per-connection counters (struct tcp_info).
_SS_BYTES = re.compile(r"\bbytes_(?:acked|received):(\d+)")


def socket_bytes(ports: Sequence[int]) -> int | None:
    """Bytes sent and received so far over the established TCP connections whose local port is
    one of `ports` (here, the servers' side of each), or None without `ss`."""
    ss = shutil.which("ss")
    if ss is None:
        return None
    match = " or ".join(f"sport = :{port}" for port in ports)
    result = subprocess.run([ss, "-tinH", "state", "established", f"( {match} )"],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise EdgebusError(f"ss failed ({result.returncode}): {result.stderr.strip()}")
    return parse_ss_bytes(result.stdout)


def parse_ss_bytes(ss_output: str) -> int:
    """The sum of every connection's bytes_acked (sent, and received by the peer) and
    bytes_received in `ss -ti` output."""
    return sum(int(value) for value in _SS_BYTES.findall(ss_output))


@dataclass(frozen=True)
class PeerRuns:
    """Every peer of one bench run; a peer that could not run says why instead of a number."""

    single: dict[int, StreamStats | Skipped]  # llama-server, one slot, by thread count
    slots: list[LoadStats] | Skipped          # llama-server -np 16
    rpc: RpcRun | Skipped


def run_peers(gguf: Path, ids: Sequence[int], *, tokens: int, runs: int,
              single_threads: Sequence[int], threads: int, concurrency: Sequence[int],
              requests_each: int, rpc_servers: int = 3, rpc_threads: int = 1,
              slots: int = 16, tools: LlamaTools | Skipped | None = None,
              log_dir: Path | None = None) -> PeerRuns:
    """All the peers on `gguf`, one after another (never two at once: they share the cores).

    `single_threads`: the thread counts of the single-process runs; `threads`: those of
    the -np server. A peer that fails (a crashed tool, a refused request) becomes
    Skipped with the error; missing tools skip every peer with NOT_BUILT.
    """
    found = find_tools() if tools is None else tools
    if isinstance(found, Skipped):
        return PeerRuns(single=dict.fromkeys(single_threads, found), slots=found, rpc=found)
    single = {count: _attempt(partial(measure_single, found, gguf, ids, tokens=tokens,
                                      runs=runs, threads=count, log_dir=log_dir))
              for count in single_threads}
    loaded = _attempt(partial(measure_slots, found, gguf, ids, tokens=tokens,
                              concurrency=concurrency, requests_each=requests_each,
                              threads=threads, slots=slots, log_dir=log_dir))
    rpc = _attempt(partial(measure_rpc, found, gguf, ids, tokens=tokens, runs=runs,
                           concurrency=concurrency, requests_each=requests_each,
                           servers=rpc_servers, server_threads=rpc_threads, log_dir=log_dir))
    return PeerRuns(single=single, slots=loaded, rpc=rpc)


def _attempt(measure: Callable[[], T]) -> T | Skipped:
    try:
        return measure()
    except EdgebusError as exc:
        return Skipped(str(exc))


# -- llama.cpp through llama-cpp-python, in a child process -----------------------------

# The context llama-cpp-python gets: the chat prompt plus the longest --tokens anyone runs.
LLAMA_CPP_PYTHON_CONTEXT = 2048
# Loading a GGUF plus warm-up and the measured runs; a child past this is stuck.
_CHILD_TIMEOUT_S = 1800.0


def llama_cpp_python_single(gguf: Path, ids: Sequence[int], *, tokens: int, runs: int,
                            threads: int, extra_bufts: bool = True) -> StreamStats | Skipped:
    """Single stream on llama.cpp through llama-cpp-python, in a child process.

    In the bench's own process, a crash inside llama.cpp would take the bench with it:
    on Intel VMs that advertise AMX but do not execute it, llama.cpp dies with SIGILL
    in `ggml_backend_amx_mul_mat`. Here the child dies instead and this returns
    Skipped with the reason. `extra_bufts=False` keeps llama.cpp off its extra CPU
    buffer types: AMX, and the repacked layouts of Q4_0, Q8_0, IQ4_NL and the K-quants
    (not Q4_1). That avoids the crash, and the repacked kernels too; llama.cpp's
    default is True.
    """
    if importlib.util.find_spec("llama_cpp") is None:
        return Skipped("llama-cpp-python is not installed (pip install llama-cpp-python)")
    _check_gguf(gguf)
    result = in_child(_llama_cpp_python_child,
                      (str(gguf), list(ids), tokens, runs, threads, extra_bufts),
                      what="llama-cpp-python", timeout=_CHILD_TIMEOUT_S)
    if isinstance(result, Skipped):
        return result
    if isinstance(result, str):
        return Skipped(f"llama-cpp-python failed: {result}")
    return stream_stats([Trace(*fields) for fields in result])


def in_child(target: Callable[..., None], args: tuple[object, ...], *, what: str,
             timeout: float) -> Any:
    """What `target(sender, *args)` sends, run in a fresh child interpreter; Skipped, with the
    reason, if the child dies without sending anything (crashed=True for a signal) or sends
    nothing within `timeout` seconds (it is killed then). `target` and `args` must pickle."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked threads
    receiver, sender = context.Pipe(duplex=False)
    # daemon: the child is ended if this process exits first.
    child = context.Process(target=target, name=what, args=(sender, *args), daemon=True)
    child.start()
    sender.close()  # else this process's copy would keep the pipe open after the child died
    answered = False
    result: Any = None
    try:
        if receiver.poll(timeout):
            result = receiver.recv()
            answered = True
    except EOFError:
        pass  # the child died without a word: a signal, most likely
    finally:
        # A child that answered exits by itself; one that did not is dying, or stuck.
        child.join(None if answered else STOP_TIMEOUT_S)
        stuck = child.is_alive()
        if stuck:
            child.kill()
            child.join()
        receiver.close()
    if answered:
        return result
    if stuck:
        return Skipped(f"{what} gave no result within {timeout:.0f} s")
    code = child.exitcode
    if code is not None and code < 0:
        how = f"died of {_signal_name(-code)}"
        if -code == signal.SIGILL:
            how += " (an instruction this CPU does not execute, such as AMX on some Intel VMs)"
        return Skipped(f"{what} {how}", crashed=True)
    return Skipped(f"{what} ended with exit code {code} and no result")


def _llama_cpp_python_child(sender: Connection, gguf: str, ids: list[int], tokens: int,
                            runs: int, threads: int, extra_bufts: bool) -> None:
    """The child's side: measure, then send a list of Trace fields, or an error's text."""
    try:
        traces = _llama_cpp_python_traces(gguf, ids, tokens, runs, threads, extra_bufts)
        sender.send([(t.sent, t.arrivals, t.done, t.tokens) for t in traces])
    except Exception as exc:  # the parent reports it; a traceback here would be lost
        sender.send(f"{type(exc).__name__}: {exc}")
    finally:
        sender.close()


def _llama_cpp_python_traces(gguf: str, ids: list[int], tokens: int, runs: int, threads: int,
                             extra_bufts: bool) -> list[Trace]:
    import llama_cpp.llama_cpp as lib
    from llama_cpp import Llama

    from node_agent.engines.llamacpp import library

    if not extra_bufts:
        library.keep_off_extra_buffers(lib)  # this child process only
    llm = Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads,
                n_ctx=LLAMA_CPP_PYTHON_CONTEXT, verbose=False)
    try:
        def one() -> Trace:
            llm.reset()  # type: ignore[no-untyped-call]  # else it reuses the cached prompt
            times: list[float] = []
            sent = time.perf_counter()
            # top_k=1 is greedy; the generator never stops on EOS by itself.
            for _ in llm.generate(ids, top_k=1, temp=0.0):
                times.append(time.perf_counter())
                if len(times) == tokens:
                    break
            return Trace(sent=sent, arrivals=list(enumerate(times)), done=times[-1],
                         tokens=len(times))

        for _ in range(WARMUP_REQUESTS):
            one()
        return [one() for _ in range(runs)]
    finally:
        llm.close()
