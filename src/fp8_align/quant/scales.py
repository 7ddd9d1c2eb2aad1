"""Scale rules shared by weight and activation quantization (pure math, no plumbing).

A stored scale here is always the *dequantization* multiplier (`scale_inv` in TransformerEngine
and DeepGEMM terms): `x ~= code * scale_inv`. Two rules compute it from a group's amax
(`fp8_align.rounding.SCALE_RULES`, `FP8Config.scale_rule`):

- "amax_over_max" (default): `scale_inv = amax / 448` (pow2: rounded UP to a power of two) and
  `code = fp8(clamp(x / scale_inv, +-448))`.
- "transformer_engine": TransformerEngine's `Float8BlockQuantizer`: a multiplier
  `m = 448 / amax` (pow2: rounded DOWN to a power of two), `code = fp8(clamp(x * m, +-448))` and
  `scale_inv = 1 / m`.

Every division is correctly rounded FP32; the E4M3 cast rounds to nearest even.
"""

from __future__ import annotations

import torch

from fp8_align.rounding import DEFAULT_SCALE_RULE, check_scale_rule

#: Largest finite float8_e4m3fn value.
E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
#: Smallest positive normal FP32 value: the floor of every "amax_over_max" scale.
FP32_TINY = torch.finfo(torch.float32).tiny

_POW2_MASK = -0x00800000  # 0xFF800000 as int32: keeps the sign and exponent bits


def quantization_factors(
    amax: torch.Tensor, pow2: bool, scale_rule: str = DEFAULT_SCALE_RULE, input_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """(factor, scale_inv) of each group under `scale_rule`, from FP32 absolute maxima (any shape).

    "amax_over_max": factor is `scale_from_amax(amax, pow2)` itself, a divisor (and the stored
    scale). "transformer_engine": factor is the multiplier `te_multiplier_from_amax(amax, pow2,
    value_for_inf=max of input_dtype)` and scale_inv its correctly rounded reciprocal.
    Both FP32, shaped like `amax`; apply the factor with `quantize_with_factor`.
    """
    if check_scale_rule(scale_rule) == "amax_over_max":
        scale = scale_from_amax(amax, pow2)
        return scale, scale
    multiplier = te_multiplier_from_amax(amax, pow2, value_for_inf=torch.finfo(input_dtype).max)
    return multiplier, reciprocal(multiplier)


def quantize_with_factor(x: torch.Tensor, factor: torch.Tensor, scale_rule: str = DEFAULT_SCALE_RULE) -> torch.Tensor:
    """E4M3 codes of FP32 `x` with a broadcastable FP32 `factor` from `quantization_factors`:
    `x / factor` ("amax_over_max") or `x * factor` ("transformer_engine"), saturated to +-448."""
    if check_scale_rule(scale_rule) == "amax_over_max":
        return quantize_with_scale(x, factor)
    return quantize_with_multiplier(x, factor)


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


def te_multiplier_from_amax(
    amax: torch.Tensor,
    pow2: bool,
    amax_epsilon: float = 0.0,
    value_for_inf: float = torch.finfo(torch.float32).max,
    fp8_max: float = E4M3_MAX,
) -> torch.Tensor:
    """TransformerEngine's quantization multipliers (`code = x * multiplier`) from block maxima.

    Args:
        amax: any shape, absolute maxima (used in FP32).
        pow2: clear the mantissa (`bits & 0xFF800000`), rounding each multiplier DOWN to a power of two.
        amax_epsilon: floor applied to amax first (TE's recipe uses 0.0).
        value_for_inf: multiplier used where `fp8_max / amax` overflows FP32 (TE: the largest
            finite value of the input dtype).
        fp8_max: largest finite code (448 for E4M3).
    Returns:
        FP32 tensor shaped like `amax`: `fl(fp8_max / amax)`, 1.0 where amax is 0, inf or NaN.
    """
    amax = amax.to(torch.float32).clamp_min(amax_epsilon)
    degenerate = (amax == 0) | torch.isinf(amax) | torch.isnan(amax)
    # Tensor / tensor: torch turns `python_scalar / tensor` into a multiply by the reciprocal
    # (and, on CUDA, `tensor / python_scalar` too), which is not TE's correctly rounded division.
    multiplier = torch.where(degenerate, torch.ones_like(amax), torch.full_like(amax, fp8_max) / amax)
    multiplier = torch.where(torch.isinf(multiplier), torch.full_like(multiplier, value_for_inf), multiplier)
    if pow2:
        multiplier = (multiplier.view(torch.int32) & _POW2_MASK).view(torch.float32)
    return multiplier


def reciprocal(multiplier: torch.Tensor) -> torch.Tensor:
    """TransformerEngine's stored `scale_inv = 1.0f / multiplier`, a correctly rounded FP32 division."""
    return torch.ones_like(multiplier) / multiplier


def quantize_with_multiplier(x: torch.Tensor, multiplier: torch.Tensor) -> torch.Tensor:
    """`fp8(x * multiplier)` for FP32 `x` and a broadcastable FP32 `multiplier`, with CUDA's
    saturate-to-finite E4M3 conversion (clamp to +-448, round to nearest even)."""
    return (x * multiplier).clamp_(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


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
