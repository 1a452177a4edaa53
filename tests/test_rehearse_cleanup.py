"""`edgebus rehearse` leaves the host as it found it: after a normal end, and after
`kill -9` followed by `edgebus rehearse --clean`.

The host's namespaces, links, addresses, routes, top-level control groups and
rehearsal records are compared before and after, through the commands users
run. Other engineers' rehearsals may run on the same host meanwhile: entries
that name another run's id are left out of the comparison, nothing else.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import optional
from certs import plant_tls
from gguf_models import PROCESS_KV_BUDGET_MB

from edgebus.rehearse import leftovers, netns
from edgebus.rehearse.cgroups import CGROUP_ROOT, V1Tree
from edgebus.rehearse.rehearsal import missing
from plant_config import BrokerSettings, Liveness, Plant, StageSpec, write_plant
from plant_config.broker_section import Security
from plant_config.schema import BoxSpec

MISSING = missing()
pytestmark = [optional.needs(MISSING, "a rehearsal"), optional.HOST_NETWORK]

# Up to every agent online and one tiny answer, with torch imports on 2 busy cores.
RUN_S = 300.0
# The rehearsal's measurement waits for a heartbeat before and after each of its two
# workloads (warm-up and the run): at the default 2 s, eight of the test's 12 s. The
# timeout stays long: a stage on a busy machine is not to be taken for dead.
LIVENESS = Liveness(heartbeat_s=0.25, timeout_s=6.0)
# A run id as the rehearsal names things with it: links, namespaces, control groups.
RUN_NAME = re.compile(r"(?:eb|edgebus-|edgebus-rehearse-)([0-9a-f]{6})(?![0-9a-f])")


def snapshot(run: str | None = None) -> dict[str, set[str]]:
    """What a rehearsal may add to the host, without what runs other than `run` hold
    (with None: without anything of any run)."""
    def lines(*args: str) -> set[str]:
        return {line.strip() for line in netns.run(*args).splitlines() if line.strip()}

    roots = [CGROUP_ROOT, CGROUP_ROOT / "unified",
             *(CGROUP_ROOT / controller for controller in V1Tree.CONTROLLERS)]
    cgroup_dirs = {str(p) for root in roots if root.is_dir()
                   for p in root.iterdir() if p.is_dir()}
    state = {
        "namespaces": {line.split()[0] for line in lines("ip", "netns", "list")},
        # Names, addresses and routes, not counters or flags, which change by themselves.
        "links": {line.split(":")[1].strip() for line in lines("ip", "-o", "link", "show")},
        "addresses": {" ".join(line.split()[1:4]) for line in lines("ip", "-o", "addr", "show")},
        "routes": lines("ip", "-4", "route", "show", "table", "all")
        | lines("ip", "-6", "route", "show", "table", "all"),
        "cgroups": cgroup_dirs,
        # Named as the run's namespaces are, so that they are told apart the same way.
        "records": {f"edgebus-{p.name}" for p in leftovers.RECORD_DIR.glob("*")}
        if leftovers.RECORD_DIR.is_dir() else set(),
    }
    return {kind: {e for e in entries if all(m == run for m in RUN_NAME.findall(e))}
            for kind, entries in state.items()}


def plant_file(model: Path, workdir: Path) -> tuple[Path, Path]:
    """A one-box plant with security and TLS on, as `init` makes it, its stage on llama.cpp
    (whose agent starts on its box's core share without importing torch) with a small KV
    (gguf_models.with_kv_budget); its path and its credentials directory."""
    credentials = workdir / "credentials"
    credentials.mkdir(mode=0o700)
    tls = plant_tls(credentials, ("box-a",))
    plant = Plant(plant_id="cleanup", topic_root="edgebus-test/cleanup",
                  broker=BrokerSettings(url="mqtts://box-a:8883", ca_file=tls.cafile),
                  model=model, boxes=[BoxSpec(name="box-a", memory_mb=2048, speed=1.0)],
                  stages=[StageSpec(node="box-a", layers=(0, 6), weights="gguf",
                                    kv_budget_mb=PROCESS_KV_BUDGET_MB)],
                  security=Security(credentials=credentials, gateways=["plc-1"], ops=["ops"],
                                    tls=tls),
                  liveness=LIVENESS)
    path = workdir / "plant.yaml"
    write_plant(plant, path)
    return path, credentials


def rehearse(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "edgebus", "rehearse", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})


def read_until(proc: subprocess.Popen[str], text: str) -> str:
    """`proc`'s output up to a line containing `text`."""
    assert proc.stdout is not None
    out = ""
    deadline = time.monotonic() + RUN_S
    while text not in out:
        line = proc.stdout.readline()
        assert line and time.monotonic() < deadline, f"no {text!r} in:\n{out}"
        out += line
    return out


def run_of(out: str) -> str:
    """The run id `edgebus rehearse` printed."""
    found = re.search(r"\(run ([0-9a-f]{6})\)", out)
    assert found is not None, out
    return found.group(1)


def test_a_normal_end_leaves_the_host_as_it_was_and_the_credentials_untouched(
        tiny_llama_gguf: Path, tmp_path: Path) -> None:
    path, credentials = plant_file(tiny_llama_gguf, tmp_path)
    before_files = files_in(credentials)
    before = snapshot()
    proc = rehearse(str(path), "--requests", "1", "--tokens", "2", "--cpus", "1")
    try:
        out = read_until(proc, "building")
        run = run_of(out)
        assert proc.stdout is not None
        out += proc.stdout.read()
        assert proc.wait(RUN_S) == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert snapshot(run) == before, out
    # The broker's passwords, and its certificate for its address on the rehearsal's bridge,
    # were made in a copy, not in the plant's own directory.
    assert files_in(credentials) == before_files
    assert not any(name.endswith(".password") for name in before_files)
    # The rehearsal's broker spoke TLS, with a certificate for its address on the bridge.
    assert ":8883, TLS)" in out, out


def files_in(directory: Path) -> dict[str, bytes]:
    return {str(path.relative_to(directory)): path.read_bytes()
            for path in sorted(directory.rglob("*")) if path.is_file()}


def test_kill_9_then_clean_leaves_the_host_as_it_was(tiny_llama_gguf: Path, tmp_path: Path) -> None:
    path, _ = plant_file(tiny_llama_gguf, tmp_path)
    before = snapshot()
    proc = rehearse(str(path), "--cpus", "1")
    try:
        out = read_until(proc, "waiting for every agent")  # everything is built
        run = run_of(out)
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    left = snapshot(run)
    # What the killed run left: the test of --clean is not vacuous.
    assert left["namespaces"] - before["namespaces"], out
    assert left["links"] - before["links"] and left["cgroups"] - before["cgroups"]
    assert left["addresses"] - before["addresses"] and left["routes"] - before["routes"]
    cleaned = subprocess.run([sys.executable, "-m", "edgebus", "rehearse", "--clean"],
                             capture_output=True, text=True, timeout=120)
    assert cleaned.returncode == 0, cleaned.stdout + cleaned.stderr
    assert f"namespace edgebus-{run}-box-a" in cleaned.stdout, cleaned.stdout
    assert f"link eb{run}" in cleaned.stdout and "control group" in cleaned.stdout
    assert snapshot(run) == before, cleaned.stdout
