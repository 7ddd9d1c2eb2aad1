"""Scale rules shared by weight and activation quantization (pure math, no plumbing).

A scale here is always the *dequantization* multiplier (`scale_inv` in TransformerEngine and
DeepGEMM terms): `x ~= code * scale`, `code = clamp(x / scale, -448, 448)` rounded to E4M3.
"""

from __future__ import annotations

import torch

#: Largest finite float8_e4m3fn value.
E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
#: Smallest positive normal FP32 value: the floor of every scale.
FP32_TINY = torch.finfo(torch.float32).tiny


def scale_from_amax(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    """FP32 dequantization scales from FP32 absolute maxima (any shape, same shape out).

    `scale = amax / 448`, or the smallest power of two >= that when `pow2` (UE8M0 scales, so
    `amax / scale <= 448` and nothing saturates). An all-zero group (amax == 0) gets scale 1.0,
    which is finite and a power of two; its codes are all zero. Scales never underflow to 0.
    """
    amax = amax.to(torch.float32)
    # Divide by a tensor, not a Python float: on CUDA, `tensor / scalar` is computed as a
    # multiplication by the rounded reciprocal, which differs from the correctly rounded
    # quotient (what CPU and the FP8 kernels compute) in about half of all values.
    divisor = torch.full_like(amax, E4M3_MAX)
    scale = torch.where(amax > 0, amax / divisor, torch.ones_like(amax)).clamp_min(FP32_TINY)
    if pow2:
        scale = round_up_to_pow2(scale)
    return scale


def round_up_to_pow2(scale: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= each positive FP32 value, computed exactly via frexp.

    frexp gives `scale = m * 2**e` with m in [0.5, 1); the result is 2**(e-1) when m == 0.5
    (already a power of two) and 2**e otherwise. No log2 rounding is involved.
    """
    mantissa, exponent = torch.frexp(scale)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(scale), exponent)


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 codes of FP32 `x` divided by a broadcastable FP32 `scale`, saturated to +-448."""
    return (x / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def check_finite(t: torch.Tensor, what: str) -> None:
    """Raise ValueError naming `what` and the shape when `t` holds NaN or Inf."""
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{what} of shape {tuple(t.shape)} contains NaN or Inf; FP8 scales would be invalid")


def check_float_input(t: torch.Tensor, what: str) -> None:
    """Raise TypeError unless `t` is a floating tensor that is not already FP8."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"{what} must be a bf16/fp16/fp32 tensor, got dtype {t.dtype}")
