"""Where each shard of a merged weight (q|k|v, gate|up) lives in the stored codes and scales."""

from __future__ import annotations

from fp8_align.quant import DEFAULT_BLOCK_SIZE


def shard_slices(shard_sizes: list[int]) -> list[tuple[slice, slice]]:
    """Per shard: (rows of the [N, K] codes, rows of the stacked per-shard 128-row scale grids)."""
    slices, row, scale_row = [], 0, 0
    for size in shard_sizes:
        blocks = -(-size // DEFAULT_BLOCK_SIZE[0])
        slices.append((slice(row, row + size), slice(scale_row, scale_row + blocks)))
        row, scale_row = row + size, scale_row + blocks
    return slices
