"""Read back, from inside vLLM workers, what the plugin did to each linear layer.

Functions here are passed to `LLM.apply_model` / `collective_rpc`, so they live in an importable
module (vLLM pickles them; set VLLM_ALLOW_INSECURE_SERIALIZATION=1).
"""

from __future__ import annotations

from typing import Any

import torch

from fp8_align.quant import blockwise_fp8_linear
from fp8_align.vllm_plugin.shards import shard_slices

_SELF_CHECK_TOKENS = 5


def linear_layer_state(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Per linear module name: its quant method, and for FP8 layers codes, scales, shards, kernel,
    and `reference_max_abs_diff`: the largest |difference| between the layer's own forward and
    `fp8_align.quant.blockwise_fp8_linear` (per shard) on a fixed random [5, K] BF16 input."""
    state: dict[str, dict[str, Any]] = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(module, "input_size"):
            continue
        entry: dict[str, Any] = {"method": type(method).__name__}
        if hasattr(module, "fp8_align_kernel"):
            entry.update(
                weight=module.weight.detach().cpu(),
                weight_scale_inv=module.weight_scale_inv.detach().cpu(),
                shard_sizes=list(module.fp8_align_shard_sizes),
                kernel=module.fp8_align_kernel.name,
                reference_max_abs_diff=_max_diff_to_reference(module),
            )
        state[name] = entry
    return state


def _max_diff_to_reference(module: torch.nn.Module) -> float:
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(_SELF_CHECK_TOKENS, module.weight.shape[1], generator=generator).to(torch.bfloat16)
    x = x.to(module.weight.device)
    got = module.quant_method.apply(module, x)
    act_pow2 = module.quant_method.cfg.use_activation_pow2_scale
    parts = [
        blockwise_fp8_linear(x, module.weight[rows], module.weight_scale_inv[scale_rows], activation_pow2_scale=act_pow2)
        for rows, scale_rows in shard_slices(module.fp8_align_shard_sizes)
    ]
    return float((got.float() - torch.cat(parts, dim=-1).float()).abs().max())
