"""The segmented LoRA kernel (``kernels.triton_lora``) against the grouped torch product, on CPU
tensors under Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is
imported, hence the subprocess).

Two copies of a tiny Llama get the same adapters: one runs the CPU path (each adapter's own
A and B, two matmuls per adapter present), the other the CUDA path (``LoraModel(segmented=
True)``: the stacked weights and the kernel). Every wrapped linear -- fused qkv and gate_up,
o and down -- gets the same input and rows in both.
"""

from __future__ import annotations

from tests.helpers.triton_interpreter import run_interpreted

CHECK = r"""
import json, torch
from services.scheduler.kernels import triton_lora
from services.scheduler.lora.adapter import AdapterWeights
from services.scheduler.lora.layers import LoraModel
from services.scheduler.lora.registry import step_rows
from services.scheduler.models import dummy_model

HF = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=64, intermediate_size=96,
          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
          max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False)

def adapter(shapes, rank, scale, modules, seed):
    g = torch.Generator().manual_seed(seed)
    return AdapterWeights(rank, scale, {(0, m): (torch.randn(rank, shapes[m][0], generator=g) / 8,
                                                 torch.randn(shapes[m][1], rank, generator=g) / 8) for m in modules})

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (slots, token counts) per request: base rows between adapter rows, a prefill and a decode of
# slot 0, slot 3 adapting only the MLP (zero scale in the attention linears' stacks).
MIXED = ([None, 0, None, 1, 2, 0, None, 3], [2, 5, 1, 1, 4, 1, 1, 3])
out = {"interpreted": triton_lora.interpreted()}
for dtype in (torch.float32, torch.bfloat16):
    torch.manual_seed(0)
    cpu = dummy_model(HF, dtype, seed=0)
    gpu = dummy_model(HF, dtype, seed=0)
    ref, seg = LoraModel(cpu, segmented=False), LoraModel(gpu, segmented=True)
    shapes = ref.shapes
    placed = {0: adapter(shapes, 8, 2.0, ALL, 1), 1: adapter(shapes, 4, 0.5, ["q_proj", "v_proj"], 2),
              2: adapter(shapes, 16, 1.0, ["k_proj", "gate_proj", "down_proj"], 3),
              3: adapter(shapes, 2, 4.0, ["gate_proj", "up_proj", "down_proj"], 4)}
    for slot, w in placed.items():
        ref.add(slot, w)
        seg.add(slot, w)

    def compare(name, slots, counts):
        t = sum(counts)
        lora = step_rows(slots, counts)
        for m in (ref, seg):
            m.batch.set(*((lora[1], lora[0]) if lora is not None else (None, None)))
        worst, changed = 0.0, 0
        for a, b in zip(ref.linears, seg.linears, strict=True):
            x = torch.randn(t, a.in_local).to(dtype)
            want, got = a(x), b(x)
            base = a.base(x)
            worst = max(worst, ((got.float() - want.float()).abs() / (1 + want.float().abs())).max().item())
            changed += int((got != base).any(dim=1).sum())  # rows the adapters moved
            assert torch.equal(got[(want == base).all(dim=1)], base[(want == base).all(dim=1)])
        out[f"{name} {dtype}"] = [worst, changed]

    compare("mixed", *MIXED)
    compare("single row", [2], [1])
    compare("base only", [None, None], [3, 1])
    # An unload and a smaller rank in the freed slot (the stack keeps the largest rank, zero-padded).
    for m in (ref, seg):
        m.drop(0)
        m.add(0, adapter(shapes, 2, 3.0, ["o_proj", "up_proj"], 5))
    compare("reloaded", *MIXED)
    out[f"stack {dtype}"] = [list(seg.linears[0].stack.a.shape), list(seg.linears[0].stack.b.shape),
                             seg.linears[0].stack.scales.tolist(), seg.linears[1].stack.scales.tolist()]
print(json.dumps(out))
"""


# Largest |kernel - torch| / (1 + |torch|) over every row of every wrapped linear. The tiles sum
# in another order than torch's matmul; in bf16 both round the rank-R product to bf16, and the
# kernel rounds the scaled product before adding it where index_add_ rounds once: a few bf16
# ulps (2^-8 each) at most.
TOLERANCE = {"torch.float32": 2e-6, "torch.bfloat16": 2**-5}
# Rows the adapters changed, summed over qkv, o, gate_up, down (the rows of slots adapting each).
CHANGED = {"mixed": 11 + 6 + 13 + 13, "single row": 3, "base only": 0, "reloaded": 5 + 6 + 13 + 7}


def test_segmented_kernel_matches_grouped_torch_product():
    got = run_interpreted(CHECK)
    assert got.pop("interpreted") is True
    for dtype, tol in TOLERANCE.items():
        # The qkv stack: 4 slots, 3 parts x rank 16 (the largest), q 64 + k 32 + v 32 outputs;
        # its scales (slot 0 reloaded without qkv, slot 3 MLP-only: 0) and o_proj's.
        assert got.pop(f"stack {dtype}") == [[4, 48, 64], [4, 128, 48], [0.0, 0.5, 1.0, 0.0], [3.0, 0.0, 0.0, 0.0]]
        for case, changed in CHANGED.items():
            worst, moved = got.pop(f"{case} {dtype}")
            assert moved == changed and worst <= tol, (case, dtype, worst, moved)
    assert got == {}
