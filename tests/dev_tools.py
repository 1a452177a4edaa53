"""The developer tooling beside the packages (tools/, benchmarks/), imported by tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def dev_tool(relative: str) -> ModuleType:
    """The script at `relative` to the repository's root, as a module named by its stem."""
    path = ROOT / relative
    name = path.stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
    return sys.modules[name]
