"""Block-FP8 GEMM backends on CUDA (vLLM 0.22, Hopper) and their per-layer selection.

Every backend computes `fp8_align.quant.blockwise_fp8_linear`: activations quantized to E4M3 in
1x128 groups by `fp8_align.quant.triton_groupwise.quantize_activation_triton` (bit-identical to
`fp8_align.quant.quantize_activation_groupwise` on CUDA, tested), then a block-scaled GEMM of
those codes with the layer's E4M3 weight codes and the FP32 (or power-of-two) scales exactly as
`fp8_align.quant.quantize_weight_blockwise` computed them. No backend re-rounds a scale:
DeepGEMM is called with `is_deep_gemm_e8m0_used=False`, so vLLM's VLLM_USE_DEEP_GEMM_E8M0
default (UE8M0 rounding on Hopper) never reaches these layers. The torch reference of each
backend is `fp8_align.quant.fp8_block_gemm`; tests/test_gpu_kernels.py checks them against it.

Backends, in the order `select_gpu_kernel` tries them:

    deepgemm          vLLM-bundled DeepGEMM `fp8_gemm_nt` (SM90, bf16 out, uniform 128 grid)
    cutlass           vLLM `cutlass_scaled_mm` with 1x128 / 128x128 block scales (uniform grid)
    cublas            `torch._scaled_mm` blockwise (cuBLASLt, SM90; uniform 128 grid; only
                      where a start-up probe against the reference passes; `kernels.cublas`)
    triton            vLLM `w8a8_triton_block_scaled_mm` on the merged weight (any K, partial
                      last shard)
    triton_per_shard  the same Triton GEMM once per shard of a merged weight (any shapes)
    emulated          the torch reference itself (always possible; slow)

"Uniform 128 grid": N of every shard and K are multiples of 128, so the stacked per-shard
scale grids (`layer.weight_scale_inv`, [sum ceil(n_s/128), ceil(K/128)]) equal the single
[N/128, K/128] grid a one-shot kernel expects.

DeepGEMM kernels are JIT-compiled per shape and M tiling; `DeepGemmBlockFp8Kernel.warm_up`
compiles them while the engine loads, as vLLM does for its own FP8 layers, or loads them from a
JIT cache `fp8-align prepare-deepgemm` filled ahead (`deepgemm.inventory` says which); a cold
cache is filled at engine start by that command in parallel processes (`deepgemm.warmup`), with a
warning naming it. It never changes the backend.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import torch

# Importing these vLLM modules registers the custom ops the backends call:
# torch.ops.vllm.fp8_gemm_nt_op, .w8a8_triton_block_scaled_mm_func (and .padded_cutlass up to 0.22).
import vllm.model_executor.kernels.linear.scaled_mm.cutlass  # noqa: F401
import vllm.model_executor.kernels.linear.scaled_mm.deep_gemm  # noqa: F401
import vllm.model_executor.kernels.linear.scaled_mm.triton  # noqa: F401
from vllm._custom_ops import cutlass_scaled_mm_supports_block_fp8
from vllm.triton_utils import HAS_TRITON
from vllm.utils.deep_gemm import is_deep_gemm_supported

from fp8_align.config import FP8Config
from fp8_align.quant.shards import shard_slices
from fp8_align.quant.triton_groupwise import ScaleLayout, empty_scales  # registers fp8_align::quantize_activation_groupwise
from fp8_align.vllm_plugin.compat import cutlass_block_fp8_mm
from fp8_align.vllm_plugin.kernels.base import BLOCK, BlockFp8Kernel, LayerShape
from fp8_align.vllm_plugin.kernels.cublas import cublas_probe_error  # registers fp8_align::cublas_block_scaled_mm
from fp8_align.vllm_plugin.kernels.deepgemm.warmup import warm_up as warm_up_deepgemm
from fp8_align.vllm_plugin.kernels.emulated import emulated_block_fp8_linear

logger = logging.getLogger("vllm.fp8_align")


# --------------------------------------------------------------------------- eligibility
@dataclass(frozen=True)
class Target:
    """Where a layer runs: the CUDA device, its capability, the output dtype, the config."""

    device: torch.device
    capability: tuple[int, int]
    out_dtype: torch.dtype
    cfg: FP8Config


def _full_blocks_reason(shape: LayerShape) -> str | None:
    if shape.full_blocks:
        return None
    return f"needs every shard and K to be multiples of 128 ({shape.describe()})"


# --------------------------------------------------------------------------- backends
def _as_2d(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


@dataclass(frozen=True)
class GpuBlockFp8Kernel(BlockFp8Kernel):
    """A CUDA backend: activation quantization in `scale_layout`, then `gemm`.

    `passed` records why the backends tried before this one were not chosen.
    """

    passed: tuple[str, ...] = ()
    scale_layout: ClassVar[ScaleLayout] = ScaleLayout.ROW_MAJOR

    def unsupported_reason(self, shape: LayerShape, target: Target) -> str | None:
        """None when this backend runs `shape` exactly on `target`, else the reason it cannot."""
        raise NotImplementedError

    def gemm(self, layer: torch.nn.Module, x_fp8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """[M, N] `out_dtype` block-scaled product of [M, K] e4m3 codes (scales [M, ceil(K/128)]
        float32 in `scale_layout`) with the layer's weight codes and `weight_scale_inv`."""
        raise NotImplementedError

    def prepare(self, layer: torch.nn.Module) -> None:
        """Log the choice for this layer (its name, shape, and why earlier backends were passed)."""
        logger.info(
            "fp8_align: %s [%s] -> %s (passed: %s)",
            layer.fp8_align.prefix,
            LayerShape(*layer.weight.shape, tuple(layer.fp8_align.shard_sizes)).describe(),
            self.name,
            "; ".join(self.passed) or "none",
        )

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """[..., K] -> [..., N] in x's dtype: 1x128 FP8 activations, block-FP8 GEMM, + bias."""
        x2 = _as_2d(x)
        rounding = layer.fp8_align.rounding
        x_fp8, x_scale = torch.ops.fp8_align.quantize_activation_groupwise(
            x2, rounding.activation_pow2, int(self.scale_layout), rounding.scale_rule
        )
        out = self.gemm(layer, x_fp8, x_scale, x.dtype)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


@dataclass(frozen=True)
class DeepGemmBlockFp8Kernel(GpuBlockFp8Kernel):
    """DeepGEMM `fp8_gemm_nt` (vLLM-bundled) with FP32 scales as given: no UE8M0 cast."""

    name: str = "deepgemm"
    scale_layout: ClassVar[ScaleLayout] = ScaleLayout.COLUMN_MAJOR_TMA

    def unsupported_reason(self, shape: LayerShape, target: Target) -> str | None:
        if not target.cfg.use_deep_gemm:
            return "use_deep_gemm=False"
        if target.capability != (9, 0):
            return f"FP32 block scales are kept exactly only by DeepGEMM's SM90 kernels (device is sm{target.capability[0]}{target.capability[1]})"
        if not is_deep_gemm_supported():
            return "DeepGEMM is not available (vllm.utils.deep_gemm.is_deep_gemm_supported() is False)"
        if target.out_dtype != torch.bfloat16:
            return f"DeepGEMM writes bf16 only (layer dtype {target.out_dtype})"
        return _full_blocks_reason(shape)

    def prepare(self, layer: torch.nn.Module) -> None:
        """Refuse a non-bf16 layer (selection assumed bf16 output), then log the choice."""
        if layer.params_dtype != torch.bfloat16:
            raise ValueError(
                f"fp8_align: {layer.fp8_align.prefix} has dtype {layer.params_dtype} but DeepGEMM was selected for "
                "bf16 output; pass the layer dtype as select_kernel(..., out_dtype=)"
            )
        super().prepare(layer)
        self.warm_up(layer)

    def warm_up(self, layer: torch.nn.Module) -> None:
        """Compile or load DeepGEMM's kernels for every M the engine can run this layer with
        (`deepgemm.warmup.warm_up`)."""
        warm_up_deepgemm(layer, self.run_for_m_values)

    def run_for_m_values(self, layer: torch.nn.Module, m_values: list[int]) -> None:
        """Run the layer's GEMM once for each M (zero activations), compiling what DeepGEMM's JIT
        cache lacks. `layer` needs only `weight` ([N, K] e4m3) and `weight_scale_inv`."""
        n, k = layer.weight.shape
        device = layer.weight.device
        x_fp8 = torch.zeros((max(m_values), k), dtype=torch.float8_e4m3fn, device=device)
        for m in m_values:
            x_scale = empty_scales(m, k // BLOCK, self.scale_layout, device).fill_(1.0)
            self.gemm(layer, x_fp8[:m], x_scale, torch.bfloat16)
        torch.cuda.synchronize(device)

    def gemm(self, layer: torch.nn.Module, x_fp8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty((x_fp8.shape[0], layer.weight.shape[0]), dtype=out_dtype, device=x_fp8.device)
        torch.ops.vllm.fp8_gemm_nt_op(x_fp8, x_scale, layer.weight, layer.weight_scale_inv, out, False)
        return out


@dataclass(frozen=True)
class CutlassBlockFp8Kernel(GpuBlockFp8Kernel):
    """vLLM's CUTLASS block-scaled FP8 GEMM (`compat.cutlass_block_fp8_mm`)."""

    name: str = "cutlass"
    scale_layout: ClassVar[ScaleLayout] = ScaleLayout.COLUMN_MAJOR

    def unsupported_reason(self, shape: LayerShape, target: Target) -> str | None:
        capability = target.capability[0] * 10 + target.capability[1]
        if not cutlass_scaled_mm_supports_block_fp8(capability):
            return f"vLLM's CUTLASS build has no block-FP8 kernel for sm{capability}"
        if target.out_dtype not in (torch.bfloat16, torch.float16):
            return f"CUTLASS writes bf16/fp16 only (layer dtype {target.out_dtype})"
        return _full_blocks_reason(shape)

    def gemm(self, layer: torch.nn.Module, x_fp8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return cutlass_block_fp8_mm(x_fp8, layer.weight, x_scale, layer.weight_scale_inv, out_dtype)


@dataclass(frozen=True)
class CublasBlockFp8Kernel(GpuBlockFp8Kernel):
    """`torch._scaled_mm` with DeepSeek-style block scales (cuBLASLt, SM90 only): the custom op
    `fp8_align::cublas_block_scaled_mm` of `kernels.cublas`."""

    name: str = "cublas"
    scale_layout: ClassVar[ScaleLayout] = ScaleLayout.COLUMN_MAJOR

    def unsupported_reason(self, shape: LayerShape, target: Target) -> str | None:
        if target.capability != (9, 0):
            return f"torch's 1x128/128x128 block scaling is SM90-only (device is sm{target.capability[0]}{target.capability[1]})"
        if target.out_dtype not in (torch.bfloat16, torch.float16):
            return f"bf16/fp16 output only (layer dtype {target.out_dtype})"
        reason = _full_blocks_reason(shape)
        if reason is not None:
            return reason
        return cublas_probe_error(target.device.index if target.device.index is not None else torch.cuda.current_device())

    def gemm(self, layer: torch.nn.Module, x_fp8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return torch.ops.fp8_align.cublas_block_scaled_mm(x_fp8, x_scale, layer.weight, layer.weight_scale_inv, out_dtype)


def _triton_gemm_reason() -> str | None:
    return None if HAS_TRITON else "vLLM reports no usable Triton"


@dataclass(frozen=True)
class TritonBlockFp8Kernel(GpuBlockFp8Kernel):
    """vLLM's Triton block-FP8 GEMM on the merged weight (masks partial N and K blocks)."""

    name: str = "triton"

    def unsupported_reason(self, shape: LayerShape, target: Target) -> str | None:
        if not shape.uniform_grid:
            return f"a shard before the last is not a multiple of 128 ({shape.describe()}): the stacked scale grids are not one grid"
        return _triton_gemm_reason()

    def gemm(self, layer: torch.nn.Module, x_fp8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        return torch.ops.vllm.w8a8_triton_block_scaled_mm_func(
            x_fp8, layer.weight, x_scale, layer.weight_scale_inv, [BLOCK, BLOCK], out_dtype
        )


@dataclass(frozen=True)
class ShardedTritonBlockFp8Kernel(GpuBlockFp8Kernel):
    """vLLM's Triton block-FP8 GEMM once per shard (q|k|v, gate|up), outputs concatenated."""

    name: str = "triton_per_shard"

    def unsupported_reason(self, shape: LayerShape, target: Target) -> str | None:
        return _triton_gemm_reason()

    def gemm(self, layer: torch.nn.Module, x_fp8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        outputs = [
            torch.ops.vllm.w8a8_triton_block_scaled_mm_func(
                x_fp8, layer.weight[rows], x_scale, layer.weight_scale_inv[scale_rows], [BLOCK, BLOCK], out_dtype
            )
            for rows, scale_rows in shard_slices(layer.fp8_align.shard_sizes)
        ]
        return torch.cat(outputs, dim=-1)


@dataclass(frozen=True)
class ReferenceBlockFp8Kernel(GpuBlockFp8Kernel):
    """The torch reference (the emulated op of `EmulatedBlockFp8Kernel`, widening the codes per
    call, which is cheap on a GPU) on the GPU: last resort, always possible."""

    name: str = "emulated"

    def unsupported_reason(self, shape: LayerShape, target: Target) -> str | None:
        return None

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return emulated_block_fp8_linear(x, layer.weight, layer, bias)


#: The order `select_gpu_kernel` tries backends in (fastest first on H100, see benchmarks/gemm_kernels.py).
GPU_KERNEL_ORDER: tuple[type[GpuBlockFp8Kernel], ...] = (
    DeepGemmBlockFp8Kernel,
    CutlassBlockFp8Kernel,
    CublasBlockFp8Kernel,
    TritonBlockFp8Kernel,
    ShardedTritonBlockFp8Kernel,
    ReferenceBlockFp8Kernel,
)


def select_gpu_kernel(
    cfg: FP8Config,
    weight_shape: torch.Size,
    shard_sizes: list[int],
    device: torch.device,
    out_dtype: torch.dtype = torch.bfloat16,
) -> GpuBlockFp8Kernel:
    """The first backend in `GPU_KERNEL_ORDER` that runs this layer exactly.

    Args:
        weight_shape: [N, K] of the FP8 codes; shard_sizes: the N of each stacked shard.
        device: the CUDA device of the weight; out_dtype: the layer's activation dtype.
    Returns the backend, carrying in `passed` the reason each earlier backend was not used
    (logged at INFO by `prepare`).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    target = Target(device, torch.cuda.get_device_capability(index), out_dtype, cfg)
    shape = LayerShape(int(weight_shape[0]), int(weight_shape[1]), tuple(int(s) for s in shard_sizes))
    passed: list[str] = []
    for kernel_type in GPU_KERNEL_ORDER:
        reason = kernel_type().unsupported_reason(shape, target)
        if reason is None:
            return kernel_type(passed=tuple(passed))
        passed.append(f"{kernel_type.name}: {reason}")
    raise AssertionError("ReferenceBlockFp8Kernel accepts every layer")

