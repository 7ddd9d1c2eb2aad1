"""The interface every block-FP8 GEMM backend implements (CPU emulation and the CUDA backends), and
`LayerShape`, the weight layout their eligibility rules read."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8_align.quant import DEFAULT_BLOCK_SIZE

BLOCK = DEFAULT_BLOCK_SIZE[0]


@dataclass(frozen=True)
class BlockFp8Kernel:
    """A GEMM backend for one layer: `prepare` once after quantization, `apply` per forward,
    `weights_written` after the layer's codes or scales were rewritten in place (a refit)."""

    name: str

    def prepare(self, layer: torch.nn.Module) -> None:
        """Layout work after the weight is quantized."""

    def weights_written(self, layer: torch.nn.Module) -> None:
        """Refresh whatever `prepare` derived from the codes and scales (nothing by default)."""

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """[..., K] -> [..., N] in x's dtype, activations quantized in 1x128 groups as the layer's
        `fp8_align.rounding` says (its `activation_pow2` and `scale_rule`)."""
        raise NotImplementedError


@dataclass(frozen=True)
class LayerShape:
    """The FP8 weight of one layer: [n, k] codes made of `shard_sizes` stacked row blocks."""

    n: int
    k: int
    shard_sizes: tuple[int, ...]

    @property
    def uniform_grid(self) -> bool:
        """The stacked per-shard scale grids equal one [ceil(n/128), ceil(k/128)] grid."""
        return all(size % BLOCK == 0 for size in self.shard_sizes[:-1])

    @property
    def full_blocks(self) -> bool:
        """Uniform grid of whole 128x128 blocks: every shard and K are multiples of 128."""
        return self.k % BLOCK == 0 and all(size % BLOCK == 0 for size in self.shard_sizes)

    def describe(self) -> str:
        return f"N={self.n} K={self.k} shards={list(self.shard_sizes)}"
