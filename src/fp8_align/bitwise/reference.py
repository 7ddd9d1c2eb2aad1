"""Pure-torch definitions of the invariant operators and RoPE's FP32 cos/sin table.

Each function is the reference its Triton kernel (`fp8_align.bitwise.triton_kernels`) is tested
against, and the implementation `fp8_align.bitwise.ops` runs on CPU. All arithmetic is FP32 with
one rounding to the input dtype at the end, except the residual sum, which is rounded to the
input dtype before it is normalized (it is also the new residual stream).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fp8_align.quant.scales import quantize_with_scale

#: RoPE variants `rope_table` computes (HF `rope_type` names).
SUPPORTED_ROPE_TYPES = ("default", "llama3")


class UnsupportedRopeError(ValueError):
    """A rotary embedding the bitwise path has no table for."""


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., H] -> [..., H] in x's dtype: `x * rsqrt(mean(x^2) + eps) * weight` in FP32 (torch's
    `rms_norm`, whose backward is one fused kernel on CUDA)."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual): `new_residual = round(x + residual)` in x's dtype (one FP32 add),
    `normed = rms_norm_reference(new_residual, weight, eps)`."""
    summed = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_reference(summed, weight, eps), summed


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> [..., d] in x's dtype: `silu(g) * u = g / (1 + exp(-g)) * u` in FP32, g = x[..., :d],
    u = x[..., d:] (torch's `silu`, whose backward is one fused kernel)."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def fp8_kv_cache_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """K or V [..., D] as attention over an E4M3 KV cache written with the per-tensor FP32 `scale`
    (vLLM's per-layer `k_scale`/`v_scale`, [1] or scalar) reads it: codes `E4M3(x / scale)`
    saturated to +-448, times `scale`, in FP32 (`fp8_cache_attention` applies the scale to the
    scores and outputs instead, the same product up to FP32 rounding)."""
    return quantize_with_scale(x.float(), scale).float() * scale


def apply_rope(
    positions: torch.Tensor, x: torch.Tensor, table: torch.Tensor, head_size: int, rotary_dim: int
) -> torch.Tensor:
    """NeoX-style rotary embedding of x [T, heads * head_size] (any row stride) at `positions` [T]
    with the FP32 `table` [max_pos, rotary_dim] (cos | sin halves). Returns a new contiguous
    [T, heads * head_size] tensor in x's dtype: per pair (x1, x2) of the first `rotary_dim`
    channels, `x1 cos - x2 sin` and `x2 cos + x1 sin` in FP32, rounded once; the other channels copied.

    Elementwise torch operations only, so a token's result does not depend on the other tokens;
    this one function is what both the engine and the trainer run, on every device.
    """
    tokens = positions.shape[0]
    heads = x.shape[-1] // head_size
    cos, sin = table.index_select(0, positions.reshape(-1)).chunk(2, dim=-1)  # [T, rotary_dim / 2] each
    cos, sin = cos[:, None, :], sin[:, None, :]
    xh = x.reshape(tokens, heads, head_size)
    x1 = xh[..., : rotary_dim // 2].float()
    x2 = xh[..., rotary_dim // 2 : rotary_dim].float()
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    if rotary_dim < head_size:
        rotated = torch.cat((rotated, xh[..., rotary_dim:]), dim=-1)
    return rotated.reshape(tokens, heads * head_size)


@dataclass(frozen=True)
class RopeSpec:
    """What fixes a model's RoPE table: head size, rotated channels, base, positions, scaling."""

    head_size: int
    rotary_dim: int
    theta: float
    max_positions: int
    rope_type: str = "default"
    scaling: tuple[tuple[str, float], ...] = ()

    @classmethod
    def from_hf_config(cls, config: Any) -> RopeSpec:
        """Read an HF Llama/Qwen2/Qwen3 config (transformers 4.x `rope_theta`/`rope_scaling` or
        5.x `rope_parameters`). Raises UnsupportedRopeError for rope types other than
        `SUPPORTED_ROPE_TYPES`."""
        params: Mapping[str, Any] = getattr(config, "rope_parameters", None) or {}
        scaling: Mapping[str, Any] = getattr(config, "rope_scaling", None) or params
        theta = params.get("rope_theta", getattr(config, "rope_theta", None))
        if theta is None:
            raise UnsupportedRopeError("the model config has no rope_theta")
        rope_type = str(scaling.get("rope_type", scaling.get("type", "default")))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedRopeError(
                f"rope_type={rope_type!r} has no bitwise RoPE table in fp8_align (supported: {SUPPORTED_ROPE_TYPES})"
            )
        head_size = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        rotary_dim = int(head_size * float(getattr(config, "partial_rotary_factor", 1.0)))
        numbers = tuple(sorted((k, float(v)) for k, v in scaling.items() if isinstance(v, (int, float)) and k != "rope_theta"))
        return cls(head_size, rotary_dim, float(theta), int(config.max_position_embeddings), rope_type, numbers)


def inverse_frequencies(spec: RopeSpec) -> torch.Tensor:
    """[rotary_dim / 2] float64 inverse frequencies, with the llama3 band-wise rescaling if asked."""
    exponents = torch.arange(0, spec.rotary_dim, 2, dtype=torch.float64) / spec.rotary_dim
    inv_freq = 1.0 / spec.theta**exponents
    if spec.rope_type == "default":
        return inv_freq
    scaling = dict(spec.scaling)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    smooth = ((old_context / wavelength - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelength > old_context / low, inv_freq / factor, torch.where(wavelength < old_context / high, inv_freq, blended))


def rope_table(spec: RopeSpec, device: torch.device | str = "cpu") -> torch.Tensor:
    """FP32 [max_positions, rotary_dim] table, cos of every (position, frequency) then sin,
    computed in float64 on the CPU and rounded once, so every process gets the same bits."""
    angles = torch.arange(spec.max_positions, dtype=torch.float64)[:, None] * inverse_frequencies(spec)[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(torch.float32).to(device)
