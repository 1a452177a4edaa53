"""llama.cpp as this process sees it: llama-cpp-python's ctypes API, ggml, and our eval callback.

Everything here happens once per process: loading the libraries, starting
llama.cpp's backends, sending its log lines to Python's logging, and reading
what the build can do. The engine (engine.py) only calls into what this hands it.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec
from pathlib import Path
from types import ModuleType
from typing import Any

from edgebus.core.errors import EngineError
from node_agent import gguf_model
from node_agent.engines.llamacpp import placement

log = logging.getLogger("llama.cpp")

# The llama-cpp-python release this engine is written against. Its ctypes
# structs (llama_context_params above all) change layout between releases, and
# a mismatch reads garbage without an error, so another release is refused.
PINNED = "0.3.36"
CAPTURE_MODULE = "_capture"
CAPTURE_SYMBOL = "edgebus_capture_cb"
AMX_PROBE_MODULE = "_amx_probe"
# Where llama-cpp-python loads libllama and its ggml from instead of its package's lib/: a
# llama.cpp built elsewhere (for another CPU, say) is used where it lies, not copied in.
LIB_PATH_VARIABLE = "LLAMA_CPP_LIB_PATH"
# GGML_LOG_LEVEL_ERROR in ggml.h's enum ggml_log_level.
_ERROR = 4
# ggml-cpu's buffer type of repacked weights (one of the CPU device's extra buffer types).
REPACK_BUFFER = b"CPU_REPACK"
# GGML_BACKEND_DEVICE_TYPE_CPU in ggml-backend.h's enum ggml_backend_dev_type.
_CPU_DEVICE = 0


class BufferOverride(ctypes.Structure):
    """llama.h's `struct llama_model_tensor_buft_override`: tensors whose name matches
    `pattern` go to the buffer type `buft`. llama-cpp-python declares the field that takes
    a list of them but not the struct."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


class Capture(ctypes.Structure):
    """capture.c's `struct edgebus_capture`, field for field."""

    _fields_ = [("target", ctypes.c_char * 64), ("get_name", ctypes.c_void_p),
                ("nbytes", ctypes.c_void_p), ("tensor_get", ctypes.c_void_p),
                ("buf", ctypes.c_void_p), ("cap_bytes", ctypes.c_size_t),
                ("off_bytes", ctypes.c_size_t)]


@functools.cache
def llama() -> ModuleType:
    """llama-cpp-python's low-level module, its backends started, its log routed to ours."""
    installed = library_version()
    if installed != PINNED:
        raise EngineError(f"the llamacpp engine needs llama-cpp-python {PINNED}, this box has "
                          f"{installed}: pip install llama-cpp-python=={PINNED}")
    try:
        import llama_cpp.llama_cpp as lowlevel
    except (OSError, RuntimeError) as exc:  # the shared library would not load
        raise EngineError(f"llama-cpp-python is installed but its library does not load ({exc}): "
                          f"reinstall it, `pip install --force-reinstall --no-cache-dir "
                          f"llama-cpp-python=={PINNED}`") from exc
    lowlevel.llama_log_set(_LOG_CALLBACK(lowlevel), None)
    lowlevel.llama_backend_init()
    # A build without AMX (docs/deploy.md) keeps its repacked weights on any CPU.
    fault = amx_fault() if "AMX_INT8 = 1" in _system_info(lowlevel) else 0
    if fault:
        keep_off_extra_buffers(lowlevel)
        log.warning("this CPU advertises AMX but a tile instruction died of %s: llama.cpp "
                    "runs here without its extra buffer types (AMX, and repacked Q4_0/Q8_0 "
                    "weights), so slower, never killed (docs/deploy.md#llamacpp-on-the-box-"
                    "weights-gguf)", signal.Signals(fault).name)
    return lowlevel


@functools.cache
def amx_fault() -> int:
    """0 if this CPU runs the AMX it advertises, or advertises none; else the signal a tile
    instruction died of in a forked child (amx_probe.c)."""
    probe = _c_library(AMX_PROBE_MODULE)
    fault = int(probe.edgebus_amx_fault())
    if fault < 0:
        raise EngineError("could not fork to check this CPU's AMX: the box is out of processes "
                          "or memory")
    return fault


def keep_off_extra_buffers(lowlevel: ModuleType) -> None:
    """Every model this process loads, the engine's and `llama_cpp.Llama`'s alike, without
    llama.cpp's extra CPU buffer types: its AMX kernels run only from them. Llama() reads
    its model parameters from llama_model_default_params at call time, and takes no
    use_extra_bufts argument, so the defaults are where this has to go."""
    defaults = lowlevel.llama_model_default_params

    def without_extra_buffers() -> Any:
        params = defaults()
        params.use_extra_bufts = False
        return params

    setattr(lowlevel, "llama_model_default_params", without_extra_buffers)  # noqa: B010


def model_params(gguf: Path) -> tuple[Any, Any]:
    """llama_model_params for loading `gguf` on this CPU: this process's defaults, with the
    weight matrices placed so that rows of one call stay exact where this CPU's kernels were
    measured (placement.py); and what has to live until the load returns (the override
    list the params point at)."""
    lowlevel = llama()
    params = lowlevel.llama_model_default_params()
    built = placement.features(system_info())
    chosen = placement.choose(built, gguf_model.layout(gguf).tensors)
    repack = None if chosen is None else repack_buffer_type()
    if chosen is None or repack is None:
        if placement.arm_dotprod(built) and built.get("LLAMAFILE") == "1":
            _llamafile_on_arm()
        return params, None
    params.use_extra_bufts = False
    overrides = (BufferOverride * (len(chosen.patterns) + 1))()  # a null pattern ends it
    for entry, pattern in zip(overrides, chosen.patterns, strict=False):
        entry.pattern, entry.buft = pattern.encode(), repack
    params.tensor_buft_overrides = ctypes.cast(overrides, ctypes.c_void_p).value
    log.info("%s: repacked for this CPU's kernels: %s; plain, so that rows stay exact: %s "
             "(docs/row-exactness.md)", gguf.name, ", ".join(chosen.repacked) or "none",
             ", ".join(chosen.plain) or "none")
    return params, overrides


@functools.cache
def _llamafile_on_arm() -> None:
    """Said once a process: what keeps this box's batches smaller than they could be."""
    log.warning("this llama.cpp was built with llamafile, whose Q8_0 and Q4_0 products of 2 "
                "rows or more differ from one row's on ARM: llama.cpp places the weights as "
                "it likes, and batches stay exact only as far as the load-time probes find. "
                "Rebuild llama-cpp-python with CMAKE_ARGS=\"-DGGML_LLAMAFILE=OFF\" "
                "(docs/install-a-box.md)")


@contextmanager
def placed_as_stages(gguf: Path) -> Iterator[None]:
    """`llama_cpp.Llama(gguf)` made inside places its weights as a stage does (model_params):
    a whole-model reference runs the same kernels as the plant it is held to. Llama()
    reads its model parameters from llama_model_default_params at call time."""
    lowlevel = llama()
    params, overrides = model_params(gguf)
    defaults = lowlevel.llama_model_default_params
    setattr(lowlevel, "llama_model_default_params", lambda: params)  # noqa: B010
    try:
        yield
    finally:
        setattr(lowlevel, "llama_model_default_params", defaults)  # noqa: B010
        del overrides  # read by the load only


def repack_buffer_type() -> int | None:
    """The CPU device's buffer type of repacked weights, or None in a build without one."""
    llama()
    return extra_buffer_type(REPACK_BUFFER)


@functools.cache
def extra_buffer_type(name: bytes) -> int | None:
    """The CPU device's extra buffer type called `name` (b"CPU_REPACK", b"AMX"), or None in
    a build without it. llama.cpp's backends must be started (`llama`)."""
    ggml, base = _ggml_library("libggml"), _ggml_library("libggml-base")
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    base.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    base.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    base.ggml_backend_buft_name.restype = ctypes.c_char_p
    base.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    device = ggml.ggml_backend_dev_by_type(_CPU_DEVICE)
    address = base.ggml_backend_reg_get_proc_address(ggml.ggml_backend_dev_backend_reg(device),
                                                     b"ggml_backend_dev_get_extra_bufts")
    if not device or not address:
        return None
    extra = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(address)(device)
    index = itertools.count()
    while buft := extra[next(index)]:  # a null-terminated list
        if base.ggml_backend_buft_name(buft) == name:
            return int(buft)
    return None


def library_version() -> str:
    try:
        return version("llama-cpp-python")
    except PackageNotFoundError:
        raise EngineError(f"the llamacpp engine needs llama-cpp-python: pip install "
                          f"llama-cpp-python=={PINNED}") from None


def system_info() -> str:
    """What the loaded llama.cpp was built for: 'CPU : SSE3 = 1 | AVX2 = 1 | ...'."""
    return _system_info(llama())


def _system_info(lowlevel: ModuleType) -> str:
    return bytes(lowlevel.llama_print_system_info()).decode(errors="replace").strip()


def library_dir() -> Path:
    """The folder llama-cpp-python loads libllama and ggml from, read as llama_cpp.py reads
    it ($LLAMA_CPP_LIB_PATH, else the package's lib/), without importing llama_cpp: the
    SIGILL hint (rebuild_hint.py) asks it where loading that library may be what fails."""
    override = os.environ.get(LIB_PATH_VARIABLE)
    if override is not None:
        return Path(override)
    spec = find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise EngineError(f"the llamacpp engine needs llama-cpp-python: pip install "
                          f"llama-cpp-python=={PINNED}")
    return Path(spec.origin).parent / "lib"


@functools.cache
def capture_callback() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    """(capture library, libggml-base): the C eval callback, and the ggml it calls into."""
    lib = _c_library(CAPTURE_MODULE)
    llama()
    return lib, _ggml_library("libggml-base")


def _ggml_library(stem: str) -> ctypes.CDLL:
    """ggml's library `stem` (libggml-base: tensors and buffers; libggml: the backends) as
    llama-cpp-python loaded it: the same file, so dlopen hands back its handle. Another
    copy (the package's, beside a $LLAMA_CPP_LIB_PATH build) would be a second ggml, whose
    functions would be called on the first one's objects."""
    libdir = library_dir()
    candidates = sorted(libdir.glob(f"{stem}.*"))
    if not candidates:
        raise EngineError(f"no {stem} beside llama-cpp-python's library in {libdir}: "
                          + (f"point ${LIB_PATH_VARIABLE} at the folder of the build's "
                             "libllama and libggml" if LIB_PATH_VARIABLE in os.environ
                             else f"reinstall llama-cpp-python=={PINNED}"))
    return ctypes.CDLL(str(candidates[0]))


def _c_library(module: str) -> ctypes.CDLL:
    # Found, not imported: a plain C library that pip builds as an extension module.
    spec = find_spec(f"{__package__}.{module}")
    if spec is None or spec.origin is None:
        raise EngineError(f"the llamacpp engine's {module[1:]}.c was not built: reinstall "
                          "edgebus (pip install -e . builds it, with the C compiler "
                          "llama-cpp-python needs too)")
    return ctypes.CDLL(spec.origin)


def new_capture(target: str, buffer_address: int, buffer_bytes: int) -> Capture:
    """A capture of node `target` into the float32 buffer at `buffer_address`."""
    _, ggml = capture_callback()
    capture = Capture()
    capture.target = target.encode()
    for field, symbol in (("get_name", "ggml_get_name"), ("nbytes", "ggml_nbytes"),
                          ("tensor_get", "ggml_backend_tensor_get")):
        setattr(capture, field, ctypes.cast(getattr(ggml, symbol), ctypes.c_void_p).value)
    capture.buf = buffer_address
    capture.cap_bytes = buffer_bytes
    return capture


def callback_pointer() -> Any:
    """The C callback as llama_context_params.cb_eval wants it."""
    lib, _ = capture_callback()
    lowlevel = llama()
    return ctypes.cast(getattr(lib, CAPTURE_SYMBOL), lowlevel.ggml_backend_sched_eval_callback)


def _LOG_CALLBACK(lowlevel: ModuleType) -> Any:
    """llama.cpp's log lines into Python's logging: its errors as errors, the rest (hundreds
    of lines a load) at debug level. Kept alive for the process, as llama.cpp keeps it."""

    def forward(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
        log.log(logging.ERROR if level == _ERROR else logging.DEBUG,
                bytes(text).decode(errors="replace").rstrip())

    callback = lowlevel.llama_log_callback(forward)
    _KEEP.append(callback)
    return callback


_KEEP: list[object] = []
