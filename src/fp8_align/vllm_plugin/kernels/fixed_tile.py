"""The block-FP8 GEMM backend of `FP8Config(on_policy="bitwise")` engines (CUDA).

Activations are quantized per token (`quantize_activation_triton`, one program per row) and every
shard of the layer runs `torch.ops.fp8_align.bitwise_block_fp8_mm`, whose Triton GEMM has one tile
configuration for every token count and no split-K: a token's output bits do not depend on the
batch it is computed in. `fp8_align.hf_training.BitwiseForward` selects this same backend for the
trainer's projections (through `kernels.registry.select_kernel`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

import fp8_align.bitwise.ops  # noqa: F401  (registers torch.ops.fp8_align.bitwise_*)
from fp8_align.quant.shards import shard_slices
from fp8_align.quant.triton_groupwise import ScaleLayout, quantize_activation_triton
from fp8_align.vllm_plugin.kernels.base import BlockFp8Kernel

logger = logging.getLogger("vllm.fp8_align")


@dataclass(frozen=True)
class FixedTileBlockFp8Kernel(BlockFp8Kernel):
    """Per-token activation quantization, then the fixed-tile Triton GEMM shard by shard, bias
    added in FP32 before the one rounding."""

    name: str = "fixed_tile"

    def prepare(self, layer: torch.nn.Module) -> None:
        logger.info("fp8_align: %s [%s] -> fixed_tile (on_policy='bitwise')", layer.fp8_align.prefix, tuple(layer.weight.shape))

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        act_pow2: bool,
        scale_rule: str = "amax_over_max",
    ) -> torch.Tensor:
        """[..., K] -> [..., N] in x's dtype."""
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        x_fp8, x_scale = quantize_activation_triton(x2, act_pow2, int(ScaleLayout.ROW_MAJOR), scale_rule)
        outputs = [
            torch.ops.fp8_align.bitwise_block_fp8_mm(
                x_fp8, x_scale, layer.weight[rows], layer.weight_scale_inv[scale_rows], None if bias is None else bias[rows], x.dtype
            )
            for rows, scale_rows in shard_slices(layer.fp8_align.shard_sizes)
        ]
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        return out.reshape(*x.shape[:-1], out.shape[-1])
