"""The bitwise operators as torch custom ops: `torch.ops.fp8_align.bitwise_*`.

The engine (its patched RMSNorm, SiLU-and-mul and RoPE layers, `vllm_plugin.patches`) and the
trainer (`fp8_align.hf_training.BitwiseForward`) call these same ops. As custom ops they are opaque
to torch.compile: vLLM's Inductor graph calls them as they are and cannot fuse or re-round their
arithmetic. On CUDA they run `fp8_align.bitwise.triton_kernels` (`moe_kernels` for the
Mixture-of-Experts ops), elsewhere the pure-torch references (`fp8_align.bitwise.reference`,
`moe_reference`).
"""

from __future__ import annotations

import torch

from fp8_align.bitwise.moe_reference import (
    check_expert_offsets, check_grouped_mm_inputs, experts_of_rows, grouped_block_fp8_mm_reference, moe_combine_reference, moe_route_reference,
)  # fmt: skip
from fp8_align.bitwise.reference import apply_rope, fused_add_rms_norm_reference, rms_norm_reference, silu_and_mul_reference
from fp8_align.quant import fp8_block_gemm

try:
    from fp8_align.bitwise import moe_kernels, triton_kernels
except ImportError:  # CPU builds of torch come without Triton; the CPU path needs none
    moe_kernels = triton_kernels = None


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


@torch.library.custom_op("fp8_align::bitwise_moe_route", mutates_args=())
def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] bf16/fp16/fp32 (E <= 512) -> (weights [T, top_k] float32, expert ids
    [T, top_k] int32, largest first, ties to the lowest index): `moe_reference.moe_route_reference`."""
    if _on_triton(router_logits):
        return moe_kernels.moe_route_triton(router_logits, top_k, renormalize)
    return moe_route_reference(router_logits, top_k, renormalize)


@moe_route.register_fake
def _(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = router_logits.shape[0]
    return router_logits.new_empty((tokens, top_k), dtype=torch.float32), router_logits.new_empty((tokens, top_k), dtype=torch.int32)


@torch.library.custom_op("fp8_align::bitwise_grouped_block_fp8_mm", mutates_args=())
def grouped_block_fp8_mm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    expert_offsets: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Rows sorted by expert, x_fp8 [M, K] e4m3 with [M, ceil(K/128)] float32 scales, rows
    expert_offsets[e] .. expert_offsets[e + 1] - 1 (offsets [E + 1] int32/int64) times expert e's
    weight w_fp8 [E, N, K] e4m3 with its [E, ceil(N/128), ceil(K/128)] float32 grids -> [M, N]
    `out_dtype`: each row's `fp8_align.quant.fp8_block_gemm` with its expert's weight, rounded once.
    On CUDA one grouped Triton GEMM whose launch does not depend on the routing."""
    if _on_triton(x_fp8):
        return moe_kernels.grouped_block_fp8_gemm_triton(x_fp8, x_scale, w_fp8, w_scale, expert_offsets, out_dtype)
    check_grouped_mm_inputs(x_fp8, x_scale, w_fp8, w_scale, out_dtype)
    check_expert_offsets(expert_offsets, w_fp8.shape[0])
    return grouped_block_fp8_mm_reference(x_fp8, x_scale, w_fp8, w_scale, experts_of_rows(expert_offsets, x_fp8.shape[0]), out_dtype)


@grouped_block_fp8_mm.register_fake
def _(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    w_fp8: torch.Tensor,
    w_scale: torch.Tensor,
    expert_offsets: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return torch.empty((x_fp8.shape[0], w_fp8.shape[1]), dtype=out_dtype, device=x_fp8.device)


@torch.library.custom_op("fp8_align::bitwise_moe_combine", mutates_args=())
def moe_combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """y [T, K, H] bf16/fp16/fp32 (a token's K expert outputs, in slot order), weights [T, K]
    float32 -> [T, H] in y's dtype: the FP32 weighted sum over the slots in order, no FMA,
    rounded once (`moe_reference.moe_combine_reference`)."""
    if _on_triton(y):
        return moe_kernels.moe_combine_triton(y, weights)
    return moe_combine_reference(y, weights)


@moe_combine.register_fake
def _(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return y.new_empty((y.shape[0], y.shape[2]))
