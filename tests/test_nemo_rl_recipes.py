"""NeMo RL's own FP8 recipes, read unchanged: `defaults:` inheritance as NeMo RL composes it, every
FP8 key mapped to a field or refused by name, and the settings each recipe means.

The recipes are copies from NVIDIA-NeMo/RL (tests/data/nemo_rl_recipes/SOURCE.md). Expected values
are literals read from the YAML; each cites the file and line it comes from ("1B" is
examples/configs/grpo_math_1B.yaml, the parent of the four recipes/llm files).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import pytest

from fp8_align import FP8Config, FP8ConfigError
from fp8_align.nemo_rl_config import load_nemo_rl_yaml
from fp8_align.layer_selection import REASON_IGNORED_NAME, decide_layer
from fp8_align.megatron_ext import TrainingSetupError, fp8_fields, training_env_vars, update_nemo_rl_megatron_cfg

DATA = Path(__file__).parent / "data" / "nemo_rl_recipes"
CONFIGS = DATA / "examples" / "configs"
RECIPES = CONFIGS / "recipes" / "llm"
LLAMA_ROLLOUTS = RECIPES / "grpo-llama3.1-8b-instruct-1n8g-megatron-fp8-rollouts.v3.yaml"
LLAMA_E2E = RECIPES / "grpo-llama3.1-8b-instruct-2n8g-megatron-fp8-e2e.yaml"
MOONLIGHT = RECIPES / "grpo-moonlight-16ba3b-4n8g-megatron-fp8-e2e.yaml"
QWEN3_KV = RECIPES / "grpo-qwen3-8b-base-1n8g-fp8-kvcache-megatron.yaml"
MATH_8B_FP8 = CONFIGS / "grpo_math_8B_megatron_fp8.yaml"

FP32_SCALES = {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "1"}
#: Megatron fields of FP8 blockwise training with no BF16 layers (fp8_fields).
BLOCKWISE_E4M3 = {
    "fp8": "e4m3",
    "fp8_recipe": "blockwise",
    "fp8_param": False,
    "first_last_layers_bf16": False,
    "num_layers_at_start_in_bf16": 0,
    "num_layers_at_end_in_bf16": 0,
}
BF16_TRAINING = {**BLOCKWISE_E4M3, "fp8": None}

GENERATION_FIELDS = (
    "precision",
    "use_deep_gemm",
    "num_first_layers_in_bf16",
    "num_last_layers_in_bf16",
    "use_weight_pow2_scale",
    "use_activation_pow2_scale",
    "kv_cache_dtype",
    "fp8_attention",
    "quantization_ignored_layer_kws",
)

#: recipe -> (generation fields, Megatron fields, TE env vars, use_importance_sampling_correction)
EXPECTED: dict[Path, tuple[dict[str, Any], dict[str, Any], dict[str, str], bool]] = {
    MATH_8B_FP8: (
        {
            "precision": "fp8",  # grpo_math_8B_megatron_fp8.yaml:10
            "use_deep_gemm": True,  # :11
            "num_first_layers_in_bf16": 0,  # 1B:428
            "num_last_layers_in_bf16": 0,  # 1B:427
            "use_weight_pow2_scale": False,  # no pow2_weight_scaling_factors in the chain (NeMo RL default False)
            "use_activation_pow2_scale": False,  # no pow2_activation_scaling_factors in the chain
            "kv_cache_dtype": "auto",  # 1B:414
            "fp8_attention": False,  # no such key
            "quantization_ignored_layer_kws": (),  # no such key
        },
        BLOCKWISE_E4M3,  # fp8_cfg enabled/fp8/fp8_recipe/fp8_param at grpo_math_8B_megatron_fp8.yaml:15-18
        FP32_SCALES,  # :22
        True,  # :5
    ),
    LLAMA_ROLLOUTS: (
        {
            "precision": "fp8",  # grpo-llama3.1-8b-instruct-1n8g-megatron-fp8-rollouts.v3.yaml:34
            "use_deep_gemm": True,  # :36
            "num_first_layers_in_bf16": 0,  # 1B:428
            "num_last_layers_in_bf16": 0,  # 1B:427
            "use_weight_pow2_scale": False,
            "use_activation_pow2_scale": False,
            "kv_cache_dtype": "auto",  # 1B:414
            "fp8_attention": False,
            "quantization_ignored_layer_kws": (),
        },
        BF16_TRAINING,  # megatron_cfg.enabled :20, fp8_cfg.enabled false at 1B:309 (FP8 rollouts only)
        {},  # no FP8 training, no TE variable
        True,  # :6
    ),
    LLAMA_E2E: (
        {
            "precision": "fp8",  # grpo-llama3.1-8b-instruct-2n8g-megatron-fp8-e2e.yaml:40
            "use_deep_gemm": True,  # :43
            "num_first_layers_in_bf16": 0,  # 1B:428
            "num_last_layers_in_bf16": 0,  # 1B:427
            "use_weight_pow2_scale": False,
            "use_activation_pow2_scale": False,
            "kv_cache_dtype": "auto",  # 1B:414
            "fp8_attention": False,
            "quantization_ignored_layer_kws": (),
        },
        BLOCKWISE_E4M3,  # fp8_cfg.enabled :34; fp8/fp8_recipe/fp8_param at 1B:310-312
        FP32_SCALES,  # :36
        True,  # :7
    ),
    MOONLIGHT: (
        {
            "precision": "fp8",  # grpo-moonlight-16ba3b-4n8g-megatron-fp8-e2e.yaml:40
            "use_deep_gemm": True,  # :41
            "num_first_layers_in_bf16": 0,  # 1B:428
            "num_last_layers_in_bf16": 0,  # 1B:427
            "use_weight_pow2_scale": False,
            "use_activation_pow2_scale": False,
            "kv_cache_dtype": "auto",  # 1B:414
            "fp8_attention": False,
            "quantization_ignored_layer_kws": ("a_proj", "b_proj"),  # :43-45
        },
        BLOCKWISE_E4M3,  # fp8_cfg.enabled :30; fp8/fp8_recipe/fp8_param at 1B:310-312
        FP32_SCALES,  # :37
        True,  # :6
    ),
    QWEN3_KV: (
        {
            "precision": "fp8",  # grpo-qwen3-8b-base-1n8g-fp8-kvcache-megatron.yaml:34
            "use_deep_gemm": True,  # :36
            "num_first_layers_in_bf16": 0,  # 1B:428
            "num_last_layers_in_bf16": 0,  # 1B:427
            "use_weight_pow2_scale": False,
            "use_activation_pow2_scale": False,
            "kv_cache_dtype": "fp8",  # :35
            "fp8_attention": False,
            "quantization_ignored_layer_kws": (),
        },
        BF16_TRAINING,  # megatron_cfg.enabled :19, fp8_cfg.enabled false at 1B:309
        {},
        True,  # :8
    ),
}


def test_copies_match_source_md_checksums():
    """Every file SOURCE.md lists is here with the SHA-256 it records, and every file here is listed."""
    row = re.compile(r"^\| `([^`]+)` \|[^|]*\| `([0-9a-f]{64})` \|$", re.MULTILINE)
    table = dict(row.findall((DATA / "SOURCE.md").read_text()))
    assert set(table) == {str(p.relative_to(DATA)) for p in DATA.rglob("*") if p.is_file() and p.name != "SOURCE.md"}
    for name, digest in table.items():
        assert hashlib.sha256((DATA / name).read_bytes()).hexdigest() == digest, f"{name} differs from NeMo RL's copy"


@pytest.mark.parametrize("recipe", list(EXPECTED), ids=[p.stem for p in EXPECTED])
def test_recipe_means_what_its_yaml_says(recipe: Path):
    generation, megatron, env_vars, importance_sampling = EXPECTED[recipe]
    cfg = FP8Config.from_yaml(recipe)
    assert {name: getattr(cfg, name) for name in GENERATION_FIELDS} == generation
    assert fp8_fields(cfg) == megatron
    assert training_env_vars(cfg) == env_vars
    assert cfg.use_importance_sampling_correction is importance_sampling
    assert FP8Config.from_nemo_rl(cfg.to_nemo_rl()) == cfg
    assert FP8Config.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize("recipe", [MATH_8B_FP8, LLAMA_E2E], ids=lambda p: p.stem)
def test_update_nemo_rl_megatron_cfg_reproduces_the_recipes_training_settings(recipe: Path):
    """fp8_align's NeMo RL Megatron settings equal what the FP8-training recipes already set."""
    megatron_cfg = load_nemo_rl_yaml(recipe)["policy"]["megatron_cfg"]
    updated = update_nemo_rl_megatron_cfg(megatron_cfg, FP8Config.from_yaml(recipe))
    for key in ("enabled", "fp8", "fp8_recipe", "fp8_param"):
        assert updated["fp8_cfg"][key] == megatron_cfg["fp8_cfg"][key]
    assert updated["env_vars"] == megatron_cfg["env_vars"] == FP32_SCALES


def test_moonlight_keeps_its_mla_projections_bf16_in_generation_and_training_cannot_follow():
    """quantization_ignored_layer_kws [a_proj, b_proj] (moonlight :43-45) keeps the MLA low-rank
    projections BF16 in generation; megatron-core has no such switch, so the Megatron entry points
    refuse it for FP8 training."""
    cfg = FP8Config.from_yaml(MOONLIGHT)
    attention = "model.layers.3.self_attn."
    for name, fp8 in [("kv_a_proj_with_mqa", False), ("kv_b_proj", False), ("q_proj", True), ("o_proj", True)]:
        decision = decide_layer(attention + name, 27, cfg, output_size=2048, input_size=2048)
        assert decision.fp8 is fp8, decision.describe()
        assert fp8 or (decision.reason == REASON_IGNORED_NAME and decision.planned)
    megatron_cfg = load_nemo_rl_yaml(MOONLIGHT)["policy"]["megatron_cfg"]
    with pytest.raises(TrainingSetupError, match="quantization_ignored_layer_kws=\\['a_proj', 'b_proj'\\]"):
        update_nemo_rl_megatron_cfg(megatron_cfg, cfg)
    relaxed = cfg.model_copy(update={"allow_recipe_mismatch": True})
    assert update_nemo_rl_megatron_cfg(megatron_cfg, relaxed)["fp8_cfg"]["fp8_recipe"] == "blockwise"


def test_ignored_keywords_on_merged_modules_need_every_merged_name():
    cfg = FP8Config(quantization_ignored_layer_kws=("q_proj", "k_proj", "v_proj"))
    qkv = [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    decision = decide_layer("model.layers.0.self_attn.qkv_proj", 2, cfg, merged_from=qkv)
    assert not decision.fp8 and decision.reason == REASON_IGNORED_NAME
    partial = cfg.model_copy(update={"quantization_ignored_layer_kws": ("q_proj",)})
    with pytest.raises(FP8ConfigError, match="matches model.layers.0.self_attn.q_proj but not all"):
        decide_layer("model.layers.0.self_attn.qkv_proj", 2, partial, merged_from=qkv)
    assert decide_layer("model.layers.0.mlp.gate_up_proj", 2, partial, merged_from=["a.gate_proj", "a.up_proj"]).fp8


def _child(tmp_path: Path, parent: Path, body: str) -> Path:
    """A recipe that inherits `parent` (absolute path) and overrides `body`."""
    path = tmp_path / "child.yaml"
    path.write_text(f"defaults: {parent}\n{body}")
    return path


#: (YAML over the Llama FP8-e2e recipe, the NeMo RL key the error must name, what it says)
REFUSED = [
    ("policy:\n  generation:\n    vllm_cfg:\n      is_mx: true\n", "policy.generation.vllm_cfg.is_mx", "MXFP8"),
    ("policy:\n  generation:\n    vllm_cfg:\n      precision: float16\n", "policy.generation.vllm_cfg.precision", "'bf16' or 'fp8'"),
    ("policy:\n  generation:\n    vllm_cfg:\n      kv_cache_dtype: fp8_e5m2\n", "policy.generation.vllm_cfg.kv_cache_dtype", "'auto' or 'fp8'"),
    ("policy:\n  generation:\n    vllm_cfg:\n      fp8_attention: true\n", "policy.generation.vllm_cfg.fp8_attention", "kv_cache_dtype='fp8' instead"),
    ("policy:\n  generation:\n    vllm_cfg:\n      pow2_weight_scaling_factors: true\n", "use_weight_pow2_scale <- policy.generation.vllm_cfg.pow2_weight_scaling_factors", "rounds weight and activation scales the same way"),
    ("policy:\n  generation:\n    vllm_cfg:\n      env_vars:\n        VLLM_USE_DEEP_GEMM_E8M0: '1'\n", "policy.generation.vllm_cfg.env_vars sets VLLM_USE_DEEP_GEMM_E8M0", "remove"),
    ("policy:\n  generation:\n    vllm_kwargs:\n      calculate_kv_scales: true\n", "policy.generation.vllm_kwargs.calculate_kv_scales", "push_kv_scales"),
    ("policy:\n  generation:\n    vllm_kwargs:\n      quantization: fp8\n", "policy.generation.vllm_kwargs.quantization", "'fp8_align'"),
    ("policy:\n  generation:\n    vllm_kwargs:\n      kv_cache_dtype: fp8\n", "policy.generation.vllm_kwargs.kv_cache_dtype", "vllm_cfg.kv_cache_dtype instead"),
    ("policy:\n  megatron_cfg:\n    fp8_cfg:\n      fp8_recipe: mxfp8\n", "policy.megatron_cfg.fp8_cfg.fp8_recipe", "'tensorwise' or 'blockwise'"),
    ("policy:\n  megatron_cfg:\n    fp8_cfg:\n      fp8_recipe: tensorwise\n", "fp8_recipe='tensorwise'", "allow_recipe_mismatch"),
    ("policy:\n  megatron_cfg:\n    fp8_cfg:\n      fp8: hybrid\n", "training fp8='hybrid'", "fp8='e4m3'"),
    ("policy:\n  megatron_cfg:\n    fp8_cfg:\n      fp8_margin: 0\n", "policy.megatron_cfg.fp8_cfg has key(s) fp8_align does not know: fp8_margin", "remove"),
    ("policy:\n  megatron_cfg:\n    env_vars:\n      NVTE_FP8_BLOCK_SCALING_FP32_SCALES: '0'\n", "NVTE_FP8_BLOCK_SCALING_FP32_SCALES is '0'", "Set it to '1'"),
    ("policy:\n  megatron_cfg:\n    env_vars: null\n", "NVTE_FP8_BLOCK_SCALING_FP32_SCALES is unset", "power-of-two"),
    ("policy:\n  megatron_cfg:\n    env_vars:\n      NVTE_FP8_DPA_BWD: '1'\n", "policy.megatron_cfg.env_vars sets NVTE_FP8_DPA_BWD", "remove"),
    ("policy:\n  megatron_cfg:\n    model_overrides:\n      fp8_dot_product_attention: true\n", "model_overrides sets fp8_dot_product_attention", "remove"),
    ("policy:\n  generation:\n    vllm_cfg:\n      num_last_layers_in_bf16: ${mul:1,2}\n", "policy.generation.vllm_cfg.num_last_layers_in_bf16", "write the value"),
    ("policy:\n  generation:\n    vllm_cfg:\n      pow2_weight_scaling_factors: ???\n", "policy.generation.vllm_cfg.pow2_weight_scaling_factors is '???'", "give it a value"),
]


@pytest.mark.parametrize(("body", "key", "says"), REFUSED, ids=[r[1].rsplit(".", 1)[-1] for r in REFUSED])
def test_an_fp8_key_fp8_align_cannot_honour_is_refused_by_name(tmp_path: Path, body: str, key: str, says: str):
    """One key changed over the (loadable) Llama FP8-e2e recipe: the error names it and what to do."""
    with pytest.raises(FP8ConfigError) as info:
        FP8Config.from_yaml(_child(tmp_path, LLAMA_E2E, body))
    assert key in str(info.value) and says in str(info.value), str(info.value)


def test_fp8_keys_of_a_disabled_side_are_not_read(tmp_path: Path):
    """With fp8_cfg disabled (as in the Qwen3 KV recipe) NeMo RL ignores the rest of fp8_cfg and
    the TE variable; so does fp8_align."""
    body = "policy:\n  megatron_cfg:\n    fp8_cfg:\n      fp8_recipe: mxfp8\n      fp8_margin: 0\n    env_vars:\n      NVTE_FP8_BLOCK_SCALING_FP32_SCALES: '0'\n"
    assert FP8Config.from_yaml(_child(tmp_path, QWEN3_KV, body)).fp8 is None


def test_accepted_runtime_and_pow2_settings(tmp_path: Path):
    """force_clear_fp8_caches changes no numerics; both pow2 flags with TE's pow2 setting align. The
    engines run fp8_align, so NeMo RL's own FP8 generation (the recipe's precision fp8) is turned off."""
    body = (
        "policy:\n  generation:\n    vllm_cfg:\n      precision: bfloat16\n      pow2_weight_scaling_factors: true\n      pow2_activation_scaling_factors: true\n"
        "    vllm_kwargs:\n      quantization: fp8_align\n"
        "  megatron_cfg:\n    fp8_cfg:\n      force_clear_fp8_caches: true\n    env_vars:\n      NVTE_FP8_BLOCK_SCALING_FP32_SCALES: '0'\n"
    )
    cfg = FP8Config.from_yaml(_child(tmp_path, LLAMA_E2E, body))
    assert cfg.precision == "fp8" and cfg.use_weight_pow2_scale and cfg.use_activation_pow2_scale
    assert training_env_vars(cfg) == {"NVTE_FP8_BLOCK_SCALING_FP32_SCALES": "0"}


# ----------------------------------------------------------------- NeMo RL's defaults: semantics


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_defaults_chain_merges_parents_in_order_then_the_file(tmp_path: Path):
    _write(
        tmp_path,
        {
            "base/a.yaml": "x: {keep: 1, list: [1, 2], over: a}\ny: from_a\nz: {deep: {v: 1}}\n",
            "base/b.yaml": "defaults: a.yaml\nx: {over: b}\ny: from_b\n",
            "base/c.yaml": "x: {over: c, list: [3]}\nm: {v: 1}\n",
            "sub/child.yaml": "defaults:\n  - ../base/b.yaml\n  - ../base/c.yaml\nz: {deep: {w: 2}}\nm: null\n",
        },
    )
    assert load_nemo_rl_yaml(tmp_path / "sub" / "child.yaml") == {
        "x": {"keep": 1, "list": [3], "over": "c"},  # later parent wins; lists replace
        "y": "from_b",  # b over its own parent a
        "z": {"deep": {"v": 1, "w": 2}},  # mappings merge key by key
        "m": None,  # null replaces a mapping
    }


def test_defaults_override_marker_missing_values_and_absolute_paths(tmp_path: Path):
    _write(
        tmp_path,
        {
            "parent.yaml": "data: {a: 1, b: 2}\npolicy: {x: {a: 1}, keep: 5}\n",
            "child.yaml": f"defaults: {tmp_path / 'parent.yaml'}\ndata: {{_override_: true, c: 3}}\n"
            "policy:\n  x: {_override_: true, b: 2}\n  keep: ???\n",
        },
    )
    assert load_nemo_rl_yaml(tmp_path / "child.yaml") == {
        "data": {"c": 3},  # top-level section marked _override_ replaces
        "policy": {"x": {"a": 1, "_override_": True, "b": 2}, "keep": 5},  # deeper markers are plain keys; ??? keeps
    }


def test_defaults_errors(tmp_path: Path):
    _write(tmp_path, {"a.yaml": "defaults: b.yaml\n", "b.yaml": "defaults: a.yaml\n", "c.yaml": "defaults: nope.yaml\n", "d.yaml": "defaults: {x: 1}\n"})
    with pytest.raises(FP8ConfigError, match="defaults: cycle"):
        load_nemo_rl_yaml(tmp_path / "a.yaml")
    with pytest.raises(FP8ConfigError, match="nope.yaml: no such file \\(named in defaults: of"):
        load_nemo_rl_yaml(tmp_path / "c.yaml")
    with pytest.raises(FP8ConfigError, match="must be a file name or a list"):
        load_nemo_rl_yaml(tmp_path / "d.yaml")


def test_interpolations_in_read_values_resolve_like_omegaconf(tmp_path: Path):
    """grpo_math_1B.yaml's vllm_cfg.precision is ${policy.precision} (1B:413 -> 1B:137 bfloat16);
    relative ${.key} looks in the same section."""
    cfg = FP8Config.from_yaml(CONFIGS / "grpo_math_1B.yaml")
    assert cfg.precision == "bf16" and cfg.fp8 is None
    body = "policy:\n  precision: fp8\n  generation:\n    last: 2\n    vllm_cfg:\n      n: 1\n      num_first_layers_in_bf16: ${.n}\n      num_last_layers_in_bf16: ${..last}\n"
    cfg = FP8Config.from_yaml(_child(tmp_path, CONFIGS / "grpo_math_1B.yaml", body))
    assert (cfg.precision, cfg.num_first_layers_in_bf16, cfg.num_last_layers_in_bf16) == ("fp8", 1, 2)
