"""FP8Config: defaults, validation messages, NeMo RL layout, env/JSON/YAML round trips."""

from __future__ import annotations

import dataclasses

import pytest

from fp8_align import CONFIG_ENV_VAR, FP8Config, FP8ConfigError
from fp8_align.rounding import DEFAULT_SCALE_RULE, Rounding


def test_defaults_are_the_aligned_blockwise_recipe():
    cfg = FP8Config()
    assert cfg.precision == "fp8" and cfg.fp8_recipe == "blockwise" and cfg.fp8 == "e4m3"
    assert cfg.weight_block_size == (128, 128) and cfg.activation_group_size == 128
    assert (cfg.num_first_layers_in_bf16, cfg.num_last_layers_in_bf16) == (0, 0)
    assert not cfg.use_weight_pow2_scale and not cfg.use_activation_pow2_scale
    assert cfg.scale_rule == "amax_over_max"


def test_rounding_carries_the_pow2_flags_and_the_scale_rule_as_one_frozen_value():
    cfg = FP8Config(use_weight_pow2_scale=True, allow_recipe_mismatch=True, scale_rule="transformer_engine")
    rounding = cfg.rounding
    assert rounding == Rounding(weight_pow2=True, activation_pow2=False, scale_rule="transformer_engine")
    assert FP8Config().rounding == Rounding() and Rounding().scale_rule == DEFAULT_SCALE_RULE == FP8Config().scale_rule
    assert len({rounding, cfg.rounding, FP8Config().rounding}) == 2  # hashable, equal by value
    with pytest.raises(dataclasses.FrozenInstanceError):
        rounding.activation_pow2 = True  # type: ignore[misc]
    with pytest.raises(ValueError, match="scale_rule must be one of"):
        Rounding(scale_rule="te")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_first_layers_in_bf16": -1}, "num_first_layers_in_bf16 must be >= 0"),
        ({"num_last_layers_in_bf16": -2}, "num_last_layers_in_bf16 must be >= 0"),
        ({"precision": "bf16", "kv_cache_dtype": "fp8"}, "precision='bf16' with an FP8 KV cache"),
        ({"fp8_recipe": "tensorwise"}, "cannot match the generation recipe"),
        ({"fp8": "hybrid"}, "allow_recipe_mismatch"),
        ({"weight_block_size": (64, 64)}, "must be \\(128, 128\\)"),
        ({"activation_group_size": 64}, "activation_group_size must be 128"),
        ({"precision": "int4"}, "precision"),
        ({"use_deepgemm": True}, "unknown field"),
        ({"use_weight_pow2_scale": True}, "rounds weight and activation scales the same way"),
        ({"fp8": None, "fp8_param": True}, "fp8_param=True"),
        ({"scale_rule": "te"}, "scale_rule: Input should be 'amax_over_max' or 'transformer_engine'"),
        ({"bitwise_attention_tiling": "tile128_split", "kv_cache_dtype": "fp8"}, "needs on_policy='bitwise' and kv_cache_dtype='fp8'"),
        ({"bitwise_attention_tiling": "tile128_split", "on_policy": "bitwise"}, "got on_policy='bitwise', kv_cache_dtype='auto'"),
        ({"bitwise_attention_tiling": "tile32"}, "bitwise_attention_tiling: Input should be 'tile64' or 'tile128_split'"),
    ],
)
def test_invalid_configs_raise_actionable_errors(kwargs, message):
    with pytest.raises(FP8ConfigError, match=message):
        FP8Config.from_kwargs(**kwargs)


#: The two settings fp8_align cannot honour: each refused, whichever layout it arrives in, with
#: what to do instead; its default (what fp8_align does) is accepted.
REFUSED_SETTINGS = [
    ("fp8_attention", True, "no FP8-attention switch. Set kv_cache_dtype='fp8' instead"),
    ("recalibrate_scales_every_step", False, "no static scales to keep"),
]


@pytest.mark.parametrize(("name", "value", "message"), REFUSED_SETTINGS, ids=[r[0] for r in REFUSED_SETTINGS])
def test_settings_fp8_align_cannot_honour_are_refused_in_every_layout(tmp_path, name, value, message):
    """Changing the field from its default raises FP8ConfigError naming it, from keyword
    arguments, a NeMo RL dict (policy.generation.vllm_cfg), a NeMo RL or flat YAML file and the
    workers' JSON; the default value loads everywhere."""
    default = FP8Config.model_fields[name].default
    assert value != default and getattr(FP8Config(), name) == default
    assert "Only" in FP8Config.model_fields[name].description
    nemo = _nemo_rl_dict()
    nemo["policy"]["generation"]["vllm_cfg"][name] = value
    (tmp_path / "nemo.yaml").write_text(f"policy:\n  generation:\n    vllm_cfg:\n      {name}: {str(value).lower()}\n")
    (tmp_path / "flat.yaml").write_text(f"{name}: {str(value).lower()}\n")
    loaders = {
        "kwargs": lambda: FP8Config.from_kwargs(**{name: value}),
        "nemo_rl": lambda: FP8Config.from_nemo_rl(nemo),
        "nemo_yaml": lambda: FP8Config.from_yaml(tmp_path / "nemo.yaml"),
        "flat_yaml": lambda: FP8Config.from_yaml(tmp_path / "flat.yaml"),
        "json": lambda: FP8Config.from_json(FP8Config().to_json().replace(f'"{name}":{str(default).lower()}', f'"{name}":{str(value).lower()}')),
    }
    for load in loaders.values():
        with pytest.raises(FP8ConfigError, match=f"{name}: {name}=.*{message}"):
            load()
    nemo["policy"]["generation"]["vllm_cfg"][name] = default
    assert getattr(FP8Config.from_nemo_rl(nemo), name) == default
    assert getattr(FP8Config.from_nemo_rl(FP8Config().to_nemo_rl()), name) == default


def test_recipe_mismatch_accepted_only_when_explicit():
    cfg = FP8Config(fp8_recipe="tensorwise", allow_recipe_mismatch=True)
    assert cfg.fp8_recipe == "tensorwise"


def test_bf16_layer_indices_and_depth_check():
    cfg = FP8Config(num_first_layers_in_bf16=2, num_last_layers_in_bf16=1)
    assert cfg.bf16_layer_indices(6) == frozenset({0, 1, 5})
    assert cfg.bf16_layer_indices(3) == frozenset({0, 1, 2})
    with pytest.raises(FP8ConfigError, match="larger than the model's 2 decoder layers"):
        cfg.bf16_layer_indices(2)


def _nemo_rl_dict() -> dict:
    return {
        "policy": {
            "model_name": "Qwen/Qwen3-8B-Base",
            "generation": {
                "backend": "vllm",
                "vllm_cfg": {
                    "precision": "fp8",
                    "use_deep_gemm": False,
                    "num_first_layers_in_bf16": 1,
                    "num_last_layers_in_bf16": 2,
                    "pow2_weight_scaling_factors": True,
                    "pow2_activation_scaling_factors": True,
                    "kv_cache_dtype": "fp8",
                    "gpu_memory_utilization": 0.6,
                },
            },
            "megatron_cfg": {"enabled": True, "fp8_cfg": {"enabled": True, "fp8": "e4m3", "fp8_recipe": "blockwise", "fp8_param": True}},
        },
        "loss_fn": {"use_importance_sampling_correction": False},
    }


def test_loads_nemo_rl_layout_ignoring_unrelated_keys():
    cfg = FP8Config.from_nemo_rl(_nemo_rl_dict())
    assert cfg.use_deep_gemm is False and cfg.num_first_layers_in_bf16 == 1 and cfg.num_last_layers_in_bf16 == 2
    assert cfg.use_weight_pow2_scale and cfg.use_activation_pow2_scale and cfg.kv_cache_dtype == "fp8"
    assert cfg.fp8_param and cfg.use_importance_sampling_correction is False


def test_nemo_rl_bfloat16_precision_and_disabled_training_fp8():
    data = {"policy": {"generation": {"vllm_cfg": {"precision": "bfloat16"}}, "megatron_cfg": {"fp8_cfg": {"enabled": False, "fp8_recipe": "tensorwise"}}}}
    cfg = FP8Config.from_nemo_rl(data)
    assert cfg.precision == "bf16" and cfg.fp8 is None


def test_nemo_rl_alias_conflict_raises():
    data = _nemo_rl_dict()
    data["policy"]["generation"]["vllm_cfg"]["use_weight_pow2_scale"] = False
    with pytest.raises(FP8ConfigError, match="contradicts"):
        FP8Config.from_nemo_rl(data)


def test_generation_only_config_may_round_weights_only():
    cfg = FP8Config(use_weight_pow2_scale=True, fp8=None)
    assert cfg.use_weight_pow2_scale and not cfg.use_activation_pow2_scale


def test_nemo_rl_round_trip():
    cfg = FP8Config.from_nemo_rl(_nemo_rl_dict())
    assert FP8Config.from_nemo_rl(cfg.to_nemo_rl()) == cfg


def test_scale_rule_is_a_generation_field_in_every_layout(tmp_path):
    """scale_rule travels through kwargs, NeMo RL's vllm_cfg, JSON/env and YAML alike."""
    cfg = FP8Config.from_kwargs(scale_rule="transformer_engine", use_weight_pow2_scale=True, use_activation_pow2_scale=True)
    nemo = cfg.to_nemo_rl()
    assert nemo["policy"]["generation"]["vllm_cfg"]["scale_rule"] == "transformer_engine"
    assert "scale_rule" not in nemo["policy"]["megatron_cfg"]["fp8_cfg"]
    assert FP8Config.from_nemo_rl(nemo) == cfg
    data = _nemo_rl_dict()
    data["policy"]["generation"]["vllm_cfg"]["scale_rule"] = "transformer_engine"
    assert FP8Config.from_nemo_rl(data).scale_rule == "transformer_engine"
    assert FP8Config.from_env(cfg.to_env()) == cfg and FP8Config.from_json(cfg.to_json()).scale_rule == "transformer_engine"
    flat = tmp_path / "flat.yaml"
    flat.write_text("scale_rule: transformer_engine\n")
    assert FP8Config.from_yaml(flat).scale_rule == "transformer_engine"
    assert "multiplier 448/amax" in FP8Config.model_fields["scale_rule"].description


def test_nemo_rl_invalid_values_raise():
    data = _nemo_rl_dict()
    data["policy"]["generation"]["vllm_cfg"]["num_first_layers_in_bf16"] = -3
    with pytest.raises(FP8ConfigError, match="num_first_layers_in_bf16"):
        FP8Config.from_nemo_rl(data)
    with pytest.raises(FP8ConfigError, match="must be a mapping"):
        FP8Config.from_nemo_rl({"policy": ["not", "a", "mapping"]})


def test_env_and_json_round_trip(monkeypatch):
    cfg = FP8Config(num_last_layers_in_bf16=3, use_weight_pow2_scale=True, use_activation_pow2_scale=True)
    env = cfg.to_env()
    assert list(env) == [CONFIG_ENV_VAR]
    assert FP8Config.from_env(env) == cfg
    monkeypatch.setenv(CONFIG_ENV_VAR, env[CONFIG_ENV_VAR])
    assert FP8Config.from_env() == cfg
    monkeypatch.delenv(CONFIG_ENV_VAR)
    assert FP8Config.from_env() == FP8Config()
    with pytest.raises(FP8ConfigError, match="not valid JSON"):
        FP8Config.from_env({CONFIG_ENV_VAR: "{oops"})
    with pytest.raises(FP8ConfigError, match="JSON object"):
        FP8Config.from_env({CONFIG_ENV_VAR: "[1, 2]"})


def test_yaml_flat_and_nemo_rl(tmp_path):
    flat = tmp_path / "flat.yaml"
    flat.write_text("num_first_layers_in_bf16: 2\nuse_activation_pow2_scale: true\nfp8: null\n")
    assert FP8Config.from_yaml(flat) == FP8Config(num_first_layers_in_bf16=2, use_activation_pow2_scale=True, fp8=None)
    nested = tmp_path / "nemo.yaml"
    nested.write_text("policy:\n  generation:\n    vllm_cfg:\n      precision: fp8\n      num_last_layers_in_bf16: 4\n")
    assert FP8Config.from_yaml(nested).num_last_layers_in_bf16 == 4
    bad = tmp_path / "bad.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(FP8ConfigError, match="mapping at the top level"):
        FP8Config.from_yaml(bad)


def test_config_is_frozen():
    cfg = FP8Config()
    with pytest.raises(Exception):
        cfg.precision = "bf16"  # type: ignore[misc]


def test_nemo_rl_engines_on_fp8_align_generate_in_fp8():
    """`policy.generation.vllm_kwargs.quantization: fp8_align` with NeMo RL's own FP8 off
    (`vllm_cfg.precision: bfloat16`): the generation side is fp8_align's FP8 recipe."""
    data = _nemo_rl_dict()
    data["policy"]["generation"]["vllm_cfg"]["precision"] = "bfloat16"
    data["policy"]["generation"]["vllm_kwargs"] = {"quantization": "fp8_align", "kv_cache_dtype": "fp8"}
    cfg = FP8Config.from_nemo_rl(data)
    assert cfg.precision == "fp8" and cfg.num_first_layers_in_bf16 == 1 and cfg.use_weight_pow2_scale
    assert cfg.kv_cache_dtype == "fp8"
    del data["policy"]["generation"]["vllm_kwargs"]["kv_cache_dtype"]  # NeMo RL would stream scales for a BF16 cache
    with pytest.raises(FP8ConfigError, match=r"vllm_cfg\.kv_cache_dtype='fp8' .* set both to fp8 or both to auto"):
        FP8Config.from_nemo_rl(data)


def test_nemo_rl_fp8_precision_with_fp8_align_engines_is_refused():
    """NeMo RL's own FP8 (`vllm_cfg.precision: fp8`) and fp8_align on the same engines: refused,
    naming the setting to turn off for either."""
    data = _nemo_rl_dict()
    data["policy"]["generation"]["vllm_cfg"]["precision"] = "fp8"
    data["policy"]["generation"]["vllm_kwargs"] = {"quantization": "fp8_align"}
    with pytest.raises(FP8ConfigError, match=r"turn one off\. For fp8_align set vllm_cfg\.precision: bfloat16.*remove quantization: fp8_align"):
        FP8Config.from_nemo_rl(data)
