"""fp8_align.quant against the independent numpy reference in tests/fp8_reference.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp8_align.quant import (
    E4M3_MAX,
    blockwise_fp8_linear,
    dequantize_blockwise,
    dequantize_groupwise,
    quantize_activation_groupwise,
    quantize_weight_blockwise,
)
from tests.fp8_reference import reference_blockwise_linear, reference_quantize_blocks

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _random_tensor(shape: tuple[int, ...], seed: int, dtype: torch.dtype, log_range: float) -> torch.Tensor:
    """Gaussian values times a per-element magnitude spread over 10**[-log_range, log_range]."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=gen)
    spread = 10 ** ((torch.rand(shape, generator=gen) * 2 - 1) * log_range)
    return (base * spread).to(dtype)


shapes = st.tuples(st.integers(1, 300), st.integers(1, 300))


@settings(max_examples=60, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), pow2=st.booleans(), dtype=st.sampled_from(DTYPES),
       log_range=st.sampled_from([0.0, 1.0, 3.0]))
def test_weight_codes_and_scales_bit_exact(shape, seed, pow2, dtype, log_range):
    w = _random_tensor(shape, seed, dtype, log_range)
    codes, scales = quantize_weight_blockwise(w, pow2_scale=pow2)
    ref_codes, ref_scales = reference_quantize_blocks(w.float().numpy(), 128, 128, pow2)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert scales.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    np.testing.assert_array_equal(scales.numpy(), ref_scales)
    np.testing.assert_array_equal(codes.float().numpy().astype(np.float64), ref_codes)


@settings(max_examples=60, deadline=None)
@given(lead=st.lists(st.integers(1, 5), min_size=0, max_size=3), k=st.integers(1, 400),
       seed=st.integers(0, 2**31 - 1), pow2=st.booleans(), dtype=st.sampled_from(DTYPES))
def test_activation_codes_and_scales_bit_exact(lead, k, seed, pow2, dtype):
    x = _random_tensor((*lead, k), seed, dtype, 2.0)
    codes, scales = quantize_activation_groupwise(x, pow2_scale=pow2)
    assert codes.shape == x.shape and scales.shape == (*lead, math.ceil(k / 128))
    flat = x.float().reshape(-1, k).numpy()
    ref_codes, ref_scales = reference_quantize_blocks(flat, 1, 128, pow2)
    np.testing.assert_array_equal(scales.reshape(-1, scales.shape[-1]).numpy(), ref_scales)
    np.testing.assert_array_equal(codes.float().reshape(-1, k).numpy().astype(np.float64), ref_codes)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), pow2=st.booleans())
def test_dequantization_error_bound(shape, seed, pow2):
    """E4M3 keeps 3 mantissa bits: rounding a normal value moves it by at most half a step,
    2**-4 relative. Below 2**-6 (subnormals) steps are 2**-9 absolute, in units of the scale, so
    the error is at most 2**-10 * scale. The FP32 division adds <= 2**-24 relative (slack 1e-6)."""
    w = _random_tensor(shape, seed, torch.float32, 2.0)
    codes, scales = quantize_weight_blockwise(w, pow2_scale=pow2)
    back = dequantize_blockwise(codes, scales, dtype=torch.float32)
    scale_full = scales.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    bound = torch.maximum(w.abs() * 2.0**-4, scale_full * 2.0**-10) * (1 + 1e-6)
    assert bool(((back - w).abs() <= bound).all())


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_pow2_scales_are_powers_of_two_and_never_overflow(shape, seed):
    w = _random_tensor(shape, seed, torch.bfloat16, 3.0)
    codes, scales = quantize_weight_blockwise(w, pow2_scale=True)
    mantissa, _ = torch.frexp(scales)
    assert bool((mantissa == 0.5).all())
    fp32_codes, fp32_scales = quantize_weight_blockwise(w, pow2_scale=False)
    assert bool((scales >= fp32_scales).all()) and bool((scales < 2 * fp32_scales).all())
    # amax / scale <= 448 exactly, so no element was clamped: the block max maps inside the range.
    assert float(codes.float().abs().max()) <= E4M3_MAX


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), pow2=st.booleans())
def test_codes_bounded_and_fp32_blocks_reach_448(shape, seed, pow2):
    w = _random_tensor(shape, seed, torch.float32, 1.0)
    codes, _ = quantize_weight_blockwise(w, pow2_scale=pow2)
    mags = codes.float().abs()
    assert float(mags.max()) <= E4M3_MAX
    if not pow2:  # with amax/448 scales the largest element of every block lands on 448
        nb, kb = math.ceil(shape[0] / 128), math.ceil(shape[1] / 128)
        for i in range(nb):
            for j in range(kb):
                assert float(mags[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].max()) == E4M3_MAX


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1), pow2=st.booleans())
def test_requantizing_dequantized_weight_is_idempotent(shape, seed, pow2):
    """FP32 scales: the block max dequantizes to 448 * s, so s and every code come back unchanged.
    Pow2 scales: a block whose max code rounded down to exactly 224 comes back with scale s/2 and
    doubled codes (the same values; doubling an E4M3 value is exact), so there the fixed point
    is in value; every block whose scale is unchanged must keep its codes bit-for-bit."""
    w = _random_tensor(shape, seed, torch.bfloat16, 2.0)
    codes, scales = quantize_weight_blockwise(w, pow2_scale=pow2)
    back = dequantize_blockwise(codes, scales, dtype=torch.float32)
    codes2, scales2 = quantize_weight_blockwise(back, pow2_scale=pow2)
    assert torch.equal(dequantize_blockwise(codes2, scales2, dtype=torch.float32), back)
    same_scale = (scales2 == scales).repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    if not pow2:
        assert bool(same_scale.all())
    else:
        assert bool(((scales2 == scales / 2) | (scales2 == scales)).all())
    assert torch.equal(codes.view(torch.uint8)[same_scale], codes2.view(torch.uint8)[same_scale])


def test_partial_edge_blocks_are_independent():
    """A 130x260 weight has 2x3 blocks; the 2-row / 4-column edge blocks get their own scales."""
    w = torch.ones(130, 260)
    w[128:, :] = 1000.0
    w[:, 256:] = 0.001
    _, scales = quantize_weight_blockwise(w)
    assert scales.shape == (2, 3)
    assert scales[0, 0] == pytest.approx(1 / 448)
    assert scales[1, 0] == pytest.approx(1000 / 448)
    assert scales[0, 2] == pytest.approx(0.001 / 448, rel=1e-6)


def test_all_zero_blocks_give_finite_scales_and_zero_codes():
    w = torch.zeros(200, 300, dtype=torch.bfloat16)
    w[:128, :128] = 0.5
    for pow2 in (False, True):
        codes, scales = quantize_weight_blockwise(w, pow2_scale=pow2)
        assert bool(torch.isfinite(scales).all()) and bool((scales > 0).all())
        assert float(codes.float()[128:].abs().max()) == 0.0
        assert torch.equal(dequantize_blockwise(codes, scales)[:, 128:], w[:, 128:])
    x_codes, x_scales = quantize_activation_groupwise(torch.zeros(3, 256))
    assert bool(torch.isfinite(x_scales).all()) and float(x_codes.float().abs().max()) == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_raises_naming_shape(bad):
    w = torch.randn(64, 96)
    w[3, 5] = bad
    with pytest.raises(ValueError, match=r"shape \(64, 96\)"):
        quantize_weight_blockwise(w)
    with pytest.raises(ValueError, match=r"shape \(64, 96\)"):
        quantize_activation_groupwise(w)


@pytest.mark.parametrize(
    ("tensor", "kwargs", "error"),
    [
        (torch.randint(0, 5, (8, 8)), {}, TypeError),
        (torch.randn(8), {}, TypeError),
        (torch.randn(2, 8, 8), {}, TypeError),
        (torch.randn(8, 8).to(torch.float8_e4m3fn), {}, TypeError),
        (torch.randn(8, 8), {"block_size": (0, 128)}, ValueError),
        (torch.randn(8, 8), {"block_size": (128,)}, ValueError),
    ],
)
def test_bad_weight_inputs_raise(tensor, kwargs, error):
    with pytest.raises(error):
        quantize_weight_blockwise(tensor, **kwargs)


def test_dequantize_rejects_mismatched_scales():
    codes, scales = quantize_weight_blockwise(torch.randn(200, 200))
    with pytest.raises(ValueError, match="scale_inv shape"):
        dequantize_blockwise(codes, scales[:1])
    x_codes, x_scales = quantize_activation_groupwise(torch.randn(4, 200))
    with pytest.raises(ValueError, match="scale shape"):
        dequantize_groupwise(x_codes, x_scales[:, :1])


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 40), n=st.integers(1, 300), k=st.integers(1, 300), seed=st.integers(0, 2**31 - 1),
       pow2=st.booleans())
def test_blockwise_linear_matches_float64_reference(m, n, k, seed, pow2):
    """Same FP8 operands, exact float64 math in the reference. Each K slice of 128 products is
    summed in FP32 (relative error <= 128 * 2**-24 of the sum of |terms|), and at most
    ceil(K/128) slices are accumulated in FP32; bound: (k + KB) * 2**-24 * sum|x_i w_i| (+1e-30)."""
    x = _random_tensor((m, k), seed, torch.bfloat16, 1.0)
    w = _random_tensor((n, k), seed + 1, torch.bfloat16, 1.0)
    w_codes, w_scales = quantize_weight_blockwise(w)
    y = blockwise_fp8_linear(x, w_codes, w_scales, activation_pow2_scale=pow2, out_dtype=torch.float32)
    x_codes, x_scales = quantize_activation_groupwise(x, pow2_scale=pow2)
    ref = reference_blockwise_linear(x_codes.double().numpy(), x_scales.numpy(), w_codes.double().numpy(), w_scales.numpy())
    x_abs = (x_codes.double() * x_scales.repeat_interleave(128, 1)[:, :k].double()).abs()
    w_abs = (w_codes.double() * w_scales.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k].double()).abs()
    magnitude = (x_abs @ w_abs.T).numpy()
    bound = (k + math.ceil(k / 128)) * 2.0**-24 * magnitude + 1e-30
    assert np.all(np.abs(y.double().numpy() - ref) <= bound)


def test_blockwise_linear_close_to_bf16_product_and_handles_bias_and_leading_dims():
    """Against the unquantized product: each operand carries <= 2**-4 relative error, so the
    product error is <= (2 * 2**-4 + 2**-8) * sum|x_i w_i| per output; bf16 output adds 2**-8."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 576, dtype=torch.bfloat16)
    w = torch.randn(1536, 576, dtype=torch.bfloat16) * 0.05
    bias = torch.randn(1536, dtype=torch.bfloat16)
    codes, scales = quantize_weight_blockwise(w)
    y = blockwise_fp8_linear(x, codes, scales, bias=bias)
    assert y.shape == (2, 3, 1536) and y.dtype == torch.bfloat16
    exact = x.double() @ w.double().T
    magnitude = x.double().abs() @ w.double().abs().T
    bound = (2 * 2.0**-4 + 2.0**-8) * magnitude + 2.0**-8 * exact.abs() + 2.0**-8 * bias.double().abs()
    assert bool(((y.double() - bias.double() - exact).abs() <= bound + 1e-3).all())


def test_blockwise_linear_rejects_bad_shapes():
    codes, scales = quantize_weight_blockwise(torch.randn(256, 256))
    with pytest.raises(ValueError, match="in_features"):
        blockwise_fp8_linear(torch.randn(4, 200), codes, scales)
    with pytest.raises(ValueError, match="scale_inv shape"):
        blockwise_fp8_linear(torch.randn(4, 256), codes, scales[:, :1])


def test_quantize_weight_into_writes_views_on_cpu() -> None:
    """The CPU branch of `quantize_weight_into` writes the reference result into row views."""
    from fp8_align.quant.dispatch import quantize_weight_into

    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    codes = torch.zeros(428, 200, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(4, 2)
    got_codes, got_scales = quantize_weight_into(w, True, codes[128:], scales[1:])
    ref_codes, ref_scales = quantize_weight_blockwise(w, pow2_scale=True)
    assert got_codes.data_ptr() == codes[128:].data_ptr()
    assert torch.equal(codes[128:].view(torch.uint8), ref_codes.view(torch.uint8))
    assert torch.equal(scales[1:], ref_scales)
    assert not codes[:128].view(torch.uint8).any() and not scales[0].any()
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_weight_into(torch.full((4, 4), float("nan")), False)
