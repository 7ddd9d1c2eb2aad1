"""MoE in block FP8 on CUDA (vLLM 0.22, Hopper): fp8_align's expert codes on vLLM's Triton MoE kernel.

Real parts: an in-process `vllm.LLM` (CUDA graphs on) from a small random Qwen3-MoE W1 (hidden 256,
8 experts of intermediate 128, top-2; layer 0 BF16 by the config). Checked:

- the experts run `Fp8AlignMoEMethod` on vLLM's TRITON block-FP8 MoE backend, routers BF16, and
  VLLM_USE_DEEP_GEMM_E8M0 in the worker equals the configured activation rounding (FP32: "0");
- codes and scales read back from the worker equal `quantize_weight_blockwise` of every
  per-expert checkpoint tensor, bit for bit;
- one MoE layer's forward (vLLM's kernel, its own activation quantization) against
  `block_fp8_moe_reference` on the same codes, within a tolerance derived in the test;
- `refit_weights` with W2 as CUDA tensors rewrites the experts in place (pointers unchanged,
  so captured graphs stay valid) to the W2 recipe, and the OpenRLHF-style `load_weights` path
  with transformers-5 fused expert tensors brings W1 back.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from fp8_align.quant import quantize_weight_blockwise
from fp8_align.quant.moe import expert_shard_rows
from fp8_align.vllm_plugin.layer_state import is_fp8_align_layer
from tests.engines import FIRST_LAYER_BF16
from tests.gpu_models import IN_PROCESS_LLM_KWARGS

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

#: moe_backend "triton": vLLM 0.22 would pick FlashInfer CUTLASS for the BF16 experts of layer 0,
#: which JIT-compiles and hung the engine's profile run on the box (no nvcc).
LLM_KWARGS = {**IN_PROCESS_LLM_KWARGS, "moe_backend": "triton"}
NUM_EXPERTS, INTER, HIDDEN, NUM_LAYERS = 8, 128, 256, 3


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from tests.model_factory import make_tiny_qwen3_moe

    return {name: make_tiny_qwen3_moe(tmp_path_factory.mktemp(f"moe_{name}"), seed=seed) for name, seed in (("w1", 0), ("w2", 1))}


@pytest.fixture(scope="module")
def llm(checkpoints: dict[str, Path], vllm_runner: Any) -> Any:
    with vllm_runner(checkpoints["w1"], FIRST_LAYER_BF16, **LLM_KWARGS) as runner:
        yield runner.llm


def _weights(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"), device=device)


def _expert_state(model: torch.nn.Module) -> dict[str, Any]:
    """Worker side: per FP8 experts layer, method, backend, codes/scales (CPU copies) and pointers;
    and the worker's VLLM_USE_DEEP_GEMM_E8M0."""
    layers = {}
    for name, m in model.named_modules():
        if is_fp8_align_layer(m, "experts"):
            layers[name] = {
                "method": type(m.quant_method).__name__, "kernel": m.quant_method.kernel_name,
                "w13": m.w13_weight.detach().cpu().view(torch.uint8), "w2": m.w2_weight.detach().cpu().view(torch.uint8),
                "w13_scale_inv": m.w13_weight_scale_inv.detach().cpu(), "w2_scale_inv": m.w2_weight_scale_inv.detach().cpu(),
                "pointers": [m.w13_weight.data_ptr(), m.w2_weight.data_ptr(), m.w13_weight_scale_inv.data_ptr(),
                             m.w2_weight_scale_inv.data_ptr()],
            }  # fmt: skip
    routers = {name: type(m.quant_method).__name__ for name, m in model.named_modules() if name.endswith("mlp.gate")}
    return {"layers": layers, "routers": routers, "e8m0": os.environ.get("VLLM_USE_DEEP_GEMM_E8M0")}


def _assert_experts_hold(state: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    assert len(state["layers"]) == NUM_LAYERS - 1
    for name, entry in state["layers"].items():
        layer = int(name.split(".")[2])
        for e in range(NUM_EXPERTS):
            for shard, hf in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                where = expert_shard_rows(shard, INTER, HIDDEN)
                codes, scales = quantize_weight_blockwise(weights[f"model.layers.{layer}.mlp.experts.{e}.{hf}.weight"])
                assert torch.equal(entry[where.param][e, where.rows], codes.view(torch.uint8)), (layer, e, shard)
                assert torch.equal(entry[f"{where.param}_scale_inv"][e, where.scale_rows], scales), (layer, e, shard)


def _layer_vs_reference(model: torch.nn.Module) -> dict[str, float]:
    """Worker side: layer 1's experts on a random [64, H] batch with random top-2 routing, through
    the quant method's apply (vLLM's Triton MoE kernel) and `block_fp8_moe_reference`; returns the
    largest |difference| and the largest |reference| value."""
    from fp8_align.quant.moe import block_fp8_moe_reference

    layer = next(m for m in model.modules() if is_fp8_align_layer(m, "experts"))
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, HIDDEN, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, device="cuda", generator=g)[:2] for _ in range(64)]).to(torch.int32)
    weights = torch.softmax(torch.randn(64, 2, device="cuda", generator=g), dim=-1)
    got = layer.quant_method.apply(layer, x, weights, ids, None, None)
    ref = block_fp8_moe_reference(x, weights, ids, layer.w13_weight, layer.w13_weight_scale_inv, layer.w2_weight,
                                  layer.w2_weight_scale_inv, layer.quant_method.cfg.use_activation_pow2_scale)  # fmt: skip
    return {"max_abs_diff": float((got.float() - ref.float()).abs().max()), "max_abs_ref": float(ref.float().abs().max()),
            "mean_abs_diff": float((got.float() - ref.float()).abs().mean()), "mean_abs_ref": float(ref.float().abs().mean())}  # fmt: skip


def test_experts_run_fp8_on_vllm_triton_moe(llm: Any, checkpoints: dict[str, Path]) -> None:
    [state] = llm.apply_model(_expert_state)
    assert {e["method"] for e in state["layers"].values()} == {"Fp8AlignMoEMethod"}
    assert {e["kernel"] for e in state["layers"].values()} == {"vllm_triton"}
    assert set(state["routers"].values()) == {"Fp8AlignBf16LinearMethod"}
    assert state["e8m0"] == "0"
    _assert_experts_hold(state, _weights(checkpoints["w1"]))


def test_moe_layer_matches_the_reference(llm: Any) -> None:
    """Tolerance: the kernel and the reference share the weight codes and scales; the activation
    codes can differ by one E4M3 step where vLLM's quantizer (division by the scale, eps 1e-10,
    fused SiLU-and-multiply before the second quantization) rounds a value the other way (2**-3
    relative at most, rare), and the GEMMs accumulate in a different order (FP32, ~1e-6). The mean
    error must stay below 1% of the mean magnitude and the largest below 10% of the largest."""
    [result] = llm.apply_model(_layer_vs_reference)
    print("moe layer vs reference:", result)
    assert result["mean_abs_diff"] <= 0.01 * result["mean_abs_ref"], result
    assert result["max_abs_diff"] <= 0.10 * result["max_abs_ref"], result


def test_refit_and_fused_sync_rewrite_experts_in_place(llm: Any, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    from fp8_align.vllm_plugin.refit import refit_weights

    [before] = llm.apply_model(_expert_state)
    w2 = _weights(checkpoints["w2"], "cuda")
    refit_weights(llm, w2)
    [after] = llm.apply_model(_expert_state)
    _assert_experts_hold(after, _weights(checkpoints["w2"]))
    assert {n: e["pointers"] for n, e in after["layers"].items()} == {n: e["pointers"] for n, e in before["layers"].items()}
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = llm.generate([TokensPrompt(prompt_token_ids=[5, 17, 99, 230])], SamplingParams(max_tokens=8, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 8
    w1 = _weights(checkpoints["w1"])
    fused = []
    for layer in (1, 2):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up = torch.stack([torch.cat([w1[f"{p}.{e}.gate_proj.weight"], w1[f"{p}.{e}.up_proj.weight"]]) for e in range(NUM_EXPERTS)])
        down = torch.stack([w1[f"{p}.{e}.down_proj.weight"] for e in range(NUM_EXPERTS)])
        fused += [(f"{p}.gate_up_proj", gate_up), (f"{p}.down_proj", down)]
    from safetensors.torch import save_file

    save_file(dict(fused), str(tmp_path / "fused.safetensors"))
    llm.collective_rpc(_load_fused, args=(str(tmp_path / "fused.safetensors"),))
    [synced] = llm.apply_model(_expert_state)
    _assert_experts_hold(synced, w1)
    assert {n: e["pointers"] for n, e in synced["layers"].items()} == {n: e["pointers"] for n, e in before["layers"].items()}


def _load_fused(worker: Any, path: str) -> None:
    """Worker side: the stacks' call, `model.load_weights(list_of_pairs)` with CUDA tensors, one
    call (verl's shape). Tensors travel as a file: collective_rpc arguments lose tensor data."""
    from safetensors.torch import load_file

    worker.model_runner.model.load_weights(weights=list(load_file(path, device="cuda").items()))
