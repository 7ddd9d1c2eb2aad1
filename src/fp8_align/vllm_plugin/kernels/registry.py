"""Backend selection: which block-FP8 GEMM a layer runs on.

The registry imports the backends; no backend imports the registry. On CPU the only backend is
`emulated` (`fp8_align.quant.fp8_block_gemm`, shard by shard); on CUDA `kernels.gpu` chooses, except
for `on_policy="bitwise"`, which always runs `kernels.fixed_tile` (one tile configuration for every M).
"""

from __future__ import annotations

import torch

from fp8_align.config import FP8Config
from fp8_align.vllm_plugin.kernels.base import BlockFp8Kernel
from fp8_align.vllm_plugin.kernels.emulated import EmulatedBlockFp8Kernel


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
    # imported here: the CUDA backends load vLLM's CUDA kernels and Triton, absent on CPU-only installs
    if cfg.on_policy == "bitwise":
        from fp8_align.vllm_plugin.kernels.fixed_tile import FixedTileBlockFp8Kernel

        return FixedTileBlockFp8Kernel()
    from fp8_align.vllm_plugin.kernels.gpu import select_gpu_kernel

    return select_gpu_kernel(cfg, weight_shape, shard_sizes, device, out_dtype)
