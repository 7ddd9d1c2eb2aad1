"""Block-FP8 GEMM backends and their selection. Each backend has the torch reference as oracle.

On CPU the only backend is `emulated`: `fp8_align.quant.fp8_block_gemm`, shard by shard.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from fp8_align.config import FP8Config
from fp8_align.vllm_plugin.cpu_op import emulated_block_fp8_mm

logger = logging.getLogger("vllm.fp8_align")


@dataclass(frozen=True)
class BlockFp8Kernel:
    """A GEMM backend for one layer: `prepare` once after quantization, `apply` per forward."""

    name: str

    def prepare(self, layer: torch.nn.Module) -> None:
        """Layout work after the weight is quantized (none for the emulated backend)."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, act_pow2: bool) -> torch.Tensor:
        raise NotImplementedError


@dataclass(frozen=True)
class EmulatedBlockFp8Kernel(BlockFp8Kernel):
    """Pure-torch block FP8 (CPU): activation quantized once, one block GEMM per weight shard."""

    name: str = "emulated"

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None, act_pow2: bool) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        out = emulated_block_fp8_mm(x2, layer.weight, layer.weight_scale_inv, layer.fp8_align_shard_sizes, act_pow2)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


def select_kernel(
    cfg: FP8Config,
    weight_shape: torch.Size,
    shard_sizes: list[int],
    device: torch.device,
    out_dtype: torch.dtype = torch.bfloat16,
) -> BlockFp8Kernel:
    """Pick the backend for a layer on `device` whose activations/outputs are `out_dtype`.

    On CUDA the choice and why other backends were passed is logged by `kernel.prepare(layer)`.
    """
    if device.type == "cpu":
        return EmulatedBlockFp8Kernel()
    from fp8_align.vllm_plugin.gpu_kernels import select_gpu_kernel

    return select_gpu_kernel(cfg, weight_shape, shard_sizes, device, out_dtype)
