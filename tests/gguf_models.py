"""GGUF files for the llamacpp engine's tests, made here from what the tests already have.

`requantize` rewrites the bundled SmolLM2 Q4_1 GGUF in another block type with
gguf-py's own quantizers (the reference implementations of llama.cpp's), so the
engine is tested on several types without llama.cpp's build tools.
`tiny_gguf` converts a tiny random checkpoint of another family (tiny_models.py)
with llama.cpp's own converter, from the source vendored in the installed
llama-cpp-python's sdist (downloaded once; nothing is compiled).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from tiny_models import build_tiny

from edgebus.bench.peers import convert_hf, llama_source
from node_agent.engines.llamacpp.engine import MODEL_GGUF

# The pre-tokenizer of SmolLM2's tokenizer, which the tiny models borrow: the converter
# knows it by the hash of the Hub's copy, which an import through transformers changes.
SMOLLM_PRE_TOKENIZER = "smollm"


def tiny_gguf(family: str, dest: Path, tokenizer_dir: Path) -> Path:
    """A tiny random `family` checkpoint with its GGUF (F16) beside it as model.gguf."""
    build_tiny(family, dest, tokenizer_dir)
    convert_hf(llama_source(), dest, dest / MODEL_GGUF, log=dest / "convert.log",
               pre_tokenizer=SMOLLM_PRE_TOKENIZER)
    return dest


def requantize(source: Path, dest: Path, qtype: gguf.GGMLQuantizationType) -> Path:
    """The GGUF file `dest`: the GGUF file `source` with every quantized matrix as `qtype`,
    other tensors (norms) as they are, and the same metadata (vocabulary, config)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(source))
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    writer = gguf.GGUFWriter(str(dest), arch=arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY
                             else None)
    for tensor in reader.tensors:
        data: np.ndarray = tensor.data
        if tensor.tensor_type not in (gguf.GGMLQuantizationType.F32,
                                      gguf.GGMLQuantizationType.F16):
            values = gguf.quants.dequantize(data, tensor.tensor_type)
            data = gguf.quants.quantize(values, qtype)
            writer.add_tensor(tensor.name, data, raw_dtype=qtype)
        else:
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest
