"""The CPU backend: pure-torch block FP8 (`fp8_align.quant.fp8_block_gemm`) behind a custom op."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp8_align.vllm_plugin.kernels.base import BlockFp8Kernel
from fp8_align.vllm_plugin.kernels.emulated_op import emulated_block_fp8_mm


@dataclass(frozen=True)
class EmulatedBlockFp8Kernel(BlockFp8Kernel):
    """Pure-torch block FP8 (CPU): activation quantized once, one block GEMM per weight shard.

    The GEMM multiplies FP8 codes as float32 values. Widening them costs more than the GEMM on
    CPU (torch converts float8 element by element: about 9 ms for a 3072 x 576 weight on one
    core, against 1 ms for the matmul), so `prepare` keeps a float32 copy of the codes
    ([N, K], 4 bytes per weight on top of the 1-byte codes) in the layer's state
    (`layer.fp8_align.widened["weight"]`, a plain attribute: see `layer_state` on vLLM's reload)
    and `weights_written` refreshes it in place after a refit. Same values, same bits as widening
    per call.
    """

    name: str = "emulated"

    def prepare(self, layer: torch.nn.Module) -> None:
        """Keep the codes widened to float32 in `layer.fp8_align.widened["weight"]`."""
        layer.fp8_align.widened["weight"] = layer.weight.detach().to(torch.float32)

    def weights_written(self, layer: torch.nn.Module) -> None:
        """Copy the rewritten codes into the float32 copy, in its storage."""
        layer.fp8_align.widened["weight"].copy_(layer.weight.detach())

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return emulated_block_fp8_linear(x, layer.fp8_align.widened["weight"], layer, bias)


def emulated_block_fp8_linear(
    x: torch.Tensor, weight_codes: torch.Tensor, layer: torch.nn.Module, bias: torch.Tensor | None
) -> torch.Tensor:
    """[..., K] -> [..., N] in x's dtype through the emulated op: `weight_codes` [N, K] are the
    layer's FP8 codes (float8_e4m3fn, or float32 holding exactly those values), with the layer's
    `weight_scale_inv` and shard sizes; activations quantized as its `fp8_align.rounding` says."""
    state = layer.fp8_align
    x2 = x.reshape(-1, x.shape[-1])
    out = emulated_block_fp8_mm(
        x2, weight_codes, layer.weight_scale_inv, state.shard_sizes, state.rounding.activation_pow2, state.rounding.scale_rule
    )
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])
