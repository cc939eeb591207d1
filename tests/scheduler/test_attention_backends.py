"""Attention backends: SmolLM2 run by the engine with the Triton backend (Triton's interpreter,
CPU tensors) gives the torch backend's logits step for step, through a batched prefill, a
prefill on a radix-cached prefix, decodes, and chunked prefills mixed with decodes; the
registry and the flag refuse what they cannot run, naming what is missing.

TRITON_INTERPRET must be set before triton is imported, hence the subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ringserve.launch import parse_args as launch_args
from ringserve.options.names import ATTENTION_BACKENDS
from services.scheduler.attention.backends import ATTENTION_BACKENDS as REGISTRY
from services.scheduler.attention.backends import create_attention_backend
from services.scheduler.executor.device import create_runtime
from services.scheduler.main import parse_args

ROOT = Path(__file__).resolve().parents[2]

SAME_LOGITS = r"""
import json, sys, torch
from pathlib import Path
from tokenizers import Tokenizer
from services.scheduler.attention.backends import create_attention_backend
from services.scheduler.config import EngineConfig
from services.scheduler.engine.engine import Engine
from services.scheduler.executor.device import create_runtime
from services.scheduler.models import load_model
from services.scheduler.policy.req import ReqInput, SamplingParams
from services.scheduler.policy.stops import load_eos_ids

torch.set_num_threads(2)
model_dir = Path(sys.argv[1])
tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
eos = load_eos_ids(model_dir, tok)
# Deterministic inference off: the backends' own extend kernels are compared (with it, the cpu
# backend would attend extend tokens with its decode kernel, in other bf16 arithmetic than SDPA).
cfg = EngineConfig(model=model_dir, max_running_requests=4, max_total_tokens=512, seed=0, chunked_prefill_size=16,
                   deterministic_inference=False)

def chat(text):
    return tok.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n").ids

def greedy(rid, ids, n):
    return ReqInput(rid=rid, input_ids=ids, sampling=SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True))

other, dtype = sys.argv[2], getattr(torch, sys.argv[3])

def run(backend):
    model = load_model(model_dir, dtype, attention_backend=backend)
    engine = Engine(model, tok, eos, cfg)
    steps, forward = [], engine.runner.forward
    def record(plan):
        logits = forward(plan)
        steps.append(([plan.num_extend, list(plan.prefix_lens), list(plan.extend_lens), len(plan.reqs)], logits))
        return logits
    engine.runner.forward = record
    outputs = {}
    def step():
        out = engine.step()
        for rid, tid in zip(out.rids, out.output_ids):
            outputs.setdefault(rid, []).append(tid)
    def drain():
        while engine.has_work:
            step()
    # Step 1: two fresh prompts share the 16-token chunk budget. Step 2: the rest of b's
    # prompt beside a's decode; a finishes into the radix cache. Step 3: c's prompt on a's
    # cached one beside b's decode. Step 4: decodes of unequal lengths.
    engine.add_request(greedy("a", chat("Hi"), 2))
    engine.add_request(greedy("b", chat("Name a color"), 3))
    step()
    step()
    engine.add_request(greedy("c", chat("Hi") + chat("Count to three"), 2))
    drain()
    return type(model.attn_backend).__name__, [s[0] for s in steps], torch.cat([s[1].flatten() for s in steps]), outputs

torch_name, torch_plans, torch_logits, torch_out = run("torch")
triton_name, triton_plans, triton_logits, triton_out = run(other)
print(json.dumps({
    "backends": [torch_name, triton_name],
    "auto_on_cuda": create_attention_backend("auto", create_runtime(torch.device("cuda"))).name,
    "plans": [torch_plans, triton_plans],
    "outputs": [torch_out, triton_out],
    "max_abs_diff": (torch_logits - triton_logits).abs().max().item(),
    "logit_scale": torch_logits.abs().max().item(),
}))
"""

REFUSALS = r"""
import json, sys, torch
from services.scheduler.attention.backends import create_attention_backend
from services.scheduler.executor.device import create_runtime
from services.scheduler.models import load_model

errors = {}
for what, call in {
    "backend": lambda: create_attention_backend("triton", create_runtime(torch.device("cpu"))),
    "model": lambda: load_model(sys.argv[1], torch.float32, "dummy", attention_backend="triton"),
}.items():
    try:
        call()
    except RuntimeError as e:
        errors[what] = str(e)
print(json.dumps(errors))
"""


def _run(script: str, model_dir: Path, interpret: bool, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", script, str(model_dir), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_triton_backend_gives_the_torch_backends_logits(smollm2_dir):
    got = _run(SAME_LOGITS, smollm2_dir, True, "triton", "float32")
    assert got["backends"] == ["TorchAttnBackend", "TritonAttnBackend"]
    assert got["auto_on_cuda"] == "triton"
    torch_plans, triton_plans = got["plans"]
    assert triton_plans == torch_plans
    # [num_extend, prefix_lens, extend_lens, len(reqs)] per step: see the script's comments.
    assert torch_plans == [[2, [0, 0], [10, 6], 2], [1, [6, 10], [6, 1], 2], [1, [10, 12], [12, 1], 2],
                           [0, [13, 22], [1, 1], 2]]
    assert got["outputs"][1] == got["outputs"][0]
    assert {rid: len(ids) for rid, ids in got["outputs"][0].items()} == {"a": 2, "b": 3, "c": 2}
    # fp32 throughout; only the summation order differs (online softmax, blocked dot products).
    assert got["logit_scale"] > 5.0 and got["max_abs_diff"] < 2e-4


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_backend_gives_the_torch_backends_tokens(smollm2_dir, dtype):
    got = _run(SAME_LOGITS, smollm2_dir, False, "cpu", dtype)
    assert got["backends"] == ["TorchAttnBackend", "CpuAttnBackend"]
    torch_plans, cpu_plans = got["plans"]
    assert cpu_plans == torch_plans == [[2, [0, 0], [10, 6], 2], [1, [6, 10], [6, 1], 2], [1, [10, 12], [12, 1], 2],
                                        [0, [13, 22], [1, 1], 2]]
    assert got["outputs"][1] == got["outputs"][0]
    assert {rid: len(ids) for rid, ids in got["outputs"][0].items()} == {"a": 2, "b": 3, "c": 2}
    # fp32: summation orders and a polynomial exp differ. bf16: the torch path rounds the
    # scores and probabilities to bf16 between its attention matmuls; the kernel does not
    # (measured: 0.625 at logits up to 35, a few bf16 steps after 30 layers).
    assert got["logit_scale"] > 5.0 and got["max_abs_diff"] < {"float32": 2e-4, "bfloat16": 1.0}[dtype], got


def test_triton_on_cpu_without_the_interpreter_is_refused(tmp_path, smollm2_dir):
    (tmp_path / "config.json").write_text((smollm2_dir / "config.json").read_text())
    errors = _run(REFUSALS, tmp_path, interpret=False)
    for what in ("backend", "model"):
        assert errors[what].startswith("attention backend 'triton' on a cpu device needs Triton's interpreter: "
                                       "set TRITON_INTERPRET=1"), errors


def test_registry_refuses_unknown_names_listing_the_known_ones():
    assert set(ATTENTION_BACKENDS) == set(REGISTRY)
    with pytest.raises(ValueError, match=r"^unknown attention backend 'flash'; known: auto, cpu, torch, triton$"):
        create_attention_backend("flash", create_runtime(torch.device("cpu")))
    assert create_attention_backend("auto", create_runtime(torch.device("cpu"))).name == "cpu"


def test_flag_reaches_the_frozen_configs(capsys):
    assert parse_args(["--model", "m"]).engine.attention_backend == "auto"
    assert parse_args(["--model", "m", "--attention-backend", "triton"]).engine.attention_backend == "triton"
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model", "m", "--attention-backend", "flash"])
    assert exc.value.code == 2
    assert "argument --attention-backend: invalid choice: 'flash' (choose from 'auto', 'torch', 'cpu', 'triton')" \
        in capsys.readouterr().err
    assert launch_args(["--attention-backend", "triton"]).passed("scheduler") == ("--attention-backend", "triton")
    assert launch_args([]).passed("scheduler") == ()  # auto is the scheduler's own default
