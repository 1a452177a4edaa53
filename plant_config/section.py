"""What every section of the plant file's schema shares: strict, frozen, paths resolved.

The sections themselves are in plant_config/schema.py and, for the broker and
its security, plant_config/broker_section.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, ConfigDict, ValidationInfo

# Validation context key: the directory relative paths in the file are relative
# to. Without it they resolve against the current directory.
RELATIVE_TO = "relative_to"


def _resolve_path(path: Path, info: ValidationInfo) -> Path:
    base = (info.context or {}).get(RELATIVE_TO, Path.cwd())
    return (Path(base) / path.expanduser()).resolve()


# A path stored absolute, so a Plant means the same thing from any working directory.
ResolvedPath = Annotated[Path, AfterValidator(_resolve_path)]


# Every section's model_config. frozen: a Plant is validated once, mutation would bypass the
# checks. hide_input_in_errors: the input of a broker section may contain a password.
# Each module of sections derives its own base from BaseModel with it, in the module: ruff
# knows a pydantic model (whose mutable defaults are copied) only within one file.
SECTION_CONFIG = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)
