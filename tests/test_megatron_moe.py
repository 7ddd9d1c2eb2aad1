"""MoE on the training side: the megatron-core MoE settings under which routed experts quantize as
on the generation side (real megatron-core TransformerConfig objects), and `alignment_report`
over routed experts and routers in HF (per-expert and transformers-5 fused) and Megatron
(TEGroupedMLP, SequentialMLP) layouts."""

from __future__ import annotations

import dataclasses

import megatron.core.utils as megatron_utils
import pytest
import torch
from megatron.core.fp8_utils import is_first_last_bf16_layer
from megatron.core.transformer.transformer_config import TransformerConfig
from packaging.version import Version

from fp8_align import FP8Config
from fp8_align.layer_selection import REASON_CONFIG, REASON_FP8, REASON_ROUTER
from fp8_align.megatron_ext import (
    TrainingSetupError,
    alignment_report,
    apply_to_transformer_config,
    check_moe_alignment,
    transformer_config_kwargs,
)
from fp8_align.megatron_ext.weight_matrices import decoder_matrices

NUM_LAYERS = 4
MOE_SHAPE = {
    "num_layers": NUM_LAYERS,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_moe_experts": 8,
    "moe_router_topk": 2,
    "gated_linear_unit": True,
    "add_bias_linear": False,
}
POW2 = FP8Config(use_weight_pow2_scale=True, use_activation_pow2_scale=True)


@pytest.fixture
def te_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """megatron-core's __post_init__ refuses MoE + FP8 unless TransformerEngine >= 1.7 is installed
    (it reads the version once into megatron.core.utils._te_version); TE is not installed on this
    CPU machine, so these tests set that cached version to a TE with the blockwise recipe."""
    monkeypatch.setattr(megatron_utils, "_te_version", Version("2.8.0"))


# ------------------------------------------------------------------------------ shim


def test_megatron_itself_refuses_moe_fp8_without_transformer_engine() -> None:
    with pytest.raises(ValueError, match="supports MoE FP8 training"):
        apply_to_transformer_config(TransformerConfig(**MOE_SHAPE, moe_ffn_hidden_size=256), FP8Config())


@pytest.mark.usefixtures("te_installed")
def test_an_aligned_moe_config_gets_the_fp8_fields_and_keeps_its_moe_settings() -> None:
    original = TransformerConfig(
        **MOE_SHAPE, moe_ffn_hidden_size=384, moe_grouped_gemm=True, moe_router_dtype="fp64"
    )
    cfg = FP8Config(num_first_layers_in_bf16=1, num_last_layers_in_bf16=1)

    updated = apply_to_transformer_config(original, cfg)

    assert (updated.fp8, updated.fp8_recipe) == ("e4m3", "blockwise")
    # MoE layers are decoder layers: megatron-core's per-layer FP8 context keeps the same layers
    # (experts included) in BF16 as generation.
    assert {i for i in range(NUM_LAYERS) if is_first_last_bf16_layer(updated, i)} == {0, NUM_LAYERS - 1}
    # No MoE field is changed: the router is never FP8 in megatron-core, and its dtype, the
    # expert implementation and the padding are the user's choices.
    moe_fields = [field.name for field in dataclasses.fields(TransformerConfig) if field.name.startswith("moe_")]
    assert {name: getattr(updated, name) for name in moe_fields} == {
        name: getattr(original, name) for name in moe_fields
    }
    assert updated.moe_router_dtype == "fp64" and updated.moe_grouped_gemm


@pytest.mark.usefixtures("te_installed")
def test_hand_built_moe_config_is_checked_after_construction() -> None:
    config = TransformerConfig(
        **MOE_SHAPE, moe_ffn_hidden_size=256, **transformer_config_kwargs(POW2, num_layers=NUM_LAYERS)
    )
    check_moe_alignment(config, POW2)
    assert config.fp8 == "e4m3" and config.num_moe_experts == 8


@pytest.mark.usefixtures("te_installed")
@pytest.mark.parametrize(
    ("model", "message"),
    [
        # Gate rows [0, 192) and up rows [192, 384) share the block of rows [128, 256).
        ({"moe_ffn_hidden_size": 192}, r"moe_ffn_hidden_size=192 / expert_tensor_parallel_size=1 .*no expert_tensor"),
        # megatron-core's own default: moe_ffn_hidden_size = ffn_hidden_size.
        ({"ffn_hidden_size": 320}, r"moe_ffn_hidden_size=320 "),
        # 384 / 2 = 192 per rank; expert TP 1 would keep 384 = 3 x 128.
        (
            {"moe_ffn_hidden_size": 384, "expert_tensor_parallel_size": 2},
            r"expert_tensor_parallel_size=2 .*use expert_tensor_parallel_size in \[1\]",
        ),
        # Expert TP defaults to tensor_model_parallel_size.
        ({"moe_ffn_hidden_size": 384, "tensor_model_parallel_size": 2}, r"expert_tensor_parallel_size=2 "),
        ({"moe_ffn_hidden_size": 256, "transformer_impl": "local"}, r"transformer_impl='local'.*BF16"),
        ({"moe_ffn_hidden_size": 256, "moe_mlp_glu_interleave_size": 64}, r"moe_mlp_glu_interleave_size=64"),
    ],
)
def test_expert_settings_that_break_generations_grid_are_refused(model: dict, message: str) -> None:
    config = TransformerConfig(**MOE_SHAPE | model)
    with pytest.raises(TrainingSetupError, match=message) as info:
        apply_to_transformer_config(config, FP8Config())
    assert "allow_recipe_mismatch=True" in str(info.value)
    check_moe_alignment(config, FP8Config(fp8=None))  # BF16 training: nothing to align
    check_moe_alignment(config, FP8Config(allow_recipe_mismatch=True))


@pytest.mark.usefixtures("te_installed")
@pytest.mark.parametrize(
    "model",
    [
        {"moe_ffn_hidden_size": 512, "expert_tensor_parallel_size": 4},  # 128 per rank
        {"moe_ffn_hidden_size": 256, "moe_mlp_glu_interleave_size": 128},
        # Ungated, unsharded experts: one projection per tensor, partial edge blocks as on generation.
        {"moe_ffn_hidden_size": 192, "gated_linear_unit": False},
    ],
)
def test_expert_settings_that_keep_the_grid_pass(model: dict) -> None:
    updated = apply_to_transformer_config(TransformerConfig(**MOE_SHAPE | model), FP8Config())
    assert updated.fp8 == "e4m3"


@pytest.mark.usefixtures("te_installed")
def test_every_expert_problem_is_listed_at_once() -> None:
    config = TransformerConfig(**MOE_SHAPE, moe_ffn_hidden_size=192, transformer_impl="local")
    with pytest.raises(TrainingSetupError) as info:
        check_moe_alignment(config, FP8Config())
    assert "transformer_impl" in str(info.value) and "moe_ffn_hidden_size=192" in str(info.value)


# -------------------------------------------------------------------- alignment report


def _hf_fused_moe(
    num_layers: int = 2, experts: int = 4, hidden: int = 256, inter: int = 128
) -> dict[str, torch.Tensor]:
    """transformers-5 Qwen3-MoE names and layouts: router [E, H], gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    gen = torch.Generator().manual_seed(7)
    weights = {"model.embed_tokens.weight": torch.randn(64, hidden, generator=gen).bfloat16()}
    for i in range(num_layers):
        prefix = f"model.layers.{i}."
        weights[prefix + "self_attn.o_proj.weight"] = (torch.randn(hidden, hidden, generator=gen) * 0.02).bfloat16()
        weights[prefix + "mlp.gate.weight"] = (torch.randn(experts, hidden, generator=gen) * 0.02).bfloat16()
        # Gate rows an order of magnitude larger than up rows: separate grids get separate scales.
        gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.02
        gate_up[:, :inter] *= 10
        weights[prefix + "mlp.experts.gate_up_proj"] = gate_up.bfloat16()
        down = torch.randn(experts, hidden, inter, generator=gen) * 0.02
        weights[prefix + "mlp.experts.down_proj"] = down.bfloat16()
    return weights


def _megatron_grouped(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same weights under TEGroupedMLP names: linear_fc1.weight<e> = [gate; up], linear_fc2.weight<e>."""
    weights = {}
    for i in range(2):
        hf_prefix, prefix = f"model.layers.{i}.mlp.", f"decoder.layers.{i}.mlp."
        weights[prefix + "router.weight"] = hf[hf_prefix + "gate.weight"]
        experts = zip(hf[hf_prefix + "experts.gate_up_proj"], hf[hf_prefix + "experts.down_proj"])
        for e, (fc1, fc2) in enumerate(experts):
            weights[prefix + f"experts.linear_fc1.weight{e}"] = fc1
            weights[prefix + f"experts.linear_fc2.weight{e}"] = fc2
    return weights


def _megatron_sequential(grouped: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """TEGroupedMLP names -> SequentialMLP names (`experts.local_experts.<e>.linear_fc<n>.weight`)."""
    renamed = {}
    for name, tensor in grouped.items():
        if ".experts.linear_fc" in name:
            stem, expert = name.rsplit(".weight", 1)
            linear = stem.rsplit(".", 1)[1]
            name = f"{stem.rsplit('.experts.', 1)[0]}.experts.local_experts.{expert}.{linear}.weight"
        renamed[name] = tensor
    return renamed


def test_fused_experts_split_as_the_hf_model_computes_them() -> None:
    """The gate/up split follows transformers 5.19's own Qwen3-MoE expert forward."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, moe_intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_experts=3, num_experts_per_tok=2,
    )  # fmt: skip
    experts = transformers.Qwen3MoeForCausalLM(config).model.layers[0].mlp.experts
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    state = {f"model.layers.0.mlp.experts.{name}": p.detach() for name, p in experts.named_parameters()}
    matrices = {m.name.removeprefix("model.layers.0.mlp.experts."): m for m in decoder_matrices(state, True)[0]}
    x = torch.randn(5, 128)

    assert len(matrices) == 3 * 3
    for e in range(3):
        gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)  # as HF's forward
        assert torch.equal(x @ matrices[f"gate_up_proj[{e}][gate]"].weight.T, gate)
        assert torch.equal(x @ matrices[f"gate_up_proj[{e}][up]"].weight.T, up)
        assert matrices[f"down_proj[{e}]"].weight.shape == (128, 96)  # [H, I]: down maps I -> H
        assert {m.expert for m in matrices.values() if f"[{e}]" in m.name} == {e}


def test_pow2_experts_are_bitwise_aligned_and_routers_stay_bf16() -> None:
    report = alignment_report(_hf_fused_moe(), POW2, training_quantizer="emulation", training_pow2_scales=True)

    routers = [layer for layer in report.layers if layer.name.endswith("mlp.gate.weight")]
    assert len(routers) == 2
    assert all(r.kept_in_bf16 and r.reason == REASON_ROUTER and r.codes_equal is None for r in routers)
    # 2 layers x 4 experts x (gate, up, down), each its own matrix with its own grid.
    assert len(report.experts) == 24 and all(not layer.kept_in_bf16 for layer in report.experts)
    gate = next(layer for layer in report.experts if layer.name == "model.layers.1.mlp.experts.gate_up_proj[3][gate]")
    assert (gate.shape, gate.expert_index, gate.layer_index, gate.num_scales) == ((128, 256), 3, 1, 2)
    assert next(layer for layer in report.experts if layer.name.endswith("down_proj[0]")).shape == (256, 128)
    assert {layer.expert_index for layer in report.experts} == {0, 1, 2, 3}
    assert report.bitwise_aligned and len(report.compared) == 24 + 2  # + o_proj
    assert report.skipped == ("model.embed_tokens.weight",)


@pytest.mark.parametrize("layout", ["hf", "te_grouped", "sequential"])
def test_every_layout_compares_the_same_expert_matrices(layout: str) -> None:
    hf = _hf_fused_moe()
    weights = {"hf": hf, "te_grouped": _megatron_grouped(hf), "sequential": _megatron_sequential(_megatron_grouped(hf))}

    report = alignment_report(weights[layout], FP8Config(), training_quantizer="emulation", training_pow2_scales=False)
    reference = alignment_report(hf, FP8Config(), training_quantizer="emulation", training_pow2_scales=False)

    def by_expert(r: object) -> dict:
        """(layer, expert, projection) -> the agreement, with the projection from the name."""
        table = {}
        for layer in r.experts:
            projection = "gate" if layer.name.endswith("[gate]") else "up" if layer.name.endswith("[up]") else "down"
            table[layer.layer_index, layer.expert_index, projection] = (
                layer.shape, layer.codes_equal, layer.scales_equal, layer.max_scale_rel_diff
            )
        return table

    # FP32 scales: TE and generation round differently, so the numbers are specific to each matrix.
    assert 0.0 < reference.scales_equal < 1.0
    assert by_expert(report) == by_expert(reference)
    assert len(by_expert(report)) == 24
    router = [layer for layer in report.layers if layer.name.endswith(("router.weight", "mlp.gate.weight"))]
    assert [r.reason for r in router] == [REASON_ROUTER] * 2


def test_gate_and_up_are_separate_grids() -> None:
    """Stacked halves quantized as one [2I, H] block column would share scales when I < 128; the
    report gives gate and up their own blocks, as generation does."""
    hf = _hf_fused_moe(num_layers=1, experts=1, inter=64)
    report = alignment_report(hf, POW2, training_quantizer="emulation", training_pow2_scales=True)
    gate, up = (next(layer for layer in report.experts if layer.name.endswith(f"[{half}]")) for half in ("gate", "up"))
    assert gate.shape == up.shape == (64, 256) and gate.num_scales == up.num_scales == 2


def test_mixtral_on_disk_names_and_bf16_layers() -> None:
    gen = torch.Generator().manual_seed(3)
    weights = {
        f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight": torch.randn(shape, generator=gen).bfloat16()
        for i in range(2)
        for e in range(2)
        for w, shape in (("w1", (128, 256)), ("w3", (128, 256)), ("w2", (256, 128)))
    }
    weights |= {f"model.layers.{i}.block_sparse_moe.gate.weight": torch.randn(2, 256).bfloat16() for i in range(2)}
    report = alignment_report(
        weights, POW2.model_copy(update={"num_first_layers_in_bf16": 1}), training_quantizer="emulation",
        training_pow2_scales=True,
    )  # fmt: skip

    reasons = {(layer.layer_index, layer.reason) for layer in report.experts}
    assert reasons == {(0, REASON_CONFIG), (1, REASON_FP8)}
    assert len(report.experts) == 12 and len(report.compared) == 6 and report.bitwise_aligned
    assert {layer.reason for layer in report.layers if ".gate." in layer.name} == {REASON_ROUTER}


def test_an_expert_parallel_shard_needs_the_expert_count() -> None:
    """Two local experts (weight0, weight1) of an 8-expert model: the router [8, H] is recognised
    only with num_experts=8; inferred from the names (2), it would be quantized like a linear."""
    gen = torch.Generator().manual_seed(1)
    weights = {
        "decoder.layers.0.mlp.router.weight": torch.randn(8, 256, generator=gen).bfloat16(),
        **{
            f"decoder.layers.0.mlp.experts.linear_fc{n}.weight{e}": torch.randn(shape, generator=gen).bfloat16()
            for e in range(2)
            for n, shape in ((1, (256, 256)), (2, (256, 128)))
        },
    }

    def router_row(**kwargs: object) -> object:
        report = alignment_report(weights, POW2, training_quantizer="emulation", training_pow2_scales=True, **kwargs)
        return next(layer for layer in report.layers if layer.name.endswith("router.weight"))

    assert not router_row().kept_in_bf16
    assert router_row(num_experts=8).reason == REASON_ROUTER


def test_ungated_megatron_experts_are_not_split() -> None:
    gen = torch.Generator().manual_seed(2)
    weights = {"decoder.layers.0.mlp.experts.linear_fc1.weight0": torch.randn(256, 256, generator=gen).bfloat16()}
    gated = alignment_report(weights, POW2, training_quantizer="emulation", training_pow2_scales=True)
    ungated = alignment_report(
        weights, POW2, gated_linear_unit=False, training_quantizer="emulation", training_pow2_scales=True
    )
    assert [layer.shape for layer in gated.layers] == [(128, 256), (128, 256)]
    assert [layer.shape for layer in ungated.layers] == [(256, 256)]


def test_markdown_shows_experts_and_router_reasons() -> None:
    report = alignment_report(_hf_fused_moe(), POW2, training_quantizer="emulation", training_pow2_scales=True)
    text = report.to_markdown()
    assert "| model.layers.1.mlp.experts.gate_up_proj[2][up] | 128x256 | 2 | 100.0000% |" in text
    assert f"| model.layers.0.mlp.gate.weight | 4x256 |  | BF16 layer, not compared: {REASON_ROUTER} |" in text
    assert "26 weights compared (24 of them routed-expert matrices), 2 kept in BF16" in text
    assert f"BF16 by reason: {REASON_ROUTER}: 2" in text
