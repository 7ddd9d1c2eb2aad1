"""fp8_align.megatron_ext: the megatron-core shim, the pre-training checks, TE emulation and the
alignment report. Runs on CPU against the real megatron-core; TE-on-GPU checks are marked `gpu`."""

from __future__ import annotations

import dataclasses
import logging
import math
import re

import numpy as np
import pytest
import torch
from megatron.core.fp8_utils import is_first_last_bf16_layer
from megatron.core.package_info import __shortversion__ as MEGATRON_VERSION
from megatron.core.transformer.transformer_config import TransformerConfig

from fp8_align import FP8Config, FP8ConfigError
from fp8_align.megatron_ext import (
    TE_FP32_SCALES_ENV_VAR,
    TrainingEnvironment,
    TrainingSetupError,
    alignment_report,
    apply_to_transformer_config,
    detect_training_environment,
    required_te_pow2_scales,
    te_pow2_scales_from_env,
    te_quantize_activation_1d,
    te_quantize_weight_2d,
    te_scale_from_amax,
    training_env_vars,
    transformer_config_kwargs,
    update_nemo_rl_megatron_cfg,
    validate_training_setup,
)
from fp8_align.quant import E4M3_MAX, quantize_weight_blockwise
from tests.fp8_reference import round_to_e4m3

NUM_LAYERS = 6
MODEL_SHAPE = {"num_layers": NUM_LAYERS, "hidden_size": 64, "num_attention_heads": 4}

CONFIGS = {
    "defaults": FP8Config(),
    "pow2": FP8Config(use_weight_pow2_scale=True, use_activation_pow2_scale=True),
    "bf16_first_last": FP8Config(num_first_layers_in_bf16=1, num_last_layers_in_bf16=2),
    "bf16_first_only": FP8Config(num_first_layers_in_bf16=2),
    "fp8_param": FP8Config(fp8_param=True, num_last_layers_in_bf16=1),
    "bf16_training": FP8Config(fp8=None),
}


# ------------------------------------------------------------------------------------- shim


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_kwargs_build_a_valid_transformer_config_with_the_generation_bf16_layers(name: str) -> None:
    cfg = CONFIGS[name]
    config = TransformerConfig(**MODEL_SHAPE, **transformer_config_kwargs(cfg, num_layers=NUM_LAYERS))

    assert config.fp8 == cfg.fp8
    assert config.fp8_param == cfg.fp8_param
    if cfg.fp8 is not None:
        assert config.fp8_recipe == cfg.fp8_recipe
        # megatron-core's own rule for which layers run without an FP8 context must pick exactly
        # the layers the generation side keeps in BF16.
        megatron_bf16 = {i for i in range(NUM_LAYERS) if is_first_last_bf16_layer(config, i)}
        assert megatron_bf16 == set(cfg.bf16_layer_indices(NUM_LAYERS))


def test_apply_returns_a_new_validated_config_and_leaves_the_input_alone() -> None:
    original = TransformerConfig(**MODEL_SHAPE)
    cfg = CONFIGS["bf16_first_last"]

    updated = apply_to_transformer_config(original, cfg)

    assert updated is not original
    assert (original.fp8, original.first_last_layers_bf16) == (None, False)
    assert (updated.fp8, updated.fp8_recipe, updated.first_last_layers_bf16) == ("e4m3", "blockwise", True)
    assert (updated.num_layers_at_start_in_bf16, updated.num_layers_at_end_in_bf16) == (1, 2)
    assert updated.hidden_size == original.hidden_size


def test_apply_reruns_megatron_validation() -> None:
    # 3 first layers fit the 6-layer model but not one of its 3-layer pipeline stages: only
    # megatron-core's __post_init__ knows that, so seeing its error proves it ran on the copy.
    original = TransformerConfig(**MODEL_SHAPE, pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    with pytest.raises(ValueError, match="pipeline stage"):
        apply_to_transformer_config(original, FP8Config(num_first_layers_in_bf16=4))


def test_bf16_layers_beyond_the_model_are_refused_by_every_entry_point() -> None:
    cfg = FP8Config(num_first_layers_in_bf16=4, num_last_layers_in_bf16=3)
    with pytest.raises(TrainingSetupError, match="decoder layers"):
        transformer_config_kwargs(cfg, num_layers=NUM_LAYERS)
    with pytest.raises(TrainingSetupError, match="decoder layers"):
        apply_to_transformer_config(TransformerConfig(**MODEL_SHAPE), cfg)
    with pytest.raises(TrainingSetupError, match="decoder layers"):
        validate_training_setup(cfg, _hopper(), num_layers=NUM_LAYERS)


def test_missing_megatron_field_names_the_installed_version() -> None:
    @dataclasses.dataclass
    class OldTransformerConfig:
        num_layers: int = 0
        fp8: str | None = None
        fp8_recipe: str = "delayed"
        fp8_param: bool = False

    with pytest.raises(
        TrainingSetupError, match=rf"megatron-core {re.escape(MEGATRON_VERSION)} .*first_last_layers_bf16"
    ):
        transformer_config_kwargs(FP8Config(), config_cls=OldTransformerConfig)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_nemo_rl_megatron_cfg_round_trips(name: str) -> None:
    cfg = CONFIGS[name].model_copy(update={"num_first_layers_in_bf16": 0, "num_last_layers_in_bf16": 0})
    megatron_cfg = {
        "enabled": True,
        "tensor_model_parallel_size": 2,
        "fp8_cfg": {"enabled": False, "fp8": "hybrid", "fp8_recipe": "tensorwise", "fp8_param": True},
        "env_vars": {"NCCL_CUMEM_ENABLE": "1"},
    }

    updated = update_nemo_rl_megatron_cfg(megatron_cfg, cfg)

    assert megatron_cfg["fp8_cfg"]["fp8"] == "hybrid"  # input untouched
    assert updated["tensor_model_parallel_size"] == 2
    assert updated["env_vars"]["NCCL_CUMEM_ENABLE"] == "1"
    # The keys NeMo RL's Megatron setup reads from fp8_cfg.
    fp8_cfg = updated["fp8_cfg"]
    assert fp8_cfg["enabled"] is (cfg.fp8 is not None)
    if cfg.fp8 is not None:
        assert (fp8_cfg["fp8"], fp8_cfg["fp8_recipe"], fp8_cfg["fp8_param"]) == (cfg.fp8, cfg.fp8_recipe, cfg.fp8_param)
        assert updated["env_vars"][TE_FP32_SCALES_ENV_VAR] == ("0" if cfg.use_weight_pow2_scale else "1")
    vllm_cfg = cfg.to_nemo_rl()["policy"]["generation"]["vllm_cfg"]
    master = {"policy": {"generation": {"vllm_cfg": vllm_cfg}, "megatron_cfg": updated}}
    assert FP8Config.from_nemo_rl(master).model_dump(exclude={"use_importance_sampling_correction"}) == cfg.model_dump(
        exclude={"use_importance_sampling_correction"}
    )


def test_nemo_rl_cannot_carry_bf16_layers_unless_the_mismatch_is_accepted() -> None:
    cfg = CONFIGS["bf16_first_last"]
    with pytest.raises(TrainingSetupError, match="apply_to_transformer_config"):
        update_nemo_rl_megatron_cfg({}, cfg)
    accepted = update_nemo_rl_megatron_cfg({}, cfg.model_copy(update={"allow_recipe_mismatch": True}))
    assert accepted["fp8_cfg"]["enabled"] is True


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"use_weight_pow2_scale": True, "use_activation_pow2_scale": True}, {TE_FP32_SCALES_ENV_VAR: "0"}),
        ({}, {TE_FP32_SCALES_ENV_VAR: "1"}),
        ({"fp8": None}, {}),
        ({"fp8_recipe": "tensorwise", "allow_recipe_mismatch": True}, {}),
        # Accepted split rounding: TE follows the weights (what the generation checkpoint carries).
        ({"use_weight_pow2_scale": True, "allow_recipe_mismatch": True}, {TE_FP32_SCALES_ENV_VAR: "0"}),
    ],
)
def test_training_env_vars(kwargs: dict, expected: dict) -> None:
    assert training_env_vars(FP8Config(**kwargs)) == expected


def test_split_weight_and_activation_rounding_cannot_be_expressed() -> None:
    """FP8Config refuses split rounding with FP8 training; an unvalidated config
    (`model_construct`, as a framework might build one) is still refused by the training side."""
    with pytest.raises(ValueError, match="rounds weight and activation scales the same way"):
        FP8Config(use_weight_pow2_scale=True, use_activation_pow2_scale=False)
    cfg = FP8Config.model_construct(**{**FP8Config().model_dump(), "use_weight_pow2_scale": True})
    with pytest.raises(TrainingSetupError, match="one rounding for inputs, weights and"):
        required_te_pow2_scales(cfg)
    with pytest.raises(TrainingSetupError, match="one rounding"):
        training_env_vars(cfg)


# ------------------------------------------------------------------------------- validation


def _hopper(**changes: object) -> TrainingEnvironment:
    """An H100 with CUDA 12.9 and a TE whose blockwise recipe uses FP32 scales (FP8Config's default)."""
    env = TrainingEnvironment(
        cuda_available=True,
        compute_capability=(9, 0),
        cuda_version=(12, 9),
        te_version="2.8.0",
        te_has_block_scaling=True,
        te_pow2_scales=False,
    )
    return dataclasses.replace(env, **changes)


def test_a_matching_hopper_setup_passes() -> None:
    """Each config passes on the machine that matches it and fails on the one that matches the other
    (the TE rounding is really compared, not skipped)."""
    validate_training_setup(FP8Config(), _hopper(), num_layers=NUM_LAYERS)
    validate_training_setup(CONFIGS["pow2"], _hopper(te_pow2_scales=True, cuda_version=(13, 0)))
    with pytest.raises(TrainingSetupError, match="power-of-two scales but generation uses FP32"):
        validate_training_setup(FP8Config(), _hopper(te_pow2_scales=True, cuda_version=(13, 0)))
    with pytest.raises(TrainingSetupError, match="FP32 scales but generation uses power-of-two"):
        validate_training_setup(CONFIGS["pow2"], _hopper())


@pytest.mark.parametrize(
    ("env_changes", "cfg", "message"),
    [
        ({"compute_capability": (10, 0)}, FP8Config(), r"Blackwell.*FP8 generation with BF16 training.*fp8=None"),
        ({"compute_capability": (12, 0)}, FP8Config(), r"Blackwell.*FP8 generation with BF16 training"),
        ({"compute_capability": (8, 0)}, FP8Config(), r"Hopper GPU \(compute capability 9\.x\).*8\.0"),
        ({"cuda_version": (12, 8)}, FP8Config(), r"CUDA >= 12\.9.*12\.8"),
        ({"cuda_available": False, "compute_capability": None}, FP8Config(), "needs a CUDA GPU"),
        ({"te_version": None, "te_has_block_scaling": False, "te_pow2_scales": None}, FP8Config(), "not installed"),
        (
            {"te_version": "2.1.0", "te_has_block_scaling": False, "te_pow2_scales": None},
            FP8Config(),
            r"2\.1\.0 has no Float8BlockScaling",
        ),
        (
            {"te_pow2_scales": True},
            FP8Config(),
            rf"power-of-two scales but generation uses FP32.*{TE_FP32_SCALES_ENV_VAR}=1",
        ),
        ({}, CONFIGS["pow2"], rf"FP32 scales but generation uses power-of-two.*{TE_FP32_SCALES_ENV_VAR}=0"),
        ({}, FP8Config(precision="bf16"), r"generation runs in BF16"),
        ({"compute_capability": (8, 6)}, FP8Config(fp8_recipe="tensorwise", allow_recipe_mismatch=True), r"8\.9"),
    ],
)
def test_each_unsupported_setup_raises_an_actionable_error(env_changes: dict, cfg: FP8Config, message: str) -> None:
    with pytest.raises(TrainingSetupError, match=message) as info:
        validate_training_setup(cfg, _hopper(**env_changes))
    assert isinstance(info.value, FP8ConfigError)


def test_every_problem_is_listed_at_once() -> None:
    env = _hopper(
        compute_capability=(8, 0),
        cuda_version=(12, 4),
        te_version=None,
        te_has_block_scaling=False,
        te_pow2_scales=None,
    )
    with pytest.raises(TrainingSetupError) as info:
        validate_training_setup(FP8Config(), env)
    assert all(part in str(info.value) for part in ("Hopper", "12.9", "not installed"))


def test_fp32_scales_with_the_default_rule_are_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    """FP32 scales: amax/448 is TE's scale to one ulp only; the log names the rule that matches."""
    with caplog.at_level(logging.WARNING, logger="fp8_align"):
        validate_training_setup(FP8Config(), _hopper())
    assert "scale_rule='transformer_engine'" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fp8_align"):
        validate_training_setup(FP8Config(scale_rule="transformer_engine"), _hopper())
        validate_training_setup(CONFIGS["pow2"], _hopper(te_pow2_scales=True))
    assert caplog.text == ""


def test_accepted_mismatch_skips_the_rounding_checks() -> None:
    """The same rounding mismatch that is refused without `allow_recipe_mismatch` passes with it."""
    validate_training_setup(FP8Config(use_weight_pow2_scale=True, allow_recipe_mismatch=True), _hopper(te_pow2_scales=False))
    pow2 = {"use_weight_pow2_scale": True, "use_activation_pow2_scale": True}
    validate_training_setup(FP8Config(**pow2, allow_recipe_mismatch=True), _hopper(te_pow2_scales=False))
    with pytest.raises(TrainingSetupError, match="FP32 scales but generation uses power-of-two"):
        validate_training_setup(FP8Config(**pow2), _hopper(te_pow2_scales=False))


def test_bf16_training_needs_nothing_from_the_machine() -> None:
    """A machine with no GPU and no TE passes for BF16 training and fails for FP8 training."""
    bare = _hopper(cuda_available=False, compute_capability=None, te_version=None, te_has_block_scaling=False, te_pow2_scales=None)
    validate_training_setup(FP8Config(fp8=None), bare)
    with pytest.raises(TrainingSetupError, match="needs a CUDA GPU"):
        validate_training_setup(FP8Config(), bare)


def test_detected_environment_matches_this_process() -> None:
    env = detect_training_environment()
    assert env.cuda_available == torch.cuda.is_available()
    assert (env.te_version is None) == (env.te_pow2_scales is None)
    if not env.cuda_available:
        with pytest.raises(TrainingSetupError, match="needs a CUDA GPU"):
            validate_training_setup(FP8Config())


# ----------------------------------------------------------------------------- TE emulation


def _te_reference_blocks(w: np.ndarray, pow2: bool) -> tuple[np.ndarray, np.ndarray]:
    """TE's 2-D block quantization written from its CUDA source with numpy loops: the multiplier
    448/amax in FP32, floored to a power of two via frexp, then x * multiplier rounded to E4M3."""
    n, k = w.shape
    nb, kb = math.ceil(n / 128), math.ceil(k / 128)
    codes = np.zeros((n, k))
    scale_inv = np.zeros((nb, kb), dtype=np.float32)
    for i in range(nb):
        for j in range(kb):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].astype(np.float32)
            amax = np.float32(np.abs(block).max())
            scale = np.float32(1.0) if amax == 0 else np.float32(np.float32(E4M3_MAX) / amax)
            if pow2:
                _, exponent = math.frexp(float(scale))
                scale = np.float32(2.0 ** (exponent - 1))
            product = np.clip((block * scale).astype(np.float32), -E4M3_MAX, E4M3_MAX)
            codes[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = round_to_e4m3(product)
            scale_inv[i, j] = np.float32(1.0) / scale
    return codes, scale_inv


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("shape", [(256, 384), (200, 130)])
def test_weight_emulation_matches_a_loop_reference(pow2: bool, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(shape, generator=gen) * torch.logspace(-3, 1, shape[1])  # columns span 4 decades
    w[:128, :128] = 0.0  # an all-zero block: multiplier 1

    codes, scale_inv = te_quantize_weight_2d(w, pow2)
    ref_codes, ref_scale_inv = _te_reference_blocks(w.numpy(), pow2)

    np.testing.assert_array_equal(codes.to(torch.float64).numpy(), ref_codes)
    np.testing.assert_array_equal(scale_inv.numpy(), ref_scale_inv)
    assert scale_inv[0, 0].item() == 1.0


def test_activation_emulation_is_the_weight_rule_on_1x128_groups() -> None:
    x = torch.randn(3, 5, 300, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    codes, scale_inv = te_quantize_activation_1d(x, pow2_scale=True)
    assert codes.shape == x.shape and scale_inv.shape == (3, 5, 3)
    for row, (row_codes, row_scales) in enumerate(zip(codes.view(-1, 300), scale_inv.view(-1, 3))):
        ref_codes, ref_scale_inv = _te_reference_blocks(x.view(-1, 300)[row : row + 1].float().numpy(), pow2=True)
        np.testing.assert_array_equal(row_codes.to(torch.float64).numpy(), ref_codes[0])
        np.testing.assert_array_equal(row_scales.numpy(), ref_scale_inv[0])


def test_scale_edge_cases_follow_te() -> None:
    amax = torch.tensor([0.0, float("inf"), float("nan"), 1e-45, 448.0, 3.0])
    fp32 = te_scale_from_amax(amax, pow2_scale=False)
    pow2 = te_scale_from_amax(amax, pow2_scale=True)
    assert fp32[:3].tolist() == [1.0, 1.0, 1.0]  # degenerate amax -> multiplier 1
    assert fp32[3].item() == torch.finfo(torch.float32).max  # 448 / 1e-45 overflows -> value_for_inf
    assert fp32[4].item() == 1.0
    assert fp32[5].item() == np.float32(np.float32(448.0) / np.float32(3.0))
    assert pow2[5].item() == 128.0  # 149.33 rounded DOWN to a power of two
    assert pow2[3].item() == 2.0**127
    assert te_scale_from_amax(torch.tensor([1e-6]), pow2_scale=False, amax_epsilon=1e-3).item() == np.float32(
        448.0 / np.float32(1e-3)
    )


@pytest.mark.parametrize(
    ("environ", "pow2"),
    [
        ({}, True),
        ({TE_FP32_SCALES_ENV_VAR: "0"}, True),
        ({TE_FP32_SCALES_ENV_VAR: "1"}, False),
        ({TE_FP32_SCALES_ENV_VAR: "true"}, True),
    ],
)
def test_env_var_rule_is_tes(environ: dict, pow2: bool) -> None:
    assert te_pow2_scales_from_env(environ) is pow2


# ------------------------------------------------------------------------- alignment report


def _model_weights(dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """HF-named weights of a 4-layer model: square, partial-block and all-zero-block matrices."""
    gen = torch.Generator().manual_seed(5)
    weights: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(100, 256, generator=gen).to(dtype),
        "lm_head.weight": torch.randn(100, 256, generator=gen).to(dtype),
    }
    for i in range(4):
        prefix = f"model.layers.{i}."
        weights[prefix + "self_attn.q_proj.weight"] = (torch.randn(384, 256, generator=gen) * 0.02).to(dtype)
        # K = 208: a partial K block, but a multiple of 16 (layer_selection keeps other K in BF16).
        weights[prefix + "mlp.down_proj.weight"] = (torch.randn(256, 208, generator=gen) * 0.05).to(dtype)
        weights[prefix + "input_layernorm.weight"] = torch.ones(256, dtype=dtype)
    weights["model.layers.2.mlp.down_proj.weight"][:128, :128] = 0
    return weights


def test_pow2_scales_are_bitwise_aligned() -> None:
    cfg = FP8Config(use_weight_pow2_scale=True, use_activation_pow2_scale=True, num_first_layers_in_bf16=1)
    report = alignment_report(_model_weights(), cfg, training_quantizer="emulation", training_pow2_scales=True)

    assert report.training_quantizer.startswith("te_emulation")
    assert {layer.layer_index for layer in report.layers if layer.kept_in_bf16} == {0}
    assert all(layer.codes_equal is None for layer in report.layers if layer.kept_in_bf16)
    assert len(report.compared) == 6
    # 448/amax floored to 2^e and amax/448 raised to 2^-e are reciprocal powers of two: the scales
    # and the products (exact in FP32) are identical, so every code matches.
    assert report.codes_equal == 1.0 and report.scales_equal == 1.0 and report.max_scale_rel_diff == 0.0
    assert report.bitwise_aligned
    assert set(report.skipped) == {"lm_head.weight", "model.embed_tokens.weight"} | {
        f"model.layers.{i}.input_layernorm.weight" for i in range(4)
    }


def test_fp32_scales_agree_to_one_ulp_and_almost_every_code() -> None:
    weights = {
        f"layers.{i}.w": (torch.randn(1024, 1024, generator=torch.Generator().manual_seed(i)) * 0.02).to(torch.bfloat16)
        for i in range(4)
    }
    report = alignment_report(weights, FP8Config(), training_quantizer="emulation", training_pow2_scales=False)

    # TE stores 1 / RN(448 / amax), generation RN(amax / 448): two roundings against one, so part
    # of the block scales differ in the last bit (measured 31-69% of blocks on such weights) ...
    assert 0.0 < report.scales_equal < 1.0
    assert 0.0 < report.max_scale_rel_diff <= 2 * torch.finfo(torch.float32).eps
    for weight in weights.values():
        train_codes, train_scales = te_quantize_weight_2d(weight, pow2_scale=False)
        gen_codes, gen_scales = quantize_weight_blockwise(weight)
        ulps = (train_scales.view(torch.int32) - gen_scales.view(torch.int32)).abs()
        assert ulps.max().item() <= 1
        # ... and x * (448 / amax) vs x / (amax / 448) rarely lands on the other side of an E4M3
        # rounding boundary (mostly in the blocks whose scales differ): then on the next code.
        steps = (train_codes.view(torch.uint8).int() - gen_codes.view(torch.uint8).int()).abs()
        assert steps.max().item() <= 1
    # Measured on bf16 Gaussian 1024x1024 weights: 99.94-100% of codes equal per weight (16
    # seeds); these four seeds give 1081 differing codes out of 4.2M.
    assert 0.999 <= report.codes_equal < 1.0


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scales", "pow2_scales"])
def test_transformer_engine_scale_rule_is_bitwise_aligned(pow2: bool) -> None:
    """With the generation side on TE's rule the report is bitwise aligned for FP32 scales too
    (the weights above: FP32 scales under the default rule differ)."""
    weights = {
        f"layers.{i}.w": (torch.randn(1024, 1024, generator=torch.Generator().manual_seed(i)) * 0.02).to(torch.bfloat16)
        for i in range(2)
    }
    cfg = FP8Config(scale_rule="transformer_engine", use_weight_pow2_scale=pow2, use_activation_pow2_scale=pow2)
    report = alignment_report(weights, cfg, training_quantizer="emulation", training_pow2_scales=pow2)
    assert report.bitwise_aligned and report.max_scale_rel_diff == 0.0
    assert report.generation_scale_rule == "transformer_engine"
    assert "scale rule transformer_engine" in report.to_markdown()


def test_report_exposes_a_rounding_mismatch() -> None:
    cfg = FP8Config(use_weight_pow2_scale=True, use_activation_pow2_scale=True)
    report = alignment_report(_model_weights(), cfg, training_quantizer="emulation", training_pow2_scales=False)
    assert not report.bitwise_aligned
    assert report.scales_equal < 0.1  # a pow2 scale equals amax/448 only for special amax
    assert report.max_scale_rel_diff > 0.01


def test_report_defaults_to_tes_rounding_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TE_FP32_SCALES_ENV_VAR, "1")
    report = alignment_report(_model_weights(), FP8Config(), training_quantizer="emulation")
    assert report.training_pow2_scales is False
    monkeypatch.delenv(TE_FP32_SCALES_ENV_VAR)
    report = alignment_report(_model_weights(), FP8Config(), training_quantizer="emulation")
    assert report.training_pow2_scales is True


def test_markdown_lists_every_weight_and_the_summary() -> None:
    cfg = FP8Config(use_weight_pow2_scale=True, use_activation_pow2_scale=True, num_last_layers_in_bf16=1)
    report = alignment_report(_model_weights(), cfg, training_quantizer="emulation", training_pow2_scales=True)
    text = report.to_markdown()
    for layer in report.layers:
        assert f"| {layer.name} | {layer.shape[0]}x{layer.shape[1]} |" in text
    assert text.count("BF16 layer, not compared") == 2  # layer 3: q_proj and down_proj
    assert "codes equal 100.0000%, scales equal 100.0000%" in text
    assert "te_emulation" in text


def test_report_refuses_configs_without_blockwise_fp8_on_both_sides() -> None:
    for cfg in (
        FP8Config(fp8=None),
        FP8Config(precision="bf16"),
        FP8Config(fp8_recipe="tensorwise", allow_recipe_mismatch=True),
    ):
        with pytest.raises(FP8ConfigError, match="blockwise FP8 on both sides"):
            alignment_report(_model_weights(), cfg, training_quantizer="emulation")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_requested_transformer_engine_must_be_there() -> None:
    with pytest.raises(TrainingSetupError, match="needs TransformerEngine and a CUDA GPU"):
        alignment_report(_model_weights(), FP8Config(), training_quantizer="transformer_engine")


# ---------------------------------------------------------------------------------- GPU + TE


@pytest.mark.gpu
@pytest.mark.parametrize("pow2", [True, False])
def test_te_quantizer_matches_the_emulation_bit_for_bit(pow2: bool) -> None:
    """On a GPU with TransformerEngine: TE's own Float8BlockQuantizer (2-D weight blocks and 1x128
    activation groups) gives the same E4M3 codes as te_emulation, bit for bit, and dequantizes to
    the same values (so the scales agree too), with power-of-two and with FP32 scales."""
    pytest.importorskip("transformer_engine")
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    gen = torch.Generator().manual_seed(0)
    for shape, dim in (((384, 256), 2), ((200, 300), 2), ((64, 384), 1), ((50, 260), 1)):
        x = (torch.randn(shape, generator=gen) * torch.logspace(-3, 1, shape[1])).to(torch.bfloat16).cuda()
        quantizer = Float8BlockQuantizer(
            fp8_dtype=tex.DType.kFloat8E4M3,
            rowwise=True,
            columnwise=False,
            amax_epsilon=0.0,
            force_pow_2_scales=pow2,
            block_scaling_dim=dim,
        )
        with torch.no_grad():
            quantized = quantizer(x)
        emulate = te_quantize_weight_2d if dim == 2 else te_quantize_activation_1d
        codes, scale_inv = emulate(x, pow2)
        assert torch.equal(quantized._rowwise_data.view(torch.uint8), codes.view(torch.uint8))
        group = 128 if dim == 1 else None
        full = scale_inv.repeat_interleave(128, -1)[..., : shape[1]]
        if group is None:
            full = full.repeat_interleave(128, 0)[: shape[0]]
        assert torch.equal(quantized.dequantize(dtype=torch.float32), codes.float() * full)


@pytest.mark.gpu
def test_alignment_report_uses_transformer_engine_when_available() -> None:
    """On a GPU with TransformerEngine, 'auto' picks TE's quantizer, names it in the report, and
    with matching power-of-two scales the training and generation sides agree bit for bit."""
    pytest.importorskip("transformer_engine")
    cfg = FP8Config(use_weight_pow2_scale=True, use_activation_pow2_scale=True)
    report = alignment_report(_model_weights(), cfg, training_pow2_scales=True)
    assert report.training_quantizer.startswith("TransformerEngine")
    assert report.bitwise_aligned


@pytest.mark.gpu
@pytest.mark.parametrize("rule", ["amax_over_max", "transformer_engine"])
def test_fp32_scales_against_real_transformer_engine(rule: str) -> None:
    """With FP32 scales, TE's real quantizer and fp8_align agree bit for bit only under
    scale_rule="transformer_engine"; the default rule differs by one ulp in some scales."""
    pytest.importorskip("transformer_engine")
    cfg = FP8Config(scale_rule=rule)
    report = alignment_report(_model_weights(), cfg, training_quantizer="transformer_engine", training_pow2_scales=False)
    assert report.training_quantizer.startswith("TransformerEngine")
    assert report.bitwise_aligned == (rule == "transformer_engine")
