"""The bitwise operators as torch custom ops: `torch.ops.fp8_align.bitwise_*`.

The engine (its patched RMSNorm, SiLU-and-mul and RoPE layers, `vllm_plugin.patches`) and the
trainer (`fp8_align.hf_training.BitwiseForward`) call these same ops. As custom ops they are opaque
to torch.compile: vLLM's Inductor graph calls them as they are and cannot fuse or re-round their
arithmetic. On CUDA they run `fp8_align.bitwise.triton_kernels`, elsewhere the pure-torch
references (`fp8_align.bitwise.reference`).
"""

from __future__ import annotations

import torch

from fp8_align.bitwise.reference import apply_rope, fused_add_rms_norm_reference, rms_norm_reference, silu_and_mul_reference
from fp8_align.quant import fp8_block_gemm

try:
    from fp8_align.bitwise import triton_kernels
except ImportError:  # CPU builds of torch come without Triton; the CPU path needs none
    triton_kernels = None


def _on_triton(x: torch.Tensor) -> bool:
    """True for CUDA tensors (the Triton kernels run); raises there when Triton is missing."""
    if x.device.type != "cuda":
        return False
    if triton_kernels is None:
        raise RuntimeError("fp8_align's bitwise operators need Triton on CUDA; install the triton that matches torch")
    return True


@torch.library.custom_op("fp8_align::bitwise_rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., H] -> [..., H] RMSNorm in FP32, rounded once to x's dtype."""
    if _on_triton(x):
        return triton_kernels.rms_norm_triton(x, weight, eps)[0]
    return rms_norm_reference(x, weight, eps)


@rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("fp8_align::bitwise_fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(r), r) with r = x + residual rounded to x's dtype; shapes [..., H]."""
    if _on_triton(x):
        normed, summed = triton_kernels.rms_norm_triton(x, weight, eps, residual)
        assert summed is not None
        return normed, summed
    return fused_add_rms_norm_reference(x, residual, weight, eps)


@fused_add_rms_norm.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("fp8_align::bitwise_silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> [..., d]: silu(x[..., :d]) * x[..., d:] in FP32, rounded once."""
    if _on_triton(x):
        return triton_kernels.silu_and_mul_triton(x)
    return silu_and_mul_reference(x)


@silu_and_mul.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


@torch.library.custom_op("fp8_align::bitwise_rope", mutates_args=())
def rope(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, table: torch.Tensor, head_size: int, rotary_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX RoPE of query [T, Hq * head_size] and key [T, Hk * head_size] (`reference.apply_rope`'s
    contract and arithmetic; on CUDA its Triton kernel, elsewhere the reference)."""
    if _on_triton(query):
        return triton_kernels.rope_triton(positions, query, table, head_size, rotary_dim), triton_kernels.rope_triton(positions, key, table, head_size, rotary_dim)
    return apply_rope(positions, query, table, head_size, rotary_dim), apply_rope(positions, key, table, head_size, rotary_dim)


@rope.register_fake
def _(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, table: torch.Tensor, head_size: int, rotary_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    return query.new_empty((query.shape[0], query.shape[-1])), key.new_empty((key.shape[0], key.shape[-1]))


@torch.library.custom_op("fp8_align::bitwise_block_fp8_mm", mutates_args=())
def block_fp8_mm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """[M, K] e4m3 codes with [M, ceil(K/128)] float32 scales times one weight shard [N, K] e4m3
    with its [ceil(N/128), ceil(K/128)] scale grid, + bias [N], -> [M, N] `out_dtype`: the sum of
    `fp8_align.quant.fp8_block_gemm` in FP32, bias added in FP32, rounded once. On CUDA the
    one-tile-configuration Triton GEMM, so a row's bits do not depend on M."""
    if _on_triton(x_fp8):
        out = torch.empty((x_fp8.shape[0], w_fp8.shape[0]), dtype=out_dtype, device=x_fp8.device)
        return triton_kernels.block_fp8_gemm_fixed_tile(x_fp8, x_scale, w_fp8.contiguous(), w_scale, out, bias)
    acc = fp8_block_gemm(x_fp8, x_scale, w_fp8, w_scale, torch.float32)
    return (acc if bias is None else acc + bias.float()).to(out_dtype)


@block_fp8_mm.register_fake
def _(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return torch.empty((x_fp8.shape[0], w_fp8.shape[0]), dtype=out_dtype, device=x_fp8.device)
