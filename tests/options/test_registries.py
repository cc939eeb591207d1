"""Each registry of implementations answers to exactly the names its option offers
(ringserve/options/names.py); the modules also check this when imported."""

from __future__ import annotations

import torch

from ringserve.options import names
from services.gateway.reasoning import REASONING_PARSERS
from services.gateway.tool_parsers import TOOL_CALL_PARSERS
from services.scheduler.attention.backends import ATTENTION_BACKENDS
from services.scheduler.executor.device import CudaRuntime, DeviceRuntime
from services.scheduler.layers.quant import QUANTIZATION_METHODS
from services.scheduler.policy.grammar_backends import GRAMMAR_BACKENDS


def test_gateway_parsers_are_the_names() -> None:
    assert sorted(REASONING_PARSERS) == sorted(names.REASONING_PARSERS) == ["deepseek_r1", "qwen3"]
    assert sorted(TOOL_CALL_PARSERS) == sorted(names.TOOL_CALL_PARSERS) == ["hermes", "llama3_json", "mistral",
                                                                          "pythonic"]


def test_scheduler_registries_are_the_names() -> None:
    assert sorted(ATTENTION_BACKENDS) == sorted(names.ATTENTION_BACKENDS) == ["cpu", "torch", "triton"]
    assert sorted(GRAMMAR_BACKENDS) == sorted(names.GRAMMAR_BACKENDS) == ["llguidance", "xgrammar"]
    assert QUANTIZATION_METHODS == names.QUANTIZATION_METHODS == ("int8", "int8wo")


def test_dtypes_are_auto_and_what_the_devices_run() -> None:
    cpu = DeviceRuntime(torch.device("cpu")).supported_dtypes()
    cuda = CudaRuntime(torch.device("cuda")).supported_dtypes()  # no GPU needed to ask
    assert set(cpu) <= set(cuda)
    assert names.DTYPES == ("auto", *cuda)
