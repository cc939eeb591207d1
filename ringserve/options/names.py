"""The names each registry of implementations answers to: the choices of their options.

Torch-free and import-free, so the option table (and the launcher, which must not import
the services) can offer them as ``choices``. Each service checks its registry against the
list here when the registry's module is imported (``check_registry``): a name with no
implementation, or an implementation with no name, stops the service at once instead of
surfacing as an "invalid choice" or a ``KeyError`` later.
"""

from __future__ import annotations

from collections.abc import Iterable

# Model dtypes: "auto" and the names of executor.device's ``supported_dtypes`` (float16 on CUDA only).
DTYPES = ("auto", "float32", "bfloat16", "float16")
# services.scheduler.attention.backends.ATTENTION_BACKENDS; the flag adds "auto".
ATTENTION_BACKENDS = ("torch", "cpu", "triton")
# services.scheduler.layers.quant: per-channel int8 linears (W8A8 or weight-only, the faster) or weight-only.
QUANTIZATION_METHODS = ("int8", "int8wo")
# services.scheduler.policy.grammar_backends.GRAMMAR_BACKENDS (each needs its package installed).
GRAMMAR_BACKENDS = ("llguidance", "xgrammar")
# services.scheduler.policy.schedule: first come first served, longest cached prefix first, by
# request priority then arrival (ringserve.priority.PRIORITY_POLICY).
SCHEDULE_POLICIES = ("fcfs", "lpm", "priority")
# services.scheduler.speculative: how draft tokens are proposed (none: off).
SPECULATIVE_ALGORITHMS = ("none", "ngram", "draft")
# services.scheduler.models: safetensors, or random weights of config.json's shapes.
LOAD_FORMATS = ("auto", "dummy")
# services.gateway.reasoning.REASONING_PARSERS.
REASONING_PARSERS = ("deepseek_r1", "qwen3")
# services.gateway.tool_parsers.TOOL_CALL_PARSERS; the flag adds "none".
TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")


def check_registry(what: str, implemented: Iterable[str], names: Iterable[str]) -> None:
    """Raise unless a registry's keys are exactly the names its option offers.

    Call it where the registry is defined, so the mismatch fails at import.

    Raises:
        RuntimeError: naming the names with no implementation and the implementations with
            no name in ``ringserve.options.names``.
    """
    implemented, names = set(implemented), set(names)
    if implemented == names:
        return
    problems = []
    if names - implemented:
        problems.append(f"no implementation of {', '.join(sorted(names - implemented))}")
    if implemented - names:
        problems.append(f"{', '.join(sorted(implemented - names))} not named in ringserve.options.names")
    raise RuntimeError(f"{what} registry and its option's choices differ: {'; '.join(problems)}")
