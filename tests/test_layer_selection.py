"""The structural FP8 rule (`fp8_align.layer_selection`): every linear and expert group inside the
text decoder's layers, except routers, configured BF16 layers, non-decoder containers and
unaligned shapes; applied to the module trees of real architectures built on the meta device."""

from __future__ import annotations

import pytest
import torch

from fp8_align import FP8Config, FP8ConfigError
from fp8_align.layer_selection import (
    PLANNED_BF16_REASONS,
    REASON_CONFIG,
    REASON_OUTSIDE,
    REASON_ROUTER,
    REASON_SHAPE,
    decide_layer,
    decoder_layer_index,
    num_routed_experts,
    summarize_decisions,
)

CFG = FP8Config(num_first_layers_in_bf16=1, num_last_layers_in_bf16=1)


@pytest.mark.parametrize(
    ("prefix", "kwargs", "fp8", "reason"),
    [
        ("model.layers.0.self_attn.qkv_proj", {}, False, REASON_CONFIG),  # first layer kept BF16
        ("model.layers.1.self_attn.qkv_proj", {}, True, "block FP8"),
        ("model.layers.2.mlp.down_proj", {"input_size": 384}, True, "block FP8"),
        ("model.layers.3.mlp.down_proj", {}, False, REASON_CONFIG),  # last layer kept BF16
        ("lm_head", {}, False, REASON_OUTSIDE),
        ("model.layers.4.mlp.down_proj", {}, False, REASON_OUTSIDE),  # an MTP layer past the decoder
        ("model.visual.blocks.1.attn.qkv", {}, False, REASON_OUTSIDE),
        ("model.layers.2.mlp.gate", {"output_size": 8, "num_experts": 8}, False, REASON_ROUTER),
        ("model.layers.2.mlp.shared_expert_gate", {"output_size": 1, "num_experts": 8}, False, REASON_ROUTER),
        ("model.layers.2.mlp.gate", {"output_size": 8}, True, "block FP8"),  # dense model: not a router
        ("model.layers.2.self_attn.kv_a_proj_with_mqa", {"output_size": 576, "input_size": 256}, True, "block FP8"),
        ("model.layers.2.mlp.dense_4h_to_h", {"input_size": 100}, False, REASON_SHAPE),
        ("gpt_neox.layers.2.attention.query_key_value", {}, True, "block FP8"),
    ],
)
def test_decide_layer(prefix, kwargs, fp8, reason):
    decision = decide_layer(prefix, 4, CFG, **kwargs)
    assert (decision.fp8, decision.reason) == (fp8, reason)
    assert decision.planned is (fp8 or reason in PLANNED_BF16_REASONS)


def test_experts_follow_the_edge_layers_and_never_count_as_routers():
    assert decide_layer("model.layers.1.mlp.experts", 4, CFG, kind="experts").fp8
    assert decide_layer("model.layers.0.mlp.experts", 4, CFG, kind="experts").reason == REASON_CONFIG


def test_bf16_precision_depth_errors_and_layer_index():
    assert decide_layer("model.layers.1.mlp.down_proj", 4, FP8Config(precision="bf16", fp8=None)).reason == "precision is bf16"
    with pytest.raises(FP8ConfigError, match="larger than the model"):
        decide_layer("model.layers.1.mlp.down_proj", 2, FP8Config(num_first_layers_in_bf16=2, num_last_layers_in_bf16=1))
    assert decoder_layer_index("language_model.model.layers.17.self_attn.o_proj") == 17
    assert decoder_layer_index("lm_head") is None


def test_summary_counts_by_kind_and_reason():
    decisions = [
        decide_layer("model.layers.1.mlp.experts", 4, CFG, kind="experts"),
        decide_layer("model.layers.0.mlp.experts", 4, CFG, kind="experts"),
        decide_layer("model.layers.1.self_attn.o_proj", 4, CFG),
        decide_layer("model.layers.1.mlp.gate", 4, CFG, output_size=8, num_experts=8),
    ]
    assert summarize_decisions(decisions) == (
        f"linears 1 FP8, 1 BF16 ({REASON_ROUTER}: 1); expert groups 1 FP8, 1 BF16 ({REASON_CONFIG}: 1)"
    )


def _hf_linears(config) -> list[tuple[str, torch.nn.Linear]]:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


def _fp8_names(config) -> set[str]:
    text = config.get_text_config()
    depth, experts = text.num_hidden_layers, num_routed_experts(text)
    return {
        name.rsplit(".", 1)[-1]
        for name, m in _hf_linears(config)
        if decide_layer(name, depth, FP8Config(), output_size=m.out_features, input_size=m.in_features, num_experts=experts).fp8
    }


def test_rule_on_architectures_a_name_list_missed():
    """Real transformers module trees (meta device): the projections of GPT-NeoX, Phi-3, GPT-2-style
    StarCoder2, Falcon (`h.<i>` layers) and DeepSeek-V3 (MLA) are FP8 without being named anywhere
    in fp8_align; lm_head is never FP8."""
    from transformers import (
        DeepseekV3Config,
        FalconConfig,
        GPTNeoXConfig,
        Phi3Config,
        Qwen3MoeConfig,
        Starcoder2Config,
    )

    small = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, vocab_size=40000)
    assert _fp8_names(GPTNeoXConfig(**small, intermediate_size=512)) == {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"}
    assert _fp8_names(Phi3Config(**small, intermediate_size=512)) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    assert _fp8_names(Starcoder2Config(**small, intermediate_size=512)) == {"q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"}
    assert _fp8_names(FalconConfig(**small)) == {"query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"}
    mla = DeepseekV3Config(
        **small, intermediate_size=512, moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2,
        q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
        first_k_dense_replace=1, n_shared_experts=1, topk_method="noaux_tc",
    )  # fmt: skip
    assert {"q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"} <= _fp8_names(mla)
    moe = Qwen3MoeConfig(**small, num_key_value_heads=2, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2)
    assert _fp8_names(moe) == {"q_proj", "k_proj", "v_proj", "o_proj"}  # experts and router are not nn.Linear here


def test_strict_mode_refuses_unplanned_bf16_only():
    """`record_decision`: an unplanned BF16 layer (outside the decoder, shape, unsupported experts)
    raises with strict=True naming the layer and reason; planned BF16 (config edge layers,
    routers) never does; without strict nothing raises."""
    from fp8_align.vllm_plugin.layer_plan import StrictModeError, layer_decisions, record_decision

    strict = FP8Config(strict=True, num_first_layers_in_bf16=1)
    shape = decide_layer("model.layers.2.mlp.dense_4h_to_h", 4, strict, input_size=100)
    with pytest.raises(StrictModeError, match=r"model\.layers\.2\.mlp\.dense_4h_to_h \(linear\): input size not a multiple of 16: K=100"):
        record_decision(torch.nn.Linear(1, 1), shape, strict)
    root = torch.nn.Module()
    root.edge, root.router = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    record_decision(root.edge, decide_layer("model.layers.0.mlp.down_proj", 4, strict), strict)
    record_decision(root.router, decide_layer("model.layers.2.mlp.gate", 4, strict, output_size=8, num_experts=8), strict)
    record_decision(torch.nn.Linear(1, 1), shape, FP8Config(num_first_layers_in_bf16=1))
    assert [d.reason for d in layer_decisions(root)] == [REASON_CONFIG, REASON_ROUTER]
