"""The interface every block-FP8 GEMM backend implements (CPU emulation and the CUDA backends)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockFp8Kernel:
    """A GEMM backend for one layer: `prepare` once after quantization, `apply` per forward,
    `weights_written` after the layer's codes or scales were rewritten in place (a refit)."""

    name: str

    def prepare(self, layer: torch.nn.Module) -> None:
        """Layout work after the weight is quantized."""

    def weights_written(self, layer: torch.nn.Module) -> None:
        """Refresh whatever `prepare` derived from the codes and scales (nothing by default)."""

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None,
        act_pow2: bool,
        scale_rule: str = "amax_over_max",
    ) -> torch.Tensor:
        """[..., K] -> [..., N] in x's dtype, activations quantized with power-of-two scales when
        `act_pow2` and by `scale_rule` ("amax_over_max" / "transformer_engine")."""
        raise NotImplementedError
