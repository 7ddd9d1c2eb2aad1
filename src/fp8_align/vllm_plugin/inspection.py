"""Read back, from inside vLLM workers, what the plugin did to each linear layer.

Functions here are passed to `LLM.apply_model` / `collective_rpc`, so they live in an importable
module (vLLM pickles them; set VLLM_ALLOW_INSECURE_SERIALIZATION=1). `read_linear_layers(llm)` is
the caller's side: it runs `linear_layer_state` in every worker and returns FP8 codes as FP8.

Why codes travel as uint8: a CPU float8 tensor cannot be pickled with protocol 5 (torch's storage
reduction writes an untyped storage that its own legacy loader then rejects: "type object
'torch.storage.UntypedStorage' has no attribute 'dtype'"), and vLLM's multiprocessing and Ray
executors return worker results exactly that way. Found with tensor parallelism on the GPU box.
"""

from __future__ import annotations

from typing import Any

import torch

from fp8_align.quant import blockwise_fp8_linear
from fp8_align.quant.shards import shard_slices
from fp8_align.vllm_plugin.compat import routed_experts_class
from fp8_align.vllm_plugin.layer_state import is_fp8_align_layer

_SELF_CHECK_TOKENS = 5


def read_linear_layers(llm: Any) -> list[dict[str, dict[str, Any]]]:
    """`linear_layer_state` of every worker of `llm` (a `vllm.LLM`), in rank order, FP8 codes as
    float8_e4m3fn tensors [N, K] again."""
    return [
        {name: _fp8_codes_restored(entry) for name, entry in layers.items()}
        for layers in llm.apply_model(linear_layer_state)
    ]


def portable_fp8_codes(weight: torch.Tensor) -> dict[str, Any]:
    """`weight` (FP8 codes [N, K], any device) as `{"weight": uint8 CPU copy, "weight_dtype": name}`."""
    return {"weight": weight.detach().cpu().view(torch.uint8), "weight_dtype": str(weight.dtype).removeprefix("torch.")}


def _fp8_codes_restored(entry: dict[str, Any]) -> dict[str, Any]:
    """Inverse of `portable_fp8_codes` on one layer entry (entries without FP8 codes pass unchanged)."""
    if "weight_dtype" not in entry:
        return entry
    restored = {key: value for key, value in entry.items() if key != "weight_dtype"}
    restored["weight"] = entry["weight"].view(getattr(torch, entry["weight_dtype"]))
    return restored


def linear_layer_state(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Worker side. Per linear module name: its quant method, and for FP8 layers codes (as uint8
    [N, K] with `weight_dtype` naming the FP8 dtype; see the module docstring), scales, shards,
    kernel, and `reference_max_abs_diff`: the largest |difference| between the layer's own forward and
    `fp8_align.quant.blockwise_fp8_linear` (per shard) on a fixed random [5, K] BF16 input."""
    state: dict[str, dict[str, Any]] = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(module, "input_size"):
            continue
        entry: dict[str, Any] = {"method": type(method).__name__}
        if is_fp8_align_layer(module, "linear"):
            entry.update(
                **portable_fp8_codes(module.weight),
                weight_scale_inv=module.weight_scale_inv.detach().cpu(),
                shard_sizes=list(module.fp8_align.shard_sizes),
                kernel=module.fp8_align.kernel.name,
                reference_max_abs_diff=_max_diff_to_reference(module),
            )
        state[name] = entry
    return state


def _max_diff_to_reference(module: torch.nn.Module) -> float:
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(_SELF_CHECK_TOKENS, module.weight.shape[1], generator=generator).to(torch.bfloat16)
    x = x.to(module.weight.device)
    got = module.quant_method.apply(module, x)
    rounding = module.fp8_align.rounding
    parts = [
        blockwise_fp8_linear(
            x, module.weight[rows], module.weight_scale_inv[scale_rows],
            activation_pow2_scale=rounding.activation_pow2, scale_rule=rounding.scale_rule,
        )  # fmt: skip
        for rows, scale_rows in shard_slices(module.fp8_align.shard_sizes)
    ]
    return float((got.float() - torch.cat(parts, dim=-1).float()).abs().max())


def read_expert_layers(llm: Any) -> list[dict[str, dict[str, Any]]]:
    """`expert_layer_state` of every worker of `llm`, in rank order, codes as float8_e4m3fn again."""
    return [
        {name: {key: _restored(value) for key, value in entry.items()} for name, entry in layers.items()}
        for layers in llm.apply_model(expert_layer_state)
    ]


def expert_layer_state(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Worker side. Per routed-experts module name: its quant method and, for fp8_align FP8 experts,
    `prefix`, `kernel`, `w13`/`w2` codes ([E, 2I, H] / [E, H, I], portable as in
    `portable_fp8_codes`) and `w13_scale_inv`/`w2_scale_inv` (float32); BF16 experts give their
    `w13`/`w2` weights."""
    state: dict[str, dict[str, Any]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, routed_experts_class()):
            continue
        method = module.quant_method
        entry: dict[str, Any] = {"method": type(method).__name__}
        if is_fp8_align_layer(module, "experts"):
            entry.update(
                prefix=module.fp8_align.prefix, kernel=method.kernel_name,
                w13=portable_fp8_codes(module.w13_weight), w2=portable_fp8_codes(module.w2_weight),
                w13_scale_inv=module.w13_weight_scale_inv.detach().cpu(), w2_scale_inv=module.w2_weight_scale_inv.detach().cpu(),
            )  # fmt: skip
        else:
            entry.update(w13=module.w13_weight.detach().cpu(), w2=module.w2_weight.detach().cpu())
        state[name] = entry
    return state


def _restored(value: Any) -> Any:
    """A `portable_fp8_codes` dict back as the FP8 tensor; anything else unchanged."""
    if isinstance(value, dict) and "weight_dtype" in value:
        return value["weight"].view(getattr(torch, value["weight_dtype"]))
    return value
