"""What to rebuild llama.cpp for when the CPU refused one of its instructions (SIGILL).

llama-cpp-python compiles llama.cpp for the CPU it is built on (`GGML_NATIVE`,
the default) or for the one CMAKE_ARGS name (`GGML_CPU_ARM_ARCH`). Run on a
CPU with fewer features, it dies of SIGILL at the first instruction that CPU
lacks: a build for the Pi 5's Cortex-A76 (ARMv8.2 with dotprod and fp16) on a
Pi 4's Cortex-A72 (ARMv8.0: neither) did. On x86 the usual cause is an Intel VM
that advertises AMX it cannot run.

ggml's `ggml_cpu_has_<feature>()` report, on x86 and ARM alike, what the build
was compiled for, and `/proc/cpuinfo` what the CPU has; the hint names the
difference and the build that fits. The build is asked in a child process: the
library that died of SIGILL may die again on being loaded.
"""

from __future__ import annotations

import functools
import platform
import subprocess
import sys
from dataclasses import dataclass

from edgebus.core.errors import EngineError
from node_agent.engines.cpu_flags import CPUINFO, cpu_flags
from node_agent.engines.llamacpp.library import PINNED, library_dir

DOCS = "docs/deploy.md#llamacpp-on-the-box-weights-gguf"
# Loading ggml and reading a few constants takes milliseconds; a loaded box, seconds.
PROBE_TIMEOUT_S = 30.0
REINSTALL = ("pip install --force-reinstall --no-cache-dir --no-deps --no-binary "
             f"llama-cpp-python llama-cpp-python=={PINNED}")


@dataclass(frozen=True)
class Feature:
    name: str  # as a person names it
    ggml: str  # ggml_cpu_has_<ggml>(): 1 if the build was compiled for it
    flags: tuple[str, ...]  # /proc/cpuinfo flags of a CPU that has it (any one)
    march: str = ""  # ARM: its -march extension


# The ARM features ggml's CPU kernels are built for beyond NEON, with the names Linux gives
# them in /proc/cpuinfo's Features (arch/arm64/kernel/cpuinfo.c).
ARM = (Feature("dotprod", "dotprod", ("asimddp",), "+dotprod"),
       Feature("fp16", "fp16_va", ("fphp", "asimdhp"), "+fp16"),
       Feature("i8mm", "matmul_int8", ("i8mm",), "+i8mm"),
       Feature("sve", "sve", ("sve",), "+sve"))
X86 = (Feature("AVX", "avx", ("avx",)), Feature("AVX2", "avx2", ("avx2",)),
       Feature("FMA", "fma", ("fma",)), Feature("F16C", "f16c", ("f16c",)),
       Feature("AVX-512", "avx512", ("avx512f",)),
       Feature("AVX512-VNNI", "avx512_vnni", ("avx512_vnni",)),
       Feature("AVX-VNNI", "avx_vnni", ("avx_vnni",)),
       Feature("AMX", "amx_int8", ("amx_int8",)))
# The ARMv8 level whose features ggml uses start: dotprod and fp16 are ARMv8.2's.
_ARM_BASE, _ARM_V82 = "armv8-a", "armv8.2-a"
_PROBE = ("import ctypes, sys\n"
          "lib = ctypes.CDLL(sys.argv[1])\n"
          "print(' '.join(f for f in sys.argv[2:] if getattr(lib, 'ggml_cpu_has_' + f)()))")


def sigill_hint() -> str:
    """Why a process that runs llama.cpp died of SIGILL on this box, and what to rebuild."""
    machine = platform.machine()
    features = ARM if machine in ("aarch64", "arm64") else X86
    try:
        cpuinfo = CPUINFO.read_text(errors="replace")
    except OSError:
        cpuinfo = ""
    return hint(machine, features, cpu_flags(cpuinfo), built_for(features))


def hint(machine: str, features: tuple[Feature, ...], flags: set[str],
         built: set[str] | None) -> str:
    """The hint for a CPU of `machine` with /proc/cpuinfo `flags`, whose llama.cpp was built
    for the ggml features `built` (None: unknown)."""
    has = [f for f in features if set(f.flags) & flags]
    lacks = [f for f in features if built is not None and f.ggml in built and f not in has]
    has_names = _names(has) or f"none of {_names(features)}"
    said = ": the CPU refused an instruction its libraries were built for. "
    if lacks:
        said += (f"llama.cpp here was built for {_names(lacks)}, which this {machine} CPU "
                 f"lacks (it has {has_names}). ")
    elif built is None:
        said += (f"What llama.cpp here was built for could not be read (it did not load); "
                 f"this {machine} CPU has {has_names}. ")
    elif features is X86:
        return said + ("On an Intel VM that advertises AMX, rebuild llama-cpp-python without "
                       f"it ({DOCS})")
    else:
        return said + (f"llama.cpp here was built for no more than this {machine} CPU has "
                       f"({has_names}): another library of the process was built for a newer "
                       "CPU; reinstall the agent's packages on this box")
    if features is ARM:
        base = _ARM_V82 if any(f.name in ("dotprod", "fp16") for f in has) else _ARM_BASE
        return said + (f"Rebuild llama-cpp-python for this CPU: CMAKE_ARGS=\"-DGGML_NATIVE=OFF "
                       f"-DGGML_CPU_ARM_ARCH={base}{''.join(f.march for f in has)}\" "
                       f"{REINSTALL}, or build it on this box without CMAKE_ARGS, for the CPU "
                       f"it runs on ({DOCS})")
    return said + (f"Rebuild llama-cpp-python on this box, which builds it for the CPU it runs "
                   f"on: {REINSTALL} ({DOCS})")


@functools.cache
def built_for(features: tuple[Feature, ...]) -> set[str] | None:
    """The ggml features of `features` the installed llama.cpp was compiled for, asked in a
    child process; None if its CPU library is not there or does not load."""
    try:
        library = library_dir() / "libggml-cpu.so"
    except EngineError:  # no llama-cpp-python at all
        return None
    if not library.exists():
        return None
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, str(library),
                               *(f.ggml for f in features)],
                              capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None
    return set(done.stdout.split()) if done.returncode == 0 else None


def _names(features: list[Feature] | tuple[Feature, ...]) -> str:
    return ", ".join(f.name for f in features)
