"""bf16 linears on AMX-BF16 tiles (``layers.cpu_linear.AmxBf16Linear``): the packed layout, the
sums against fp32, batch invariance at every row count and thread count, the fused producers,
and where ``pack_linears`` uses them."""

from __future__ import annotations

import pytest
import torch

from services.scheduler.kernels import cpu_kernels
from services.scheduler.layers import cpu_linear
from services.scheduler.layers.cpu_linear import AmxBf16Linear, amx_bf16_available, pack_amx_bf16
from services.scheduler.layers.linear import PackedLinear, can_pack, pack_linears

needs_amx = pytest.mark.skipif(not amx_bf16_available(), reason="this CPU has no AMX-BF16: oneDNN runs bf16 here")


def _linear(n: int, k: int, bias: bool, seed: int = 0) -> tuple[AmxBf16Linear, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g) if bias else None
    return AmxBf16Linear(w, b), w, b


def test_the_packed_layout_is_the_b_tiles_of_16_channel_blocks():
    w = torch.arange(40 * 64, dtype=torch.float32).view(40, 64).bfloat16()
    packed = pack_amx_bf16(w)
    assert packed.shape == (3, 32, 16, 2)  # 40 channels -> 3 blocks of 16, the last 8 zero
    for b, r, j, e in ((0, 0, 0, 0), (0, 0, 0, 1), (1, 5, 3, 1), (2, 31, 7, 0)):
        assert packed[b, r, j, e] == w[16 * b + j, 2 * r + e]
    assert not packed[2, :, 8:].any()


@needs_amx
@pytest.mark.parametrize("n,k,bias", [(100, 576, True), (1536, 576, False), (576, 1536, True), (16, 32, False)])
def test_each_row_is_the_fp32_product_rounded_once_and_the_same_at_every_row_count(n, k, bias):
    """Within one bf16 rounding of the fp32 product (the sums are fp32); a row's bits the same
    in calls of 1-140 rows (one tile pass, the padding of the last row tile, and at K 1536 the
    kernel's chunks of 128 rows) on 1 and 2 threads."""
    linear, w, b = _linear(n, k, bias)
    x = torch.randn(140, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        y = linear(x)
        ref = x.float() @ w.float().T + (b if b is not None else 0)
        assert y.dtype == torch.bfloat16 and y.shape == (140, n)
        # one bf16 rounding, plus fp32 summation error where the sum cancels
        bound = torch.finfo(torch.bfloat16).eps * ref.abs() + 2.0**-20 * (x.float().abs() @ w.float().abs().T)
        assert ((y.float() - ref).abs() <= bound).all()
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for m in (1, 2, 15, 16, 17, 31, 32, 33, 64, 70, 129, 140):
                assert torch.equal(linear(x[-m:].contiguous()), y[-m:]), (threads, m)
    finally:
        torch.set_num_threads(before)


@needs_amx
def test_the_norm_and_silu_in_the_call_give_the_separate_kernels_bits():
    linear, _, _ = _linear(64, 576, True)
    g = torch.Generator().manual_seed(3)
    x, res = torch.randn(5, 576, generator=g).bfloat16(), torch.randn(5, 576, generator=g).bfloat16()
    weight = (1 + 0.1 * torch.randn(576, generator=g)).bfloat16()
    res_c = res.clone()
    fused = linear(x, norm=(weight, 1e-5, res_c))
    res_sep = res.clone()
    assert torch.equal(fused, linear(cpu_kernels.add_rms_norm(x, weight, 1e-5, res_sep)))
    assert torch.equal(res_c, res_sep)  # the residual updated in place as the separate kernel does
    down, _, _ = _linear(64, 288, False)
    gate_up = torch.randn(5, 576, generator=g).bfloat16()
    assert torch.equal(down(gate_up, silu_and_mul=True), down(cpu_kernels.silu_and_mul(gate_up)))


@needs_amx
def test_fp32_activations_a_wrong_width_and_an_untileable_weight_are_refused():
    with pytest.raises(ValueError, match="in_features a multiple of 32"):
        AmxBf16Linear(torch.zeros(16, 48, dtype=torch.bfloat16), None)
    linear, _, _ = _linear(32, 64, False)
    with pytest.raises(ValueError, match="AmxBf16Linear runs kernel 'bf16amx' on bf16 activations"):
        linear(torch.randn(2, 64))
    with pytest.raises(ValueError, match="takes \\[T, 64\\], got \\[2, 63\\]"):
        linear(torch.randn(2, 63).bfloat16())


@pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)), reason="this torch has no oneDNN bf16")
def test_pack_linears_puts_tile_shapes_on_amx_and_the_rest_on_onednn():
    model = torch.nn.Sequential(torch.nn.Linear(64, 48, dtype=torch.bfloat16),
                                torch.nn.Linear(48, 40, dtype=torch.bfloat16))  # 48: not a multiple of 32
    assert pack_linears(model) == 2
    assert type(model[0]) is (AmxBf16Linear if amx_bf16_available() else PackedLinear)
    assert type(model[1]) is PackedLinear


@pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)), reason="this torch has no oneDNN bf16")
def test_without_the_c_kernels_bf16_stays_on_onednn(monkeypatch):
    def no_compiler():
        raise cpu_kernels.KernelBuildError("C compiler 'cc' not usable")

    cpu_linear.amx_bf16_available.cache_clear()
    cpu_linear.lib.cache_clear()
    monkeypatch.setattr(cpu_linear, "library", no_compiler)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(64, 48, dtype=torch.bfloat16))
        assert pack_linears(model) == 1 and type(model[0]) is PackedLinear
    finally:
        monkeypatch.undo()
        cpu_linear.amx_bf16_available.cache_clear()
        cpu_linear.lib.cache_clear()
