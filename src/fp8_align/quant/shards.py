"""Merged weights (q|k|v, gate|up): a [sum(shard_sizes), K] weight quantized shard by shard.

Each shard gets its own 128x128 block grid, exactly as if the checkpoint's separate projections
were quantized one by one; the codes keep the merged [N, K] layout and the shards' scale grids are
stacked in order. `shard_slices` says where each shard lives in both.
"""

from __future__ import annotations

import torch

from fp8_align.quant.blockwise import DEFAULT_BLOCK_SIZE
from fp8_align.quant.dispatch import quantize_weight_into
from fp8_align.rounding import DEFAULT_SCALE_RULE
from fp8_align.quant.scales import FP8_DTYPE


def shard_slices(shard_sizes: list[int]) -> list[tuple[slice, slice]]:
    """Per shard: (rows of the [N, K] codes, rows of the stacked per-shard 128-row scale grids)."""
    slices, row, scale_row = [], 0, 0
    for size in shard_sizes:
        blocks = -(-size // DEFAULT_BLOCK_SIZE[0])
        slices.append((slice(row, row + size), slice(scale_row, scale_row + blocks)))
        row, scale_row = row + size, scale_row + blocks
    return slices


def empty_shard_outputs(shard_sizes: list[int], k: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized outputs of a merged [sum(shard_sizes), k] weight's quantization: codes [N, k]
    e4m3 and the shards' stacked scale grids [sum_s ceil(n_s/128), ceil(k/128)] float32
    (`shard_slices` says which rows of each belong to which shard)."""
    codes = torch.empty((sum(shard_sizes), k), dtype=FP8_DTYPE, device=device)
    grid_rows = shard_slices(shard_sizes)[-1][1].stop
    return codes, torch.empty((grid_rows, -(-k // DEFAULT_BLOCK_SIZE[1])), dtype=torch.float32, device=device)


def quantize_shards(
    weight: torch.Tensor, shard_sizes: list[int], pow2_scale: bool, scale_rule: str = DEFAULT_SCALE_RULE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a merged [sum(shard_sizes), K] weight shard by shard (q|k|v, gate|up) with
    `pow2_scale` and `scale_rule`.

    Each shard gets its own 128x128 block grid, exactly as if the checkpoint's separate
    projections were quantized one by one. Returns (codes [N, K] e4m3, scales [sum_s ceil(n_s/128),
    ceil(K/128)] float32, the shards' grids stacked in order), via `quantize_weight_into` (the
    Triton kernel on CUDA, the torch reference elsewhere; same bits). Raises ValueError when the
    weight holds NaN/Inf (one device sync for the whole weight).
    """
    codes, scales = empty_shard_outputs(shard_sizes, weight.shape[1], weight.device)
    for rows, scale_rows in shard_slices(shard_sizes):
        quantize_weight_into(weight[rows], pow2_scale, codes[rows], scales[scale_rows], check_finite=False, scale_rule=scale_rule)
    if not bool(torch.isfinite(scales).all()):
        raise ValueError(f"weight of shape {tuple(weight.shape)} contains NaN or Inf; FP8 scales would be invalid")
    return codes, scales
