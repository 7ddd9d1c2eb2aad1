"""Pure-torch emulation of TransformerEngine's `Float8BlockQuantizer` (the `Float8BlockScaling` recipe).

What TE does, read from its source (TransformerEngine 2.20; NVIDIA/TransformerEngine files):

- `transformer_engine/common/recipe/__init__.py`, `Float8BlockScaling`: weights use 2-D 128x128
  blocks (`w_block_scaling_dim = 2`), inputs and gradients 1x128 blocks (`x/grad_block_scaling_dim
  = 1`); every tensor gets `QParams(power_2_scale=not use_f32_scales, amax_epsilon=0.0)` with
  `use_f32_scales = os.getenv("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") == "1"`, evaluated once,
  when the recipe module is imported.
- `transformer_engine/common/recipe/recipe_common.cuh`, `compute_scale_from_amax`: the scale is a
  *quantization multiplier*: `amax = max(amax, epsilon)`; amax that is 0, inf or NaN gives scale 1;
  otherwise `scale = 448 / amax` (FP32, round-to-nearest division); an infinite result becomes the
  largest finite value of the *input* dtype; with `power_2_scale` the mantissa bits are cleared
  (`bits & 0xFF800000`), which rounds the multiplier DOWN to a power of two.
- `transformer_engine/common/transpose/quantize_transpose_{square,vector}_blockwise.cu`: amax is
  taken in FP32 over the block (edge blocks padded with zeros), `scale_inv = 1 / scale` is stored,
  and each element is quantized as `fp8(float(x) * scale)`, a saturating round-to-nearest-even cast.

fp8_align's generation side by default computes `scale_inv = amax / 448` (rounded UP to a power of
two when pow2) and divides. With power-of-two scales the two agree bit for bit; with FP32 scales they
can differ by rounding (see the alignment report). With `FP8Config.scale_rule="transformer_engine"`
generation uses this module's rule (the math lives in `fp8_align.quant.scales`) and agrees bit for
bit with FP32 scales too.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from fp8_align.nemo_rl_config import TE_FP32_SCALES_ENV_VAR
from fp8_align.quant.scales import (
    E4M3_MAX,
    check_float_input,
    quantize_with_multiplier,
    reciprocal,
    te_multiplier_from_amax,
)

#: TE's block length for both 1x128 and 128x128 block scaling.
TE_BLOCK_LEN = 128


def te_pow2_scales_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether TE's `Float8BlockScaling` would use power-of-two scales under `environ` (default os.environ).

    Mirrors TE's rule: FP32 scales only when NVTE_FP8_BLOCK_SCALING_FP32_SCALES is exactly "1".
    """
    env = os.environ if environ is None else environ
    return env.get(TE_FP32_SCALES_ENV_VAR, "0") != "1"


def te_scale_from_amax(
    amax: torch.Tensor,
    pow2_scale: bool,
    amax_epsilon: float = 0.0,
    value_for_inf: float = torch.finfo(torch.float32).max,
    fp8_max: float = E4M3_MAX,
) -> torch.Tensor:
    """TE's quantization multipliers `scale` (x_fp8 = x * scale) from block maxima: FP32, shaped
    like `amax`. The math is `fp8_align.quant.scales.te_multiplier_from_amax` (arguments as there),
    the rule generation uses with `FP8Config.scale_rule="transformer_engine"`."""
    return te_multiplier_from_amax(amax, pow2_scale, amax_epsilon, value_for_inf, fp8_max)


def te_quantize_weight_2d(
    w: torch.Tensor, pow2_scale: bool, amax_epsilon: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a weight as TE's 2-D (128x128) block quantizer does (rowwise output).

    Args:
        w: [N, K] bf16/fp16/fp32 weight, any device.
        pow2_scale, amax_epsilon: the recipe's `fp8_quant_fwd_weight` QParams.
    Returns:
        (codes [N, K] float8_e4m3fn, scale_inv [ceil(N/128), ceil(K/128)] float32) with
        `w ~= codes * scale_inv` per block. TE stores scale_inv with its last dim padded to a
        multiple of 4 for the GEMM; this returns the unpadded logical shape.
    """
    check_float_input(w, "weight")
    if w.dim() != 2:
        raise TypeError(f"weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    n, k = w.shape
    nb, kb = math.ceil(n / TE_BLOCK_LEN), math.ceil(k / TE_BLOCK_LEN)
    padded = F.pad(w.to(torch.float32), (0, kb * TE_BLOCK_LEN - k, 0, nb * TE_BLOCK_LEN - n))
    blocks = padded.view(nb, TE_BLOCK_LEN, kb, TE_BLOCK_LEN)
    scale = te_scale_from_amax(blocks.abs().amax(dim=(1, 3)), pow2_scale, amax_epsilon, torch.finfo(w.dtype).max)
    codes = quantize_with_multiplier(blocks, scale[:, None, :, None])
    return codes.view(nb * TE_BLOCK_LEN, kb * TE_BLOCK_LEN)[:n, :k].contiguous(), reciprocal(scale)


def te_quantize_activation_1d(
    x: torch.Tensor, pow2_scale: bool, amax_epsilon: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize activations as TE's 1-D (1x128) block quantizer does (rowwise output).

    Args:
        x: [..., K] bf16/fp16/fp32, any leading shape, any device.
        pow2_scale, amax_epsilon: the recipe's `fp8_quant_fwd_inp` QParams.
    Returns:
        (codes [..., K] float8_e4m3fn, scale_inv [..., ceil(K/128)] float32) with
        `x ~= codes * scale_inv` per 1x128 group. TE stores these scales transposed and padded
        (GEMM-ready layout); this returns them in the logical layout of `fp8_align.quant`.
    """
    check_float_input(x, "activation")
    k = x.shape[-1]
    groups = math.ceil(k / TE_BLOCK_LEN)
    padded = F.pad(x.to(torch.float32), (0, groups * TE_BLOCK_LEN - k))
    grouped = padded.view(*x.shape[:-1], groups, TE_BLOCK_LEN)
    scale = te_scale_from_amax(grouped.abs().amax(dim=-1), pow2_scale, amax_epsilon, torch.finfo(x.dtype).max)
    codes = quantize_with_multiplier(grouped, scale.unsqueeze(-1))
    return codes.view(*x.shape[:-1], groups * TE_BLOCK_LEN)[..., :k].contiguous(), reciprocal(scale)

