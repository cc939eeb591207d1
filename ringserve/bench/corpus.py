"""Text no one wrote for this project, present on every Python installation: the quality
corpus of int8 weights (``tests/scheduler/test_quantization.py``, ``bench/int8_quality.py``)."""

from __future__ import annotations

import os
import pydoc_data.topics
import sysconfig


def python_docs_text() -> str:
    """Python's licence (``LICENSE.txt`` beside the standard library), then every topic of the
    language reference that ``pydoc`` ships (``pydoc_data.topics``, sorted by name), joined
    by blank lines; about 110,000 SmolLM2 tokens on Python 3.11.

    Raises:
        OSError: the standard library has no LICENSE.txt (a stripped installation).
    """
    licence = os.path.join(sysconfig.get_paths()["stdlib"], "LICENSE.txt")
    with open(licence, encoding="utf-8") as f:
        parts = [f.read()]
    parts += [pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics)]
    return "\n\n".join(parts)
