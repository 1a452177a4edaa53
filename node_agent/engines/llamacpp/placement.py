"""Which weight matrices llama.cpp repacks, chosen so that rows of one call stay exact.

llama.cpp's default repacks every matrix whose block type its CPU has an interleaved
kernel for, and such a kernel computes 4 rows or more (`gemm`) otherwise than one row
(`gemv`) for some types: a batch's rows then differ from each row alone, and the engine's
load-time probes find smaller exact batches (docs/row-exactness.md). Where the CPU's
kernels were measured, this repacks only the types whose gemm sums as their gemv does,
and keeps every other matrix in the plain buffer, whose `vec_dot` computes a row the same
way however many rows a call has. The engine's probes still measure the result.

On a Cortex-A76 (NEON with dot product, no i8mm: a Pi 5; the Jetson Orin's A78AE takes
the same kernels), measured under qemu 7.2:
- Q4_0 (4x4) and Q4_K (8x4) repacked: rows exact. They stay repacked.
- Q8_0 (4x4) and Q6_K (8x4) repacked: the gemm rounds twice where the gemv fuses a
  multiply-add, so from 4 rows on a row differs. They go plain.
That needs a llama.cpp built without llamafile (`-DGGML_LLAMAFILE=OFF`,
docs/install-a-box.md): llamafile's tinyBLAS takes plain Q8_0 and Q4_0 products from 2
rows, in another order than `vec_dot`. On a build with it, and on any CPU not measured,
llama.cpp's own placement stands (`choose` returns None).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gguf import GGMLQuantizationType as Q

from node_agent.gguf_model import TensorInfo

# Block type -> rows ggml interleaves in its repacked layout on ARM with dot product and
# without i8mm (repack.cpp, ggml_repack_get_optimal_repack_type): ggml repacks a matrix
# only if its row count divides by that, and a matrix sent to the repacked buffer that it
# cannot repack crashes the load, so only those are named.
ARM_DOTPROD_EXACT = {Q.Q4_0: 4, Q.Q4_K: 8}
# The tensors that only ever feed a matrix product (llama.cpp's tensor names). Another
# use of a repacked weight (the token embedding's row lookup) has no kernel and aborts.
MATMUL_ROLES = frozenset({"attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output",
                          "ffn_gate", "ffn_up", "ffn_down"})
HEAD = "output.weight"
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


@dataclass(frozen=True)
class Placement:
    """What goes to llama.cpp's repacked buffer: `patterns`, regular expressions over tensor
    names (llama_model_tensor_buft_override); everything else stays plain."""

    patterns: tuple[str, ...]
    repacked: tuple[str, ...]  # block type names, for the log
    plain: tuple[str, ...]


def features(system_info: str) -> dict[str, str]:
    """llama.cpp's system info ('CPU : NEON = 1 | DOTPROD = 1 | ...') as {name: value}."""
    pairs = (part.rsplit(":", 1)[-1].split("=") for part in system_info.split("|"))
    return {p[0].strip(): p[1].strip() for p in pairs if len(p) == 2}


def arm_dotprod(built: Mapping[str, str]) -> bool:
    """Whether ggml picks the kernels measured on the Cortex-A76 (ARMv8.2 with dot product;
    with i8mm it picks others)."""
    return (built.get("NEON") == "1" and built.get("DOTPROD") == "1"
            and "MATMUL_INT8" not in built)


def choose(built: Mapping[str, str], tensors: Sequence[TensorInfo]) -> Placement | None:
    """The placement for a model of `tensors` on a build with these `features`, or None
    where its kernels were not measured (llama.cpp's default placement then)."""
    if not arm_dotprod(built) or built.get("LLAMAFILE") == "1":
        return None
    layers: dict[str, list[str]] = defaultdict(list)  # role -> layer numbers repacked
    head = False
    repacked, plain = set(), set()
    for tensor in tensors:
        if len(tensor.dims) != 2:
            continue  # norms and biases (1 axis), experts (3): never repacked here
        rows = ARM_DOTPROD_EXACT.get(tensor.kind)
        match = _LAYER_TENSOR.fullmatch(tensor.name)
        if rows is None or tensor.dims[1] % rows:
            plain.add(tensor.kind)
        elif match and match[2] in MATMUL_ROLES:
            layers[match[2]].append(match[1])
            repacked.add(tensor.kind)
        elif tensor.name == HEAD:
            head = True
            repacked.add(tensor.kind)
        else:
            plain.add(tensor.kind)
    patterns = [rf"^blk\.({'|'.join(numbers)})\.{role}\.weight$"
                for role, numbers in sorted(layers.items())]
    if head:
        patterns.append(rf"^{re.escape(HEAD)}$")
    return Placement(tuple(patterns), tuple(sorted(k.name for k in repacked)),
                     tuple(sorted(k.name for k in plain)))
