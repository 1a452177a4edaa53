"""The bench's model of the seed plant's shape: random weights of DeepSeek-Coder-1.3B's.

Speed depends on the shapes, not on the values, and the real weights cannot be
had here. The GGUFs are written by tools/random_gguf.py (its shape
SEED_SHAPE_NAME) as quantized blocks directly, a minute each, one per type of
QUANT_TYPES; the torch and onnxruntime stages run the import of the Q8_0 one
(`edgebus model import-gguf`: dequantized to fp32, as a user with a GGUF gets
it). This replaces a random fp32 checkpoint converted by llama.cpp's converter
and llama-quantize, which took 20 minutes.

The tool lies beside the bench in the source tree (TOOL).
Everything is cached in `$EDGEBUS_HOME/models/`, named with SEED_FORMAT.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TextIO

from edgebus.core.errors import EdgebusError
from edgebus.core.locks import exclusive
from edgebus.core.paths import GGUF_FILE, edgebus_home
from edgebus.model_import import MARKER_FILE, import_gguf
from harness.peers import _run

SEED_MODEL_NAME = "deepseek-coder-1.3b-shape"
# tools/random_gguf.py's name for the shape (its SHAPES: DeepSeek-Coder-1.3B's config.json).
SEED_SHAPE_NAME = "deepseek-coder-1.3b"
# The GGUF types the bench compares: llama.cpp's 4-bit pair and its 8-bit type.
QUANT_TYPES = ("Q4_0", "Q4_1", "Q8_0")
# The GGUF the torch and onnxruntime stages import: 8-bit, the nearest to their fp32.
IMPORTED_TYPE = "Q8_0"
TOOL = Path(__file__).resolve().parents[2] / "tools" / "random_gguf.py"
# Bump when the files written here change, so cached ones are written again.
SEED_FORMAT = 2


def seed_dir(home: Path | None = None) -> Path:
    return (edgebus_home() if home is None else home) / "models"


def seed_gguf(quant: str, *, home: Path | None = None, out: TextIO = sys.stdout) -> Path:
    """The random GGUF of the seed's shape in `quant` (QUANT_TYPES), written once by
    tools/random_gguf.py and cached."""
    if quant not in QUANT_TYPES:
        raise EdgebusError(f"GGUF type {quant!r}: choose one of {', '.join(QUANT_TYPES)}")
    folder = seed_dir(home) / f"{SEED_MODEL_NAME}-gguf"
    target = folder / f"{SEED_MODEL_NAME}.v{SEED_FORMAT}.{quant}.gguf"
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # Bench runs that need it at once write it once, in turns (the tool renames into place).
    with exclusive(folder / f".{target.name}.lock"):
        if not target.is_file():
            print(f"writing a random {quant} GGUF of DeepSeek-Coder-1.3B's shape to {target}",
                  file=out, flush=True)
            _run([sys.executable, str(TOOL), SEED_SHAPE_NAME, "--type", quant,
                  "--out", str(target)], folder / f"random-gguf-{quant}.log",
                 what=f"writing {target.name} (tools/random_gguf.py)")
    return target


def seed_model_dir(*, home: Path | None = None, out: TextIO = sys.stdout) -> Path:
    """An HF model directory of the seed's shape for the torch and onnxruntime stages: the
    import of the IMPORTED_TYPE GGUF (seed_gguf), made once and cached."""
    source = seed_gguf(IMPORTED_TYPE, home=home, out=out)
    dest = seed_dir(home) / f"{SEED_MODEL_NAME}.v{SEED_FORMAT}"
    if (dest / MARKER_FILE).is_file():  # written last by a complete import
        return dest
    with exclusive(dest.with_name(f".{dest.name}.lock")):
        if not (dest / MARKER_FILE).is_file():
            print(f"importing {source.name} into {dest} (fp32, ~5.4 GB)", file=out, flush=True)
            import_gguf(source, dest, progress=False)
    return dest


def seed_gguf_model(quant: str, *, home: Path | None = None, out: TextIO = sys.stdout) -> Path:
    """A model directory the llamacpp engine runs: seed_model_dir's files (config, tokenizer,
    and the safetensors the planner's profile reads) with the `quant` GGUF (seed_gguf) as
    model.gguf, all linked, nothing copied."""
    model_dir = seed_model_dir(home=home, out=out)
    gguf = seed_gguf(quant, home=home, out=out)
    view = model_dir.with_name(f"{model_dir.name}-{quant}")
    view.mkdir(exist_ok=True)
    links = {path.name: path for path in model_dir.iterdir() if path.is_file()}
    links[GGUF_FILE] = gguf
    for name, target in links.items():
        link = view / name
        if link.is_symlink() and os.readlink(link) != str(target):
            link.unlink()
        if not link.is_symlink():
            link.symlink_to(target)
    return view
