"""What the MoE GPU engine tests (tests/test_gpu_moe*.py) share: readers of fp8_align's routed
experts inside a running engine and their checks against the torch references.

`expert_state` and `layer_vs_reference` run in the worker (`llm.apply_model`); nothing here
imports vLLM or touches CUDA at import.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from fp8_align.quant import quantize_weight_blockwise
from fp8_align.quant.moe import expert_shard_rows
from fp8_align.vllm_plugin.layer_state import is_fp8_align_layer


def checkpoint_weights(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's model.safetensors."""
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"), device=device)


def expert_state(model: torch.nn.Module) -> dict[str, Any]:
    """Worker side: per FP8 experts layer, method, kernel, codes/scales (CPU copies), their data
    pointers and the pointers of the weight scales vLLM's MoE kernel was built with; the router
    methods; the worker's VLLM_USE_DEEP_GEMM_E8M0."""
    layers = {}
    for name, m in model.named_modules():
        if is_fp8_align_layer(m, "experts"):
            quant_config = m.quant_method.moe_quant_config
            layers[name] = {
                "method": type(m.quant_method).__name__, "kernel": m.quant_method.kernel_name,
                "experts_impl": type(m.quant_method.moe_kernel.impl.fused_experts).__name__,
                "w13": m.w13_weight.detach().cpu().view(torch.uint8), "w2": m.w2_weight.detach().cpu().view(torch.uint8),
                "w13_scale_inv": m.w13_weight_scale_inv.detach().cpu(), "w2_scale_inv": m.w2_weight_scale_inv.detach().cpu(),
                "pointers": [m.w13_weight.data_ptr(), m.w2_weight.data_ptr(), m.w13_weight_scale_inv.data_ptr(),
                             m.w2_weight_scale_inv.data_ptr()],
                "kernel_scale_pointers": [quant_config.w1_scale.data_ptr(), quant_config.w2_scale.data_ptr()],
            }  # fmt: skip
    routers = {name: type(m.quant_method).__name__ for name, m in model.named_modules() if name.endswith("mlp.gate")}
    return {"layers": layers, "routers": routers, "e8m0": os.environ.get("VLLM_USE_DEEP_GEMM_E8M0")}


def assert_experts_hold(state: dict[str, Any], weights: dict[str, torch.Tensor], num_experts: int, inter: int, hidden: int) -> None:
    """Every expert shard's codes and scales in `state` equal `quantize_weight_blockwise` of its
    checkpoint tensor in `weights`, bit for bit."""
    for name, entry in state["layers"].items():
        layer = int(name.split(".")[2])
        for e in range(num_experts):
            for shard, hf in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                where = expert_shard_rows(shard, inter, hidden)
                codes, scales = quantize_weight_blockwise(weights[f"model.layers.{layer}.mlp.experts.{e}.{hf}.weight"])
                assert torch.equal(entry[where.param][e, where.rows], codes.view(torch.uint8)), (layer, e, shard)
                assert torch.equal(entry[f"{where.param}_scale_inv"][e, where.scale_rows], scales), (layer, e, shard)


def layer_vs_reference(model: torch.nn.Module, tokens: int, top_k: int) -> dict[str, Any]:
    """Worker side: the first FP8 experts layer on a random [tokens, H] batch with random top-k
    routing, through the quant method's apply (vLLM's MoE kernel, its own activation quantization)
    and `block_fp8_moe_reference` on the same codes; the largest and mean |difference| and
    |reference|, and which experts implementation vLLM's kernel picked for this batch."""
    from fp8_align.quant.moe import block_fp8_moe_reference

    layer = next(m for m in model.modules() if is_fp8_align_layer(m, "experts"))
    num_experts, hidden = layer.w13_weight.shape[0], layer.w2_weight.shape[1]
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(num_experts, device="cuda", generator=g)[:top_k] for _ in range(tokens)]).to(torch.int32)
    weights = torch.softmax(torch.randn(tokens, top_k, device="cuda", generator=g), dim=-1)
    fused_experts = layer.quant_method.moe_kernel.impl.fused_experts
    select = getattr(fused_experts, "_select_experts_impl", None)  # vLLM's FallbackExperts (TritonOrDeepGemmExperts)
    picked = select(x, layer.w13_weight, layer.w2_weight) if select is not None else fused_experts
    got = layer.quant_method.apply(layer, x, weights, ids, None, None)
    ref = block_fp8_moe_reference(x, weights, ids, layer.w13_weight, layer.w13_weight_scale_inv, layer.w2_weight,
                                  layer.w2_weight_scale_inv, layer.fp8_align.rounding.activation_pow2)  # fmt: skip
    diff = (got.float() - ref.float()).abs()
    return {"max_abs_diff": float(diff.max()), "max_abs_ref": float(ref.float().abs().max()),
            "mean_abs_diff": float(diff.mean()), "mean_abs_ref": float(ref.float().abs().mean()),
            "experts_impl": type(picked).__name__}  # fmt: skip


def assert_within_moe_tolerance(result: dict[str, Any]) -> None:
    """The kernel and the reference share the weight codes and scales; the activation codes can
    differ by one E4M3 step where vLLM's quantizer (division by the scale, eps 1e-10, fused
    SiLU-and-multiply before the second quantization) rounds a value the other way (2**-3 relative
    at most, rare), and the GEMMs accumulate in a different order. The mean error must stay below
    2% of the mean magnitude and the largest below 10% of the largest. Measured on an H200, mean:
    vLLM's Triton kernel 0.96% (vLLM 0.22) and 1.03% (0.25.1) on 64 tokens, largest 2.0%;
    DeepGEMM's grouped kernel 1.21% and 1.22% on 256 tokens (it also rounds partial sums in the
    tensor cores' reduced precision before promoting them to FP32). A kernel reading other
    weights than the reference's (a stale copy after a refit) is off by about 100%."""
    assert result["mean_abs_diff"] <= 0.02 * result["mean_abs_ref"], result
    assert result["max_abs_diff"] <= 0.10 * result["max_abs_ref"], result
