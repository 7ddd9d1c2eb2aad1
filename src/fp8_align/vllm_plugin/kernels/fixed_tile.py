"""The block-FP8 GEMM backend of `FP8Config(on_policy="bitwise")` engines (CUDA).

Activations are quantized per token (the plugin's quantizer, one program per row). The layer's
product then runs as `fixed_tile_calls` plans it: one call over the stacked weight when every shard
is a whole number of 128-row blocks (q|k|v and gate|up of most models), else one call per shard.
Each call runs a GEMM whose kernel configuration is the same for every token count, with whole K
per output tile (no split-K, no Stream-K), chosen from the call's [N, K] alone:

- vLLM's CUTLASS block-FP8 kernel where its dispatch is one persistent 128x128x128-tile kernel for
  every M (`compat.cutlass_block_fp8_one_tile`: SM90, N and K multiples of 128, K <= 3N) and the
  layer has no bias;
- otherwise (and for every layer with a bias, which is added in FP32 before the one rounding) `torch.ops.fp8_align.bitwise_block_fp8_mm`, fp8_align's Triton GEMM with one tile
  configuration (`bitwise.triton_kernels.GEMM_TILE`).

So a token's output bits do not depend on the batch it is computed in, and a trainer that makes
the same calls (`fp8_align.hf_training.BitwiseForward` stacks its projections as the engine does)
gets the same bits.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

# registers torch.ops.vllm.padded_cutlass (vLLM <= 0.22), which `compat.cutlass_block_fp8_mm` calls
import vllm.model_executor.kernels.linear.scaled_mm.cutlass  # noqa: F401
from vllm._custom_ops import cutlass_scaled_mm_supports_block_fp8

import fp8_align.bitwise.ops  # noqa: F401  (registers torch.ops.fp8_align.bitwise_*)
import fp8_align.quant.triton_groupwise  # noqa: F401  (registers torch.ops.fp8_align.quantize_activation_groupwise)
from fp8_align.quant.blockwise import DEFAULT_BLOCK_SIZE
from fp8_align.quant.shards import shard_slices
from fp8_align.quant.triton_groupwise import ScaleLayout
from fp8_align.vllm_plugin.compat import cutlass_block_fp8_mm, cutlass_block_fp8_one_tile
from fp8_align.vllm_plugin.kernels.base import BlockFp8Kernel

logger = logging.getLogger("vllm.fp8_align")

#: The GEMM behind one call of `fixed_tile_calls`.
CUTLASS, TRITON = "cutlass", "triton"


@functools.cache
def fixed_tile_calls(
    shard_sizes: tuple[int, ...], k: int, capability: tuple[int, int], has_bias: bool
) -> tuple[tuple[slice, slice, str], ...]:
    """The GEMM calls of one layer: per call (rows of the [N, K] codes, rows of the stacked scale
    grids, CUTLASS or TRITON). One call for the whole stacked weight when every shard is a multiple
    of 128 rows, else one per shard; the GEMM of a call depends on its N, K, `capability` and
    `has_bias` only (never on the number of tokens)."""
    if all(size % DEFAULT_BLOCK_SIZE[0] == 0 for size in shard_sizes):
        total = sum(shard_sizes)
        groups = [(slice(0, total), slice(0, total // DEFAULT_BLOCK_SIZE[0]))]
    else:
        groups = shard_slices(list(shard_sizes))
    cutlass_ok = not has_bias and cutlass_scaled_mm_supports_block_fp8(capability[0] * 10 + capability[1])
    return tuple(
        (rows, scale_rows, CUTLASS if cutlass_ok and cutlass_block_fp8_one_tile(rows.stop - rows.start, k, capability) else TRITON)
        for rows, scale_rows in groups
    )


@dataclass(frozen=True)
class FixedTileBlockFp8Kernel(BlockFp8Kernel):
    """Per-token activation quantization, then the `fixed_tile_calls` GEMMs."""

    name: str = "fixed_tile"

    def prepare(self, layer: torch.nn.Module) -> None:
        """Plan the layer's GEMM calls into `layer.fp8_align.gemm_calls` (eagerly: the plan asks
        vLLM's CUTLASS build what it supports, which torch.compile cannot trace) and log them."""
        capability = torch.cuda.get_device_capability(layer.weight.device)
        has_bias = getattr(layer, "bias", None) is not None
        layer.fp8_align.gemm_calls = fixed_tile_calls(tuple(layer.fp8_align.shard_sizes), layer.weight.shape[1], capability, has_bias)
        logger.info(
            "fp8_align: %s [%s] -> fixed_tile (on_policy='bitwise'): %s",
            layer.fp8_align.prefix, tuple(layer.weight.shape), ", ".join(f"rows {r.start}:{r.stop} {gemm}" for r, _, gemm in layer.fp8_align.gemm_calls),
        )  # fmt: skip

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """[..., K] -> [..., N] in x's dtype, the bias added in FP32 before the one rounding."""
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        rounding = layer.fp8_align.rounding
        x_fp8, x_scale = torch.ops.fp8_align.quantize_activation_groupwise(
            x2, rounding.activation_pow2, int(ScaleLayout.COLUMN_MAJOR), rounding.scale_rule
        )
        calls = layer.fp8_align.gemm_calls or fixed_tile_calls(
            tuple(layer.fp8_align.shard_sizes), x2.shape[1], torch.cuda.get_device_capability(x.device), bias is not None
        )  # planned by `prepare` in an engine; an unprepared layer (the trainer's, eager) plans here
        outputs = []
        for rows, scale_rows, gemm in calls:
            weight, scales = layer.weight[rows], layer.weight_scale_inv[scale_rows]
            if gemm == CUTLASS:
                outputs.append(cutlass_block_fp8_mm(x_fp8, weight, x_scale, scales, x.dtype))
            else:
                outputs.append(torch.ops.fp8_align.bitwise_block_fp8_mm(x_fp8, x_scale, weight, scales, None if bias is None else bias[rows], x.dtype))
        out = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)
        return out.reshape(*x.shape[:-1], out.shape[-1])
