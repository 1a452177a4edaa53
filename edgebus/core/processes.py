"""What every child process edgebus starts needs: no orphans, a free port, the core count.

Used by `edgebus up` for the agents and by `broker.mosquitto` for a bench's or
a test's Mosquitto, so a killed parent never leaves either behind.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from edgebus.core.errors import EdgebusError

LOOPBACK = "127.0.0.1"
# What a stage agent holds before it loads a single weight: its imports, and
# its model family's code, imported and built on the meta device (no memory).
_IDLE_AGENT_CODE = """
import sys, torch, transformers, node_agent.stage
from transformers import AutoConfig, AutoModelForCausalLM
with torch.device("meta"):
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]))
print(open("/proc/self/status").read())
"""
# <linux/prctl.h>
_PR_SET_PDEATHSIG = 1


def child_setup(cpus: list[int] | None = None) -> Callable[[], None] | None:
    """A preexec_fn: the kernel SIGTERMs the child when its parent dies; pin it to `cpus`.

    Linux only; elsewhere nothing is set up, and pinning is refused.
    """
    if not sys.platform.startswith("linux"):
        if cpus is not None:
            raise EdgebusError("pinning processes to CPUs needs Linux (sched_setaffinity)")
        return None
    # Looked up here, in the parent: the child between fork and exec should do
    # as little as possible.
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        # Between fork and exec, while output threads may hold locks in the
        # parent: only plain system calls here, nothing that takes a lock.
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))
        # Pinned before exec, so every thread the child ever starts (torch's
        # OpenMP pool included) inherits it: a bench can then give each stage
        # a core of its own, as each would have its own box.
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        # If the parent died before prctl, nobody will ever signal this child.
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port on `host` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def cores() -> int:
    """Cores this process may run on (a container or taskset may allow fewer than exist)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def proc_status_bytes(proc_status: str, key: str) -> int:
    """A memory field of /proc/<pid>/status in bytes: "VmHWM" (peak RSS), "VmRSS" (RSS now)."""
    found = re.search(rf"^{key}:\s+(\d+)\s+kB$", proc_status, re.MULTILINE)
    if found is None:
        raise ValueError(f"no {key} line: not the text of /proc/<pid>/status")
    return int(found.group(1)) * 1024


def idle_agent_rss(model_dir: Path) -> int:
    """Peak RSS of a fresh Python that imports what a stage agent imports and builds
    the model of `model_dir` on the meta device: an agent before its weights.

    Measured in a child process: the caller's own memory (a test session, a
    bench with models loaded) says nothing of what an agent starts from.
    """
    result = subprocess.run([sys.executable, "-c", _IDLE_AGENT_CODE, str(model_dir)],
                            capture_output=True, text=True, check=True)
    return proc_status_bytes(result.stdout, "VmHWM")
