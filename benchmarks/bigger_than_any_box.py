"""The bench section "Models bigger than any box" of docs/benchmarks.md, made in one run.

One after another, on the same rehearsed boxes (edgebus/rehearse: a network
namespace, a CPU quota and a memory limit per box of the plant file's
`boxes:`, never two systems at once):

1. the edgebus plant, as `edgebus rehearse` runs it: first start (cut and
   load, from a cold page cache), one request, then CONCURRENCY at once;
2. llama.cpp RPC: a ggml-rpc-server in each stage's box, llama-server on the
   broker's box with every layer on the workers (-ngl all), split as the
   plant splits them (--tensor-split);
3. distributed-llama: its root and workers on 2^n boxes of the same total CPU
   quota and memory (tensor parallelism splits evenly, so the boxes are even);
   its model written by tools/dllama_model.py;
4. the whole model on the broker's box alone, with that box's quota and limit.

Beside each measurement of the plant, the rehearsal's prediction
(edgebus/rehearse/report.py). The results go to a JSON file, from which the
section is written (`--write`); `--from-json` writes it again without running.

    sudo python benchmarks/bigger_than_any_box.py PLANT.yaml --dllama DIR \
        --dllama-model DIR --out RESULTS.json --write docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from edgebus.core.errors import EdgebusError
from edgebus.core.processes import proc_status_bytes
from edgebus.rehearse import Options, Rehearsal, Workload, one_box_variant
from edgebus.rehearse.disk import drop_from_cache
from edgebus.rehearse.report import Prediction, predict
from edgebus.rehearse.workload import Client, Measurement, decode_step_ms, measure, wait_online
from harness.metrics import Trace, load_stats, stream_stats
from harness.peers import (
    LlamaServer,
    LlamaTools,
    closed_loop,
    context_size,
    find_tools,
    kept_or_temporary,
    rpc_server_argv,
    server_argv,
)
from node_agent.costs import model_costs, profiled_model
from node_agent.fit import memory_costs
from plant_config import Plant, load_plant
from plant_config.schema import BoxSpec, resolve_engine

MIB = 1 << 20
# The plant question every system answers; its tokens differ per tokenizer (reported).
PROMPT = ("Machine 7 on line 3 raised alarm 4711, spindle overload. "
          "What should the operator check first?")
# Tokens of the warm-up request; the difference to the measured request's bytes on the links
# is what the extra decode steps move (bytes per decode token, prompt excluded).
WARMUP_TOKENS = 4
# Cutting a multi-GB GGUF into stage files and loading them on fractions of a core.
FIRST_START_TIMEOUT_S = 3600.0
# Ports inside the boxes: each box has its own namespace, so fixed ports cannot collide.
RPC_PORT = 50052
SERVER_PORT = 8080
DLLAMA_PORT = 9998
# The peers' processes on a box's quota (at most one core, sizing.MAX_BOX_CORES).
PEER_THREADS = 1
# distributed-llama reads its activations back as Q80 (its documented setting for Q40).
DLLAMA_BUFFER_TYPE = "q80"
DLLAMA_TIMEOUT_S = 3600.0
_POLL_S = 0.2
# What one run measures, in this order.
STEPS = ("plant", "dllama_share", "dllama", "rpc", "one_box")
# Lines of a failed system's log the section quotes.
_LOG_LINES = 4
# The section's heading in docs/benchmarks.md.
SECTION = "## Models bigger than any box"


def say(text: str) -> None:
    print(text, flush=True)


def cold(*paths: Path) -> None:
    """Drop `paths` from the page cache, so each system reads its model from disk at start
    and its boxes are charged for the pages they read (a page stays charged to the control
    group that first read it)."""
    drop_from_cache(paths)


def peak_rss(pid: int) -> int | None:
    try:
        return proc_status_bytes(Path(f"/proc/{pid}/status").read_text(), "VmHWM")
    except (OSError, ValueError):
        return None


def memory_report(rehearsal: Rehearsal) -> dict[str, Any]:
    """Per box: its limit, the control group's peak (page cache it read included) and its
    OOM kills; per process still running: its peak RSS."""
    boxes = {share.box: {"limit_mib": share.memory_bytes / MIB,
                         "cores": share.cpu_cores,
                         "peak_mib": _mib(rehearsal.groups[share.box].peak_bytes()),
                         "oom_kills": rehearsal.groups[share.box].oom_kills()}
             for share in rehearsal.shares}
    processes = {name: {"box": rehearsal.box_of[name], "peak_rss_mib": _mib(peak_rss(proc.pid))}
                 for name, proc in rehearsal.procs.items() if proc.poll() is None}
    return {"boxes": boxes, "processes": processes}


def _mib(n_bytes: int | None) -> float | None:
    return None if n_bytes is None else n_bytes / MIB


def link_bytes(rehearsal: Rehearsal) -> int:
    """Bytes over all the boxes' links, each message once (it leaves one box and enters
    another, so the sum of both directions counts it twice)."""
    return sum(sum(link.counters()) for link in rehearsal.network.links.values()) // 2


def _failure(rehearsal: Rehearsal, exc: BaseException) -> dict[str, Any]:
    return {"error": str(exc)[-1500:], **memory_report(rehearsal)}


# -- 1. the plant --------------------------------------------------------------------------


def stage_shares(plant: Plant) -> dict[str, dict[str, float]]:
    """Per stage: the GGUF bytes its stage file holds (its layers, the embedding on the
    first, the head and llama.cpp's embedding stand-in on the last: ModelCosts.weight_bytes)
    and its KV budget, in MiB: the target is peak RSS <= both + 100 MiB."""
    costs = memory_costs(plant.model)
    return {spec.node: {"gguf_mib": costs.weight_bytes(spec.layers, "gguf") / MIB,
                        "kv_mib": float(spec.kv_budget_mb)} for spec in plant.stages}


def predictions(plant: Plant, options: Options, concurrency: int, prompt_tokens: int,
                tokens: int) -> dict[str, Any]:
    """The rehearsal's prediction for one request and for `concurrency`, from the planner's
    profile of the model (`edgebus plan` measures it once; minutes for an 8B model)."""
    from edgebus.rehearse.sizing import box_shares, broker_box, coordinator_box

    costs, _, _ = model_costs(profiled_model(
        plant.model, {resolve_engine(s.engine, s.weights) for s in plant.stages}))
    shares = box_shares(plant, cpu_total=options.cpu_total, memory_scale=options.memory_scale)
    broker = broker_box(plant, shares, options.broker_box)
    coordinator = coordinator_box(shares, broker, options.coordinator_box)
    groups = options.batch_groups or len(plant.pipeline)

    def one(requests: int) -> Prediction:
        return predict(plant, costs, shares, requests, groups, broker, coordinator,
                       prompt_tokens=prompt_tokens, tokens=tokens)

    single, many = one(1), one(concurrency)
    return {"single_tok_s": single.tok_s, "concurrent_tok_s": many.tok_s,
            "single_answered_tok_s": single.answered_tok_s,
            "concurrent_answered_tok_s": many.answered_tok_s, "ttft_s": single.ttft_s,
            "step_ms": single.step_ms, "hop_ms": single.hop_ms}


def _measured(m: Measurement) -> dict[str, Any]:
    return {"requests": m.requests, "tokens": m.tokens, "wall_s": m.wall_s,
            "ttft_s": statistics.median(m.ttft_s) if m.ttft_s else None,
            "decode_tok_s": m.decode_tok_s, "tok_s": m.tokens / m.wall_s if m.wall_s else None,
            "errors": m.errors,
            "steps": {box: after.steps - before.steps for box, (before, after) in m.boxes.items()},
            "rows": {box: after.rows - before.rows for box, (before, after) in m.boxes.items()},
            "step_ms": {box: (after.compute_s - before.compute_s) * 1000
                        / max(1.0, after.steps - before.steps)
                        for box, (before, after) in m.boxes.items()},
            # Passes of decode rows alone: what the prediction's step is, and what bounds a
            # lone request's rate (one decode pass of every stage a token).
            "decode_step_ms": {box: decode_step_ms(before, after)
                               for box, (before, after) in m.boxes.items()},
            "major_faults": {box: after.major_faults - before.major_faults
                             for box, (before, after) in m.boxes.items()},
            "link_bytes": sum(after.bytes_in - before.bytes_in + after.bytes_out
                              - before.bytes_out for before, after in m.boxes.values()) // 2}


async def _plant_phases(rehearsal: Rehearsal, tokens: int, concurrency: int,
                        started: float, result: dict[str, Any]) -> None:
    """Into `result` as each phase ends, so a later phase's failure keeps the earlier ones."""
    since = time.time()
    rehearsal.start()
    async with Client(rehearsal.plant) as client:
        await wait_online(rehearsal, client, since=since, timeout=FIRST_START_TIMEOUT_S)
        result["first_start_s"] = time.monotonic() - started
        say(f"plant online after {result['first_start_s']:.0f} s")
        warm = await measure(rehearsal, client, Workload(1, WARMUP_TOKENS, PROMPT), "w-")
        result["warmup"] = _measured(warm)
        single = await measure(rehearsal, client, Workload(1, tokens, PROMPT), "s-")
        result["single"] = _measured(single)
        say(f"plant, one request: {single.decode_tok_s:.2f} tok/s")
        many = await measure(rehearsal, client, Workload(concurrency, tokens, PROMPT), "c-")
        result["concurrent"] = _measured(many)
        say(f"plant, {concurrency} requests: {many.decode_tok_s:.2f} tok/s")
        responses = client.observer.responses
        result["answers"] = [responses[f"{prefix}{i}"].tokens
                             for prefix, count in (("s-", 1), ("c-", concurrency))
                             for i in range(count)]
        result.update(memory_report(rehearsal))


def run_plant(plant: Plant, options: Options, workdir: Path, tokens: int,
              concurrency: int) -> dict[str, Any]:
    cold(plant.model)
    started = time.monotonic()
    result: dict[str, Any] = {}
    with Rehearsal(plant, workdir, options, progress=say) as rehearsal:
        try:
            asyncio.run(_plant_phases(rehearsal, tokens, concurrency, started, result))
        except EdgebusError as exc:
            result.update(_failure(rehearsal, exc))
    result["shares"] = stage_shares(plant)
    result["layers"] = {spec.node: list(spec.layers) for spec in plant.stages}
    return result


def whole_answer(plant_path: Path, tokens: int) -> list[int]:
    """llama.cpp's answer to PROMPT with the whole GGUF, in a process of its own outside
    every box (tools/whole_answer.py): what each of the plant's answers must equal."""
    tool = Path(__file__).resolve().parent.parent / "tools" / "whole_answer.py"
    out = subprocess.run([sys.executable, str(tool), str(plant_path), "--prompt", PROMPT,
                          "--tokens", str(tokens), "--ignore-eos"],
                         check=True, capture_output=True, text=True)
    answer: list[int] = json.loads(out.stdout)
    return answer


def run_one_box(plant: Plant, options: Options, workdir: Path, box: str) -> dict[str, Any]:
    """The whole model on `box` alone: refused, killed, or what it answers at."""
    alone, alone_options = one_box_variant(plant, box, options)
    cold(plant.model)
    started = time.monotonic()
    result: dict[str, Any] = {"box": box}
    with Rehearsal(alone, workdir, alone_options, progress=say) as rehearsal:
        try:
            asyncio.run(_plant_phases(rehearsal, WARMUP_TOKENS, 1, started, result))
        except EdgebusError as exc:
            result.update(_failure(rehearsal, exc))
    return result


# -- 2. llama.cpp RPC ----------------------------------------------------------------------


def _wait_port(rehearsal: Rehearsal, name: str, address: str, port: int,
               timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if name in rehearsal.dead():
            raise EdgebusError(f"{name} exited with code {rehearsal.dead()[name]}:\n"
                               f"{rehearsal.log_tail(name)}")
        try:
            with socket.create_connection((address, port), timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise EdgebusError(f"{name} did not listen on {address}:{port}") from None
            time.sleep(_POLL_S)


def run_rpc(plant: Plant, options: Options, workdir: Path, tools: LlamaTools,
            ids: Sequence[int], tokens: int, concurrency: int) -> dict[str, Any]:
    cold(plant.model)
    started = time.monotonic()
    with Rehearsal(plant, workdir, options, progress=say) as rehearsal:
        rehearsal.build_boxes()
        try:
            workers = []
            for spec in plant.stages:
                address = rehearsal.address(spec.node)
                name = f"rpc-{spec.node}"
                rehearsal.spawn(name, spec.node, rpc_server_argv(
                    tools, port=RPC_PORT, threads=PEER_THREADS, host=address), env=tools.env())
                _wait_port(rehearsal, name, address, RPC_PORT, 60.0)
                workers.append(f"{address}:{RPC_PORT}")
            host = rehearsal.address(rehearsal.broker_box)
            rehearsal.spawn("llama-server", rehearsal.broker_box, server_argv(
                tools, plant.model, port=SERVER_PORT, threads=PEER_THREADS, slots=concurrency,
                context=context_size(len(ids), tokens, concurrency), rpc=workers, host=host,
                tensor_split=[end - first for first, end in (s.layers for s in plant.stages)]),
                env=tools.env())
            process = rehearsal.procs["llama-server"]
            server = LlamaServer(process.poll, SERVER_PORT, host, "llama-server")
            server.wait_ready(FIRST_START_TIMEOUT_S)
            first_start = time.monotonic() - started
            say(f"RPC ready after {first_start:.0f} s")
            before = link_bytes(rehearsal)
            server.complete(ids, WARMUP_TOKENS)
            short = link_bytes(rehearsal)
            single = server.complete(ids, tokens)
            long = link_bytes(rehearsal)
            say(f"RPC, one request: {_decode_tok_s([single]):.2f} tok/s")
            many = closed_loop(server, ids, tokens, concurrency=concurrency, requests_each=1)
            say(f"RPC, {concurrency} requests: {_decode_tok_s(many):.2f} tok/s")
        except EdgebusError as exc:
            return _failure(rehearsal, exc)
        report = memory_report(rehearsal)
    stats = stream_stats([single])
    load = load_stats(concurrency, many)
    return {"first_start_s": first_start, "prompt_tokens": len(ids),
            "single": {"tok_s": stats.tok_s, "decode_tok_s": _decode_tok_s([single]),
                       "ttft_s": stats.ttft_s},
            "concurrent": {"tok_s": load.tok_s, "decode_tok_s": _decode_tok_s(many),
                           "ttft_s": load.ttft_p50_s, "wall_s": load.wall_s},
            "wire_bytes_per_token": ((long - short) - (short - before))
            / (tokens - WARMUP_TOKENS),
            **report}


def _decode_tok_s(traces: Sequence[Trace]) -> float:
    """Summed over requests, each from its first token to its last: as the rehearsal's
    `decode_tok_s` counts the plant's."""
    return sum((trace.tokens - 1) / (trace.done - trace.arrivals[0][1]) for trace in traces
               if trace.tokens > 1 and trace.done > trace.arrivals[0][1])


# -- 3. distributed-llama ------------------------------------------------------------------


def _wait_log(rehearsal: Rehearsal, name: str, line: str, timeout: float) -> None:
    """Until `name`'s log says `line`. Not a probe connection: a distributed-llama worker
    takes the first connection for its root's and exits when it closes."""
    deadline = time.monotonic() + timeout
    while line not in rehearsal.log_tail(name):
        if name in rehearsal.dead() or time.monotonic() > deadline:
            raise EdgebusError(f"{name} did not say {line!r}:\n{rehearsal.log_tail(name)}")
        time.sleep(_POLL_S)


def dllama_plant(plant: Plant, options: Options, nodes: int,
                 root_memory_mb: int | None = None) -> tuple[Plant, Options]:
    """`nodes` even boxes with the plant's total CPU quota and memory: tensor parallelism
    gives every node the same slice, so uneven boxes would wait on the slowest. The root's
    box gets `root_memory_mb` instead where given: the root alone holds the F32 embedding."""
    from edgebus.rehearse.sizing import box_shares

    shares = box_shares(plant, cpu_total=options.cpu_total, memory_scale=options.memory_scale)
    memory_mb = sum(share.memory_bytes for share in shares) // MIB // nodes
    boxes = [BoxSpec(name=f"dllama-{index}",
                     memory_mb=root_memory_mb if index == 0 and root_memory_mb else memory_mb,
                     speed=1.0)
             for index in range(nodes)]
    even = plant.model_copy(update={"boxes": boxes})
    return even, Options(cpu_total=sum(share.cpu_cores for share in shares),
                         broker_box=boxes[0].name)


def dllama_prompt_tokens(prompt: str, vocabulary: set[bytes], add_bos: bool) -> int:
    """How many tokens distributed-llama's tokenizer (src/tokenizer.cpp, `encode`) makes of
    `prompt` with tools/dllama_model.py's vocabulary: every byte a token, then the pair whose
    merge is the longest token merged first, until none merges."""
    pieces = [bytes([b]) for b in prompt.encode()]
    while True:
        best = max(((len(a + b), i) for i, (a, b) in enumerate(itertools.pairwise(pieces))
                    if a + b in vocabulary), default=None)
        if best is None:
            return len(pieces) + int(add_bos)
        index = best[1]
        pieces[index:index + 2] = [pieces[index] + pieces[index + 1]]


_EVAL = re.compile(r"Eval\s*(\d+) ms Sync\s*(\d+) ms")
_PRED = re.compile(r"Pred\s*(\d+) ms Sync\s*(\d+) ms \| Sent\s*(\d+) kB Recv\s*(\d+) kB")


def parse_dllama(log: str) -> dict[str, Any]:
    """distributed-llama's own per-step lines: prompt batches ("Eval") and generated tokens
    ("Pred", with the root's bytes sent and received over its sockets for the step)."""
    evals = [int(a) + int(b) for a, b in _EVAL.findall(log)]
    preds = [(int(a) + int(b), int(sent) + int(recv)) for a, b, sent, recv in _PRED.findall(log)]
    if not preds:
        raise EdgebusError(f"distributed-llama generated nothing:\n{log[-1500:]}")
    ms = [step for step, _ in preds]
    return {"prompt_ms": sum(evals), "tokens": len(preds),
            "ttft_s": (sum(evals) + ms[0]) / 1000,
            "decode_tok_s": (len(ms) - 1) * 1000 / sum(ms[1:]) if len(ms) > 1 else None,
            "tok_s": len(ms) * 1000 / (sum(evals) + sum(ms)),
            "root_kb_per_token": statistics.mean(kb for _, kb in preds[1:] or preds)}


def run_dllama(plant: Plant, options: Options, workdir: Path, binary: Path, model_dir: Path,
               nodes: int, tokens: int, root_memory_mb: int | None = None) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import dllama_model

    even, even_options = dllama_plant(plant, options, nodes, root_memory_mb)
    shape = next(s for s in dllama_model.SHAPES.values()
                 if dllama_model.model_bytes(s) == (model_dir / "model.m").stat().st_size)
    prompt_tokens = dllama_prompt_tokens(PROMPT, set(dllama_model.vocabulary(shape)),
                                         shape.add_bos)
    cold(model_dir / "model.m")
    started = time.monotonic()
    with Rehearsal(even, workdir, even_options, progress=say) as rehearsal:
        rehearsal.build_boxes()
        try:
            workers = []
            for share in rehearsal.shares[1:]:
                address = rehearsal.address(share.box)
                name = f"worker-{share.box}"
                rehearsal.spawn(name, share.box, ["stdbuf", "-oL", str(binary), "worker",
                                                  "--host", address,
                                                  "--port", str(DLLAMA_PORT),
                                                  "--nthreads", str(PEER_THREADS)])
                _wait_log(rehearsal, name, "Listening on", 60.0)
                workers.append(f"{address}:{DLLAMA_PORT}")
            root = rehearsal.shares[0].box
            # The prompt fills steps up to its last token; the rest are generated.
            rehearsal.spawn("root", root, [
                "stdbuf", "-oL", str(binary), "inference", "--model", str(model_dir / "model.m"),
                "--tokenizer", str(model_dir / "tokenizer.t"),
                "--buffer-float-type", DLLAMA_BUFFER_TYPE, "--prompt", PROMPT,
                "--steps", str(prompt_tokens - 1 + tokens), "--nthreads", str(PEER_THREADS),
                "--max-seq-len", str(prompt_tokens + tokens), "--workers", *workers])
            loaded = None
            peaks: dict[str, Any] = {}
            deadline = time.monotonic() + DLLAMA_TIMEOUT_S
            while rehearsal.procs["root"].poll() is None:
                if loaded is None and "Weights loaded" in rehearsal.log_tail("root"):
                    loaded = time.monotonic() - started
                    say(f"distributed-llama loaded after {loaded:.0f} s")
                peaks = memory_report(rehearsal)  # the last sample before the root exits
                if time.monotonic() > deadline:
                    raise EdgebusError(f"distributed-llama did not finish in "
                                       f"{DLLAMA_TIMEOUT_S:.0f} s")
                time.sleep(_POLL_S)
            log = (rehearsal.workdir / "logs" / "root.log").read_text(errors="replace")
            code = rehearsal.procs["root"].returncode
            if code != 0:
                raise EdgebusError(f"distributed-llama's root exited with code {code}:\n"
                                   f"{log[-1500:]}")
            result = parse_dllama(log)
        except EdgebusError as exc:
            return {"nodes": nodes, "root_memory_mb": root_memory_mb,
                    **_failure(rehearsal, exc)}
        peaks["boxes"] = memory_report(rehearsal)["boxes"]
    say(f"distributed-llama, one request: {result['decode_tok_s']:.2f} tok/s")
    return {"nodes": nodes, "root_memory_mb": root_memory_mb, "first_start_s": loaded,
            "prompt_tokens": prompt_tokens, "single": result, **peaks}


# -- the report ----------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "load_before": os.getloadavg()[0],
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def _f(value: float | None, digits: int = 2, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}x"


def render(results: dict[str, Any]) -> str:
    """The section, from `results` as main() saved them."""
    m = results["machine"]
    plant, rpc, dl = results.get("plant", {}), results.get("rpc", {}), results.get("dllama", {})
    lines = [heading(results), "",
             f"{results['model']}, on the plant file's boxes rehearsed on one machine "
             f"({m['cpu']}, {m['cores']} vCPUs shared with other work: load average "
             f"{m['load_before']:.1f} at the start, {m.get('load_after', 0):.1f} at the end; "
             f"{m['date']}). Made by `{results['command']}`; every system in turn on the "
             f"same CPU quotas and memory limits, each started from a cold page cache. "
             f"{results['tokens']} generated tokens per request.", ""]
    if results.get("note"):  # how the results were put together, where not by one run
        lines += [results["note"], ""]
    boxes = plant.get("boxes") or rpc.get("boxes") or {}
    lines += ["Boxes: " + ", ".join(f"{box} {info['cores']:.2f} cores, "
                                    f"{info['limit_mib']:.0f} MiB" for box, info in boxes.items())
              + (f"; layers {plant['layers']}" if "layers" in plant else ""), ""]
    header = "| | edgebus plant | predicted | llama.cpp RPC | distributed-llama |"
    lines += [header, "|---|---|---|---|---|"]
    pred = plant.get("predicted", {})

    def row(label: str, ours: str, predicted: str, theirs: str, dllama: str) -> None:
        lines.append(f"| {label} | {ours} | {predicted} | {theirs} | {dllama} |")

    ps, pc = plant.get("single", {}), plant.get("concurrent", {})
    rs, rc = rpc.get("single", {}), rpc.get("concurrent", {})
    ds = dl.get("single", {})
    row("one request, decode tok/s", _f(ps.get("decode_tok_s")), _f(pred.get("single_tok_s")),
        _f(rs.get("decode_tok_s")), _f(ds.get("decode_tok_s")))
    row(f"{results['concurrency']} at once, aggregate decode tok/s",
        _f(pc.get("decode_tok_s")), _f(pred.get("concurrent_tok_s")),
        _f(rc.get("decode_tok_s")),
        "one at a time (dllama-api serves one request per connection, in turn)")
    row("one request, answered tok/s (sent to answered)", _f(ps.get("tok_s")),
        _f(pred.get("single_answered_tok_s")), _f(rs.get("tok_s")), _f(ds.get("tok_s")))
    row(f"{results['concurrency']} at once, answered tok/s (first sent to last answered)",
        _f(pc.get("tok_s")), _f(pred.get("concurrent_answered_tok_s")), _f(rc.get("tok_s")),
        "-")
    row("TTFT, one request (s)", _f(ps.get("ttft_s")), _f(pred.get("ttft_s")),
        _f(rs.get("ttft_s")),
        _f(ds.get("ttft_s")))
    row(f"TTFT, {results['concurrency']} at once, median (s)", _f(pc.get("ttft_s")), "-",
        _f(rc.get("ttft_s")), "-")
    row("first start: cut + load (s)", _f(plant.get("first_start_s"), 0), "-",
        _f(rpc.get("first_start_s"), 0), _f(dl.get("first_start_s"), 0))
    wire = None
    if "warmup" in plant and ps:
        extra = results["tokens"] - WARMUP_TOKENS
        wire = (ps["link_bytes"] - plant["warmup"]["link_bytes"]) / extra
    row("bytes on the wire per decode token", _f(wire and wire / 1024, 1, " KiB"), "-",
        _f(rpc.get("wire_bytes_per_token") and rpc["wire_bytes_per_token"] / 1024, 1, " KiB"),
        _f(ds.get("root_kb_per_token"), 1, " kB (root's sockets)"))
    exact = plant.get("exact")
    if exact:
        row("answers token-exact against llama.cpp whole",
            f"{exact['equal']} of {exact['answers']}", "-", "-", "-")
    lines += ["", _prompts(results), ""]
    lines += _ratios(results)
    lines += _memory(results)
    lines += _failures(results)
    return "\n".join(lines) + "\n"


def _prompts(results: dict[str, Any]) -> str:
    dl = results.get("dllama", {})
    root = dl.get("root_memory_mb")
    share = results.get("dllama_share", {})
    outcome = ("answered" if share and not share.get("error") else
               "failed (below)" if share else "was not run")
    return (f"The prompt is one plant question: {results.get('prompt_tokens', '-')} tokens with "
            f"the GGUF's vocabulary (plant, RPC), {dl.get('prompt_tokens', '-')} with "
            "tools/dllama_model.py's (distributed-llama), so TTFTs differ by more than "
            f"speed. distributed-llama ran on {dl.get('nodes', '-')} even boxes with the plant's "
            "total CPU quota and memory"
            + (f"; its root's box had {root} MiB, because at the even share it {outcome}: the "
               "root alone holds the token embedding in F32 (2 GiB for Llama-3-8B, 1.2 GiB for "
               "Qwen3-30B-A3B)" if root else "")
            + ". The plant's `predicted` column is the rehearsal's cost model "
            "(docs/rehearse.md, \"What the prediction counts\")"
            + (f", profiled {results['profile_note']}" if results.get("profile_note") else "")
            + ".")


def _ratios(results: dict[str, Any]) -> list[str]:
    plant, rpc, dl = results.get("plant", {}), results.get("rpc", {}), results.get("dllama", {})
    single = plant.get("single", {}).get("decode_tok_s")
    many = plant.get("concurrent", {}).get("decode_tok_s")
    pred = plant.get("predicted", {})
    n = results["concurrency"]
    return [
        "Ratios, from the numbers above:", "",
        f"- plant single stream against llama.cpp RPC: "
        f"{_ratio(single, rpc.get('single', {}).get('decode_tok_s'))} (target >= 1.0x);",
        f"- plant {n} at once against its own single stream: {_ratio(many, single)} "
        "(target >= 2.5x);",
        f"- plant {n} at once against distributed-llama ({dl.get('nodes', '-')} nodes, the same "
        f"total cores), which serves one request at a time: "
        f"{_ratio(many, dl.get('single', {}).get('decode_tok_s'))} (target >= 1.5x);",
        f"- plant single stream against the bound its stages' own decode passes set (one "
        f"pass of each a token, nothing between them): {_ratio(single, _step_bound(plant))} "
        "(target >= 0.9x);",
        f"- measured against the rehearsal's prediction, decode: one request "
        f"{_ratio(single, pred.get('single_tok_s'))}, {n} at once "
        f"{_ratio(many, pred.get('concurrent_tok_s'))}; answered (prompts included): one "
        f"request {_ratio(plant.get('single', {}).get('tok_s'), pred.get('single_answered_tok_s'))}"
        f", {n} at once "
        f"{_ratio(plant.get('concurrent', {}).get('tok_s'), pred.get('concurrent_answered_tok_s'))}"
        " (target 0.8x-1.2x).", ""]


def _step_bound(plant: dict[str, Any]) -> float | None:
    """The tok/s of a lone request whose token costs one decode pass of every stage."""
    passes: dict[str, float | None] = plant.get("single", {}).get("decode_step_ms", {})
    steps = [ms for ms in passes.values() if ms is not None]
    return 1000 / sum(steps) if steps and len(steps) == len(passes) else None


def _memory(results: dict[str, Any]) -> list[str]:
    plant = results.get("plant", {})
    shares = plant.get("shares", {})
    if not shares:
        return []
    lines = ["Each plant box's peak against its share (GGUF bytes of its stage + its "
             "kv_budget_mb + 100 MiB; target: peak RSS within it):", "",
             "| box | stage GGUF | KV budget | share + 100 MiB | stage peak RSS | box peak "
             "(cgroup, page cache included) | limit |", "|---|---|---|---|---|---|---|"]
    for box, share in shares.items():
        process = plant.get("processes", {}).get(box, {})
        info = plant.get("boxes", {}).get(box, {})
        lines.append(f"| {box} | {share['gguf_mib']:.0f} MiB | {share['kv_mib']:.0f} MiB | "
                     f"{share['gguf_mib'] + share['kv_mib'] + 100:.0f} MiB | "
                     f"{_f(process.get('peak_rss_mib'), 0, ' MiB')} | "
                     f"{_f(info.get('peak_mib'), 0, ' MiB')} | "
                     f"{_f(info.get('limit_mib'), 0, ' MiB')} |")
    lines.append("")
    for name in ("rpc", "dllama"):
        peer = results.get(name, {})
        if peer.get("processes"):
            lines.append(f"{name}: peak RSS " + ", ".join(
                f"{proc} {_f(info['peak_rss_mib'], 0, ' MiB')}"
                for proc, info in peer["processes"].items()) + "; box peaks " + ", ".join(
                f"{box} {_f(info['peak_mib'], 0, ' MiB')} of {info['limit_mib']:.0f}"
                for box, info in peer.get("boxes", {}).items()) + ".")
    return [*lines, ""]


def _failures(results: dict[str, Any]) -> list[str]:
    """What did not run through: OOM kills with the box's peak against its limit, else the
    error's first line and the end of the log it quotes."""
    lines = []
    for name in STEPS:
        result = results.get(name, {})
        error = result.get("error")
        if not error:
            continue
        killed = [f"{box} (peak {_f(info.get('peak_mib'), 0)} of {info['limit_mib']:.0f} MiB)"
                  for box, info in result.get("boxes", {}).items() if info.get("oom_kills")]
        text = error.strip().splitlines()
        lines += [f"- {name}: " + (f"killed by the OOM killer on {', '.join(killed)}; "
                                   if killed else "") + f"{text[0]}",
                  "", "  ```", *(f"  {line[:160]}" for line in text[1:][-_LOG_LINES:]),
                  "  ```", ""]
    one = results.get("one_box")
    if one and not one.get("error"):
        lines += [f"The whole model on {one['box']} alone answered at "
                  f"{_f(one['single'].get('decode_tok_s'))} tok/s.", ""]
    return (["What failed:", "", *lines] if lines and lines[0].startswith("- ") else lines)


def heading(results: dict[str, Any]) -> str:
    """The section's heading: one section per model."""
    return f"{SECTION} ({results['model'].split()[0]})"


def write_section(doc: Path, section: str) -> None:
    text = doc.read_text()
    start = text.find(section.splitlines()[0] + "\n")
    if start < 0:
        doc.write_text(text.rstrip("\n") + "\n\n" + section)
        return
    end = text.find("\n## ", start + 1)
    doc.write_text(text[:start] + section + ("" if end < 0 else text[end:]))


# -- main ----------------------------------------------------------------------------------


def _ids(gguf: Path) -> list[int]:
    """PROMPT as the GGUF's tokenizer makes it, asked of llama.cpp (llama-tokenize is not
    built; the Python binding runs the same vocabulary code)."""
    from llama_cpp import Llama

    model = Llama(str(gguf), vocab_only=True, verbose=False)
    return list(model.tokenize(PROMPT.encode(), add_bos=False))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("plant", type=Path, nargs="?", help="plant file with boxes: (a .gguf)")
    parser.add_argument("--dllama", type=Path, help="distributed-llama checkout, built (make)")
    parser.add_argument("--dllama-model", type=Path,
                        help="directory of model.m and tokenizer.t (tools/dllama_model.py)")
    parser.add_argument("--dllama-nodes", type=int, default=4, choices=(2, 4, 8))
    parser.add_argument("--dllama-root-memory-mb", type=int,
                        help="the root's box memory in the second distributed-llama run "
                             "(dllama), after one at the even share (dllama_share)")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--cpus", type=float, help="cores all boxes together get (rehearse's)")
    parser.add_argument("--only", nargs="+", choices=STEPS, default=list(STEPS))
    parser.add_argument("--out", type=Path, required=True, help="results JSON")
    parser.add_argument("--from-json", action="store_true",
                        help="only write the section (with PLANT: add the predictions)")
    parser.add_argument("--no-predict", action="store_true",
                        help="leave the predictions (the model's profile) for --from-json")
    parser.add_argument("--write", type=Path, help="docs/benchmarks.md to put the section in")
    parser.add_argument("--keep", type=Path, help="keep logs in this directory")
    args = parser.parse_args(argv)
    if args.from_json:
        results = json.loads(args.out.read_text())
        if args.plant is not None and "plant" in results and "predicted" not in results["plant"]:
            results["plant"]["predicted"] = predictions(
                load_plant(args.plant), Options(cpu_total=args.cpus), results["concurrency"],
                results["prompt_tokens"], results["tokens"])
            args.out.write_text(json.dumps(results, indent=1) + "\n")
    else:
        if args.plant is None:
            parser.error("give the plant file")
        results = run_all(args)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
    section = render(results)
    print(section)
    if args.write is not None:
        write_section(args.write, section)
    return 0


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    plant = load_plant(args.plant)
    options = Options(cpu_total=args.cpus)
    tools = find_tools()
    results: dict[str, Any] = {
        "machine": machine(), "prompt_tokens": len(_ids(plant.model)),
        "model": f"{plant.model.name} ({plant.model.stat().st_size / 2**30:.1f} GiB)",
        "tokens": args.tokens, "concurrency": args.concurrency,
        "command": "python benchmarks/bigger_than_any_box.py " + " ".join(sys.argv[1:])}
    steps: dict[str, Callable[[Path], dict[str, Any]]] = {
        "plant": lambda d: run_plant(plant, options, d, args.tokens, args.concurrency),
        "rpc": lambda d: (run_rpc(plant, options, d, tools, _ids(plant.model),
                                  args.tokens, args.concurrency)
                          if isinstance(tools, LlamaTools) else {"error": tools.reason}),
        "dllama_share": lambda d: _dllama(args, plant, options, d, None),
        "dllama": lambda d: _dllama(args, plant, options, d, args.dllama_root_memory_mb),
        "one_box": lambda d: run_one_box(plant, options, d, _broker_box(plant, options)),
    }
    with kept_or_temporary(args.keep, "bigger-than-any-box-") as workdir:
        for name in args.only:
            say(f"== {name}")
            results[name] = steps[name](workdir / name)
            args.out.write_text(json.dumps(results, indent=1) + "\n")  # partial results survive
            # A step's stage files are a copy of the model (17 GB for Qwen3-30B-A3B), cut
            # again by every run as part of the first start: gone before the next step needs
            # the disk (distributed-llama's model is 18 GB more).
            shutil.rmtree(workdir / name / "home" / "stages", ignore_errors=True)
    results["machine"]["load_after"] = os.getloadavg()[0]
    answers = results.get("plant", {}).get("answers")
    if answers:
        say("== llama.cpp whole, the reference answer")
        reference = whole_answer(args.plant, args.tokens)
        results["plant"]["exact"] = {"reference": reference,
                                     "equal": sum(answer == reference for answer in answers),
                                     "answers": len(answers)}
    if "plant" in results and not args.no_predict:
        results["plant"]["predicted"] = predictions(plant, options, args.concurrency,
                                                    results["prompt_tokens"], args.tokens)
    return results


def _dllama(args: argparse.Namespace, plant: Plant, options: Options, workdir: Path,
            root_memory_mb: int | None) -> dict[str, Any]:
    if not (args.dllama and args.dllama_model):
        return {"error": "not run: give --dllama and --dllama-model"}
    return run_dllama(plant, options, workdir, args.dllama / "dllama", args.dllama_model,
                      args.dllama_nodes, args.tokens, root_memory_mb)


def _broker_box(plant: Plant, options: Options) -> str:
    from edgebus.rehearse.sizing import box_shares, broker_box

    return broker_box(plant, box_shares(plant, cpu_total=options.cpu_total), options.broker_box)


if __name__ == "__main__":
    sys.exit(main())
