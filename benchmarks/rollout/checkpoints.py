"""The models the rollout benchmark runs and their BF16 and offline block-FP8 checkpoints."""

from __future__ import annotations

import fcntl
import json
import re
import shutil
import time
from pathlib import Path
from typing import Any, NamedTuple

QWEN3_8B = dict(
    hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False,
)  # fmt: skip
#: Qwen/Qwen3-4B's and Qwen/Qwen3-1.7B's shapes (tied embeddings): the full-depth RL step's models.
QWEN3_4B = dict(QWEN3_8B, hidden_size=2560, intermediate_size=9728, tie_word_embeddings=True)
QWEN3_1_7B = dict(
    QWEN3_8B, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, tie_word_embeddings=True
)  # fmt: skip
#: Qwen/Qwen3-30B-A3B's config.json (all but transformers_version): written as is for vLLM.
QWEN3_30B_A3B = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", attention_bias=False, attention_dropout=0.0,
    bos_token_id=151643, eos_token_id=151645, decoder_sparse_step=1, head_dim=128, hidden_act="silu", hidden_size=2048,
    initializer_range=0.02, intermediate_size=6144, max_position_embeddings=40960, max_window_layers=48, mlp_only_layers=[],
    moe_intermediate_size=768, norm_topk_prob=True, num_attention_heads=32, num_experts=128, num_experts_per_tok=8,
    num_hidden_layers=48, num_key_value_heads=4, output_router_logits=False, rms_norm_eps=1e-06, rope_scaling=None,
    rope_theta=1000000.0, router_aux_loss_coef=0.001, sliding_window=None, tie_word_embeddings=False,
    torch_dtype="bfloat16", use_cache=True, use_sliding_window=False, vocab_size=151936,
)  # fmt: skip

#: The shape- and routing-setting fields of moonshotai/Moonlight-16B-A3B's config.json (DeepSeek-V3
#: architecture: MLA without q LoRA, layer 0 dense, 64 routed experts of 1408 + 2 shared, top-6).
MOONLIGHT_16B_A3B = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=2048, intermediate_size=11264,
    moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, n_shared_experts=2,
    num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1, n_group=1, topk_group=1, topk_method="noaux_tc",
    scoring_func="sigmoid", norm_topk_prob=True, routed_scaling_factor=2.446, hidden_act="silu", attention_bias=False,
    max_position_embeddings=8192, rope_theta=50000.0, rope_scaling=None, rms_norm_eps=1e-5, vocab_size=163840,
    tie_word_embeddings=False, torch_dtype="bfloat16",
)  # fmt: skip


def is_moe(config: dict[str, Any]) -> bool:
    """Whether a config.json describes a mixture of experts (Qwen's `num_experts`, DeepSeek's `n_routed_experts`)."""
    return bool(config.get("num_experts") or config.get("n_routed_experts"))


class ModelShape(NamedTuple):
    """A model the benchmark runs: its Hugging Face config and where vLLM gets the weights."""

    config: dict[str, Any]
    #: "auto": random checkpoints written here; "dummy": config.json only, vLLM's dummy weights
    load_format: str
    init: str
    #: extra `vllm.LLM` arguments for every variant of this model
    llm_kwargs: dict[str, Any] = {}


DEFAULT_MODEL = "qwen3-8b"
MODELS = {
    DEFAULT_MODEL: ModelShape(QWEN3_8B, "auto", "random, bf16, torch.manual_seed(0)"),
    "qwen3-4b": ModelShape(QWEN3_4B, "auto", "random, bf16, torch.manual_seed(0)"),
    "qwen3-1.7b": ModelShape(QWEN3_1_7B, "auto", "random, bf16, torch.manual_seed(0)"),
    "qwen3-30b-a3b": ModelShape(
        QWEN3_30B_A3B, "dummy", "vLLM dummy weights: every parameter uniform(-1e-3, 1e-3) (FP8 ones drawn in fp16, cast)",
        # Every variant runs vLLM's Triton fused MoE: vLLM 0.22's own choice for BF16 experts on
        # Hopper, FlashInfer CUTLASS, JIT-compiles with nvcc (benchmarks/results_log.md, session 8).
        {"moe_backend": "triton"},
    ),
    "moonlight-16b-a3b": ModelShape(
        MOONLIGHT_16B_A3B, "dummy", "vLLM dummy weights: every parameter uniform(-1e-3, 1e-3) (FP8 ones drawn in fp16, cast)",
        {"moe_backend": "triton"},  # as for qwen3-30b-a3b; MLA attention is vLLM's choice
    ),
}
#: quantization_config of vLLM's offline block-FP8 checkpoints.
VLLM_FP8_QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
_FP8_WEIGHT = re.compile(r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")


def ensure_bf16_checkpoint(path: Path, config: dict[str, Any] = QWEN3_8B, device: str = "cuda") -> float | None:
    """Random-init Qwen3 model of `config` (default the Qwen3-8B shape) in bf16 (seed 0), built on
    `device` and saved with save_pretrained.

    Returns the seconds it took, or None when it already existed. Safe when several processes ask
    at once (rollouts on the GPUs of one host): one writes it, under a lock, into a temporary folder
    renamed into place, and the others wait for it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (path / "config.json").exists():
            return None
        import torch
        from transformers import Qwen3Config, Qwen3ForCausalLM

        start = time.perf_counter()
        torch.manual_seed(0)
        torch.set_default_dtype(torch.bfloat16)
        with torch.device(device):
            model = Qwen3ForCausalLM(Qwen3Config(**config, dtype="bfloat16"))
        torch.set_default_dtype(torch.float32)
        partial = path.with_name(f"{path.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        model.save_pretrained(partial, max_shard_size="4GB")
        del model
        torch.cuda.empty_cache()
        shutil.rmtree(path, ignore_errors=True)
        partial.rename(path)
        return time.perf_counter() - start


def ensure_vllm_fp8_checkpoint(bf16_path: Path, fp8_path: Path) -> float | None:
    """vLLM block-FP8 checkpoint from the BF16 one: decoder projections -> e4m3 `weight` +
    FP32 `weight_scale_inv` [ceil(N/128), ceil(K/128)] (fp8_align.quant numerics); the rest
    copied. Returns the seconds it took, or None when it already existed."""
    if (fp8_path / "config.json").exists():
        return None
    import torch
    from safetensors.torch import load_file, save_file

    from fp8_align.quant import quantize_weight_blockwise

    start = time.perf_counter()
    fp8_path.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for shard in sorted(bf16_path.glob("*.safetensors")):
        tensors = {}
        for name, tensor in load_file(shard, device="cuda").items():
            if _FP8_WEIGHT.match(name):
                codes, scale_inv = quantize_weight_blockwise(tensor)
                tensors[name] = codes.cpu()
                tensors[name.removesuffix("weight") + "weight_scale_inv"] = scale_inv.cpu()
            else:
                tensors[name] = tensor.cpu()
        save_file(tensors, fp8_path / shard.name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard.name))
    config = json.loads((bf16_path / "config.json").read_text())
    config["quantization_config"] = VLLM_FP8_QUANTIZATION
    (fp8_path / "config.json").write_text(json.dumps(config, indent=2))
    (fp8_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    for extra in bf16_path.glob("generation_config.json"):
        (fp8_path / extra.name).write_text(extra.read_text())
    torch.cuda.empty_cache()
    return time.perf_counter() - start


def vllm_fp8_quantization_config(config: dict[str, Any]) -> dict[str, Any]:
    """vLLM block-FP8 quantization_config for `config`; an MoE keeps lm_head and its routers BF16
    (`modules_to_not_convert`, as Qwen's FP8 releases do and fp8_align does)."""
    if not is_moe(config):
        return VLLM_FP8_QUANTIZATION
    routers = [f"model.layers.{i}.mlp.gate" for i in range(config["num_hidden_layers"])]
    return {**VLLM_FP8_QUANTIZATION, "modules_to_not_convert": ["lm_head", *routers]}


def write_dummy_checkpoints(config: dict[str, Any], bf16_path: Path, fp8_path: Path) -> None:
    """config.json-only model folders for load_format="dummy": `config` as is, and with vLLM's
    block-FP8 quantization_config."""
    for path, extra in ((bf16_path, {}), (fp8_path, {"quantization_config": vllm_fp8_quantization_config(config)})):
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps({**config, **extra}, indent=2))


def checkpoint_dirs(model: str, models: Path) -> tuple[Path, Path]:
    """The BF16 and the offline-FP8 model folders of `model` under `models`."""
    stem = model.replace("-", "_") + ("_dummy" if MODELS[model].load_format == "dummy" else "_random")
    return models / f"{stem}_bf16", models / f"{stem}_vllm_fp8"


def prepare_checkpoints(model: str, bf16_path: Path, fp8_path: Path) -> dict[str, float | None]:
    """Write `model`'s folders (random checkpoints when missing, or config.json only for dummy
    weights); returns the checkpoint-creation seconds by report field (None: reused)."""
    if MODELS[model].load_format == "dummy":
        write_dummy_checkpoints(MODELS[model].config, bf16_path, fp8_path)
        return {}
    return {
        "create_bf16_checkpoint_s": ensure_bf16_checkpoint(bf16_path),
        "create_vllm_fp8_checkpoint_s": ensure_vllm_fp8_checkpoint(bf16_path, fp8_path),
    }
