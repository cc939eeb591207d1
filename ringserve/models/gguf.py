"""GGUF files as servable model directories: what every service does with ``--model`` at start-up.

``resolve_model`` leaves an HF-format directory as it is and converts a GGUF file once
(weights dequantized to fp32 safetensors; config, tokenizer and chat template from its
metadata) into ``$RINGSERVE_CACHE_DIR/models/gguf``, reused by every later start.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

DEFAULT_CACHE = Path(os.path.expanduser("~/.cache/ringserve"))
# Bump when the conversion changes, so caches built by older code are rebuilt.
CONVERSION_VERSION = "1"


@contextmanager
def staged_dir(out_dir: Path, marker: str, version: str) -> Iterator[Path]:
    """A scratch directory beside ``out_dir`` that replaces it, stamped with ``marker``
    holding ``version``, only if the body succeeds; a failed build leaves no partial cache."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".convert-"))
    try:
        yield tmp
        (tmp / marker).write_text(version)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


@contextmanager
def gguf_read_once() -> Iterator[None]:
    """Within it, one ``gguf.GGUFReader`` per file and one tensor-name map per architecture.

    A GGUF load through transformers parses the file's metadata three times (tokenizer,
    config, weights: about 5 s each for SmolLM2's 49,152-token vocabulary on a shared core)
    and rebuilds gguf's tensor-name map once per module of the model (about 7 s). transformers
    imports both names from the ``gguf`` module at call time, so caching them there for the
    length of a conversion removes the repeats; the readers only read (a memory map)."""
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    # A cached function in the class's place, for the length of the conversion (see above).
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(saved[0])  # type: ignore[misc,assignment]
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved  # type: ignore[misc]


def convert_gguf(gguf_path: Path, out_dir: Path, progress: bool = False) -> None:
    """Dequantize a GGUF (any architecture transformers' GGUF loading knows: Llama family,
    Qwen2, Gemma 3, ...) into an fp32 safetensors HF directory.

    transformers reads the GGUF (weights dequantized to fp32, tokenizer and
    chat template from the GGUF metadata); ``save_pretrained`` needs the GGUF
    quantizer detached from the model first.

    Args:
        progress: show progress bars on stderr (tqdm): the conversion's four stages, and
            transformers' own bar over the tensors it dequantizes.
    """
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if progress:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()

    with staged_dir(out_dir, ".ringserve-conversion", CONVERSION_VERSION) as tmp, gguf_read_once(), \
            tqdm(total=4, desc=f"converting {gguf_path.name}", unit="stage", disable=not progress) as bar:
        bar.set_postfix_str("tokenizer")
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        bar.update()
        bar.set_postfix_str("dequantizing weights")
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        bar.update()
        # Plain attributes of transformers' model, which torch's Module.__setattr__ types as tensors or modules.
        model.hf_quantizer = None  # type: ignore[assignment]
        if hasattr(model, "is_quantized"):
            model.is_quantized = False  # type: ignore[assignment]
        model.config.quantization_config = None
        if hasattr(model.config, "_pre_quantization_dtype"):
            del model.config._pre_quantization_dtype
        bar.set_postfix_str("writing safetensors")
        model.save_pretrained(str(tmp), safe_serialization=True)
        bar.update()
        bar.set_postfix_str("writing tokenizer")
        tok.save_pretrained(str(tmp))
        bar.update()


def cache_dir_from_env() -> Path:
    """``$RINGSERVE_CACHE_DIR``, or ``DEFAULT_CACHE`` (``~/.cache/ringserve``) when unset."""
    return Path(os.environ.get("RINGSERVE_CACHE_DIR") or DEFAULT_CACHE)


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a GGUF file (a regular file starting with the magic ``GGUF``)."""
    try:
        with open(path, "rb") as f:
            return Path(path).is_file() and f.read(4) == b"GGUF"
    except OSError:
        return False


def gguf_model_dir(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """Where the conversion of ``gguf_path`` lives: ``<cache>/models/gguf/<key>/<file stem>``.

    The key is the first 16 hex digits of the sha256 of the file's absolute path, size and
    modification time (nanoseconds): computed without reading the file (hashing a GGUF of
    several GB would cost more than a start), and a file replaced or rewritten in place gets
    a new key, so a stale conversion is never served. The directory's name is the file's
    stem, so the served model name (a directory's name by default) is the file's.
    """
    import hashlib

    path = Path(gguf_path).resolve()
    st = path.stat()
    key = hashlib.sha256(f"{path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return (cache_dir or cache_dir_from_env()) / "models" / "gguf" / key / path.stem


def resolve_model(model: Path, cache_dir: Path | None = None, progress: bool = True) -> Path:
    """The HF-format directory to serve for ``--model``: a directory as it is; a GGUF file
    converted once into ``gguf_model_dir`` (config, tokenizer and chat template from the GGUF
    metadata, fp32 safetensors), then reused by every later start.

    Conversion runs under an exclusive ``flock`` on ``<key dir>.lock``, so services started
    together on one GGUF (the scheduler, the tokenizer, the detokenizer) convert it once:
    the others wait and find it ready.

    Raises:
        RuntimeError: the conversion failed (transformers' message included).
    """
    import fcntl

    model = Path(model)
    if not is_gguf(model):
        return model
    out_dir = gguf_model_dir(model, cache_dir)
    marker = out_dir / ".ringserve-conversion"
    if marker.exists() and marker.read_text() == CONVERSION_VERSION:
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(out_dir.parent.with_name(out_dir.parent.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (marker.exists() and marker.read_text() == CONVERSION_VERSION):
            try:
                convert_gguf(model, out_dir, progress=progress)
            except Exception as exc:
                raise RuntimeError(f"converting {model} failed: {exc}") from exc
    return out_dir
