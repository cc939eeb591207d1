"""Re-encode a GGUF's quantized tensors as Q8_0 (llama.cpp's 8-bit format: blocks of 32
weights, one fp16 scale each), keeping every other tensor and all metadata, with the
``gguf`` package. ``make bench`` serves the result with llama-server beside the packaged
Q4_1, so ringserve's int8 runs against llama.cpp's 8-bit format on the same weights
(ringserve serves the Q4_1 file's weights dequantized; Q8_0 of them is exact to 8 bits).

    python bench/baselines/requantize_gguf.py SRC.gguf DST.gguf
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import gguf
import numpy as np

REQUANTIZED = {gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q5_0,
               gguf.GGMLQuantizationType.Q5_1, gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K,
               gguf.GGMLQuantizationType.Q6_K}


def requantize(src: Path, dst: Path) -> None:
    """Write ``dst``: ``src`` with its k-quant / legacy-quant tensors re-encoded as Q8_0.

    Raises:
        ValueError: ``src`` has no architecture field.
    """
    reader = gguf.GGUFReader(src)
    arch = reader.fields.get(gguf.Keys.General.ARCHITECTURE)
    if arch is None:
        raise ValueError(f"{src}: no {gguf.Keys.General.ARCHITECTURE} field")
    tmp = dst.with_suffix(f".{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(tmp, arch=arch.contents())
    for field in reader.fields.values():
        written = (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE)
        if field.name in written or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself / below
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    for t in reader.tensors:
        if t.tensor_type in REQUANTIZED:
            values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            writer.add_tensor(t.name, gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    a = p.parse_args()
    requantize(a.src, a.dst)
    print(a.dst)


if __name__ == "__main__":
    main()
