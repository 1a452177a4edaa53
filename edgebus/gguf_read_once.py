"""One parse of a GGUF file for an import, however often transformers reads it.

transformers reads a GGUF once for its config, once more for the model (with its tensors)
and once for the tokenizer, each through a fresh `gguf.GGUFReader`. gguf-py parses every
metadata field element by element through numpy memmap views: SmolLM2's 49,152-token
vocabulary and its merges cost about 3 s of CPU a parse on the 2-core AMD EPYC, and
transformers also builds gguf-py's tensor name table afresh for each of its modules (397
for SmolLM2). Within `read_once()`, both are made once per file and shape: the import of
the demo model took 24 CPU-seconds before, and this reuse is most of what a Pi's import
waits on.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def read_once() -> Iterator[None]:
    """Within the block, `gguf.GGUFReader(path)` and `gguf.get_tensor_name_map(arch, n)`
    return what they returned first for the same arguments.

    The reader maps its file read-only and transformers only reads from it, so sharing one
    is safe; the patch is undone on leaving, so nothing outside an import sees it."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    @functools.cache
    def cached_reader(path: Any, mode: Any = "r") -> Any:
        return reader(path, mode)

    gguf.GGUFReader = cached_reader  # type: ignore[assignment,misc]
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map  # type: ignore[misc]
