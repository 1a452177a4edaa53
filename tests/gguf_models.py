"""GGUF files for the llamacpp engine's tests, made here from what the tests already have.

`requantize` rewrites the bundled SmolLM2 Q4_1 GGUF in another block type with
gguf-py's own quantizers (the reference implementations of llama.cpp's), so the
engine is tested on several types without llama.cpp's build tools.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np

from node_agent.engines.llamacpp.engine import MODEL_GGUF


def requantize(model_dir: Path, dest: Path, qtype: gguf.GGMLQuantizationType) -> Path:
    """A model directory beside `model_dir`'s config whose GGUF holds every quantized matrix
    of `model_dir`'s GGUF as `qtype`; other tensors (norms) as they are."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(model_dir / "config.json", dest / "config.json")
    reader = gguf.GGUFReader(str(model_dir / MODEL_GGUF))
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    writer = gguf.GGUFWriter(str(dest / MODEL_GGUF), arch=arch)
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
