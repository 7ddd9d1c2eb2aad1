"""Read back, from inside vLLM workers, what the plugin did to each linear layer.

Functions here are passed to `LLM.apply_model` / `collective_rpc`, so they live in an importable
module (vLLM pickles them; set VLLM_ALLOW_INSECURE_SERIALIZATION=1).
"""

from __future__ import annotations

from typing import Any

import torch


def linear_layer_state(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Per linear module name: its quant method, and for FP8 layers codes, scales and shards (CPU)."""
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
            )
        state[name] = entry
    return state
