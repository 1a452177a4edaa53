"""Where edgebus keeps its files: the home of what it makes for itself, and the name of
the GGUF inside an imported model directory.

Shared by the model import (edgebus/model_import.py), which writes them, and the
agents and profiles (node_agent/), which read them.
"""

from __future__ import annotations

import os
from pathlib import Path

GGUF_FILE = "model.gguf"  # the source GGUF as shipped: what the llamacpp engine loads


def edgebus_home() -> Path:
    """$EDGEBUS_HOME, by default $XDG_CACHE_HOME/edgebus, that is ~/.cache/edgebus: where
    edgebus keeps what it makes for itself (imported demo models, llama.cpp's tools, stage
    files cut from a GGUF)."""
    home = os.environ.get("EDGEBUS_HOME")
    if not home:
        cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        home = str(Path(cache) / "edgebus")
    return Path(home)
