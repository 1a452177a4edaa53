"""The llamacpp engine: a stage's layers in llama.cpp, from the GGUF's own blocks.

| module         | what it does |
| ---            | --- |
| stage_gguf.py  | cuts layers [first, end) out of the model's GGUF, cached in $EDGEBUS_HOME |
| library.py     | llama-cpp-python's ctypes API, ggml, and the C eval callback, once per process |
| placement.py   | which weight matrices llama.cpp repacks, so that rows of one call stay exact |
| rebuild_hint.py | after a SIGILL: the CPU features the build assumed, the CPU's, what to rebuild |
| capture.c      | the eval callback: copies the last layer's output and stops the graph |
| engine.py      | `LlamaCppEngine`: requests as llama.cpp sequences, batched calls |
"""

from node_agent.engines.llamacpp.engine import LlamaCppEngine

__all__ = ["LlamaCppEngine"]
