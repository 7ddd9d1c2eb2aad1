"""What the GPU engine tests (vLLM 0.22 on CUDA) share: the small random Qwen3 checkpoint, its
engine settings, and the readers and checks of its FP8 layers.

Engines start in subprocesses (`fp8_align.error_bench.generate.run_generation`, LLM_KWARGS) or in
this process through conftest.py's `vllm_runner` (IN_PROCESS_LLM_KWARGS). Nothing here imports
vLLM or touches CUDA at import.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from fp8_align.config import FP8Config
from fp8_align.vllm_plugin.inspection import portable_fp8_codes
from fp8_align.vllm_plugin.layer_state import is_fp8_align_layer
from fp8_align.vllm_plugin.refit import refit_weights
from tests.engines import MERGED_SHARDS

#: A Qwen3-shaped model: hidden 1024, 4 layers, head_dim 128 (every shard a multiple of 128).
SMALL = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
    head_dim=128, vocab_size=32768, max_position_embeddings=1024, tie_word_embeddings=False,
)  # fmt: skip
#: max_num_batched_tokens also bounds the DeepGEMM warm-up (M values up to it; each new
#: M tiling is a JIT compile, ~0.8 s cold on the H100 box).
LLM_KWARGS = {"max_model_len": 128, "max_num_seqs": 8, "max_num_batched_tokens": 128}
#: In-process engines (the refit, stack-sync and KV calibration tests) leave the GPU to the test process too.
IN_PROCESS_LLM_KWARGS = {**LLM_KWARGS, "gpu_memory_utilization": 0.3}
#: Tokens the in-process refit and stack-sync engines generate per prompt.
NEW_TOKENS = 16


def save_random_qwen3(path: Path, fields: dict[str, Any], seed: int) -> Path:
    """A random-init BF16 Qwen3 checkpoint with config `fields`, saved with `save_pretrained`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    Qwen3ForCausalLM(Qwen3Config(**fields)).to(torch.bfloat16).save_pretrained(path)
    return path


def refit_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """W1 (seed 0) and W2 (seed 1) of SMALL: what an engine starts from and is synced to."""
    return {name: save_random_qwen3(tmp_path_factory.mktemp(f"refit_{name}"), SMALL, seed) for name, seed in (("w1", 0), ("w2", 1))}


def refit_prompts() -> list[list[int]]:
    """4 random prompts of 20 tokens."""
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, SMALL["vocab_size"], (4, 20), generator=g).tolist()


def expected_codes(model_dir: Path, layer: int, projection: str, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference `quantize_weight_blockwise` of each HF projection, stacked in shard order."""
    from safetensors.torch import load_file

    from fp8_align.quant import quantize_weight_blockwise

    weights = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(file))
    parts = [quantize_weight_blockwise(weights[f"model.layers.{layer}.{hf}.weight"], pow2_scale=pow2) for hf in MERGED_SHARDS[projection]]
    return torch.cat([codes for codes, _ in parts]), torch.cat([scales for _, scales in parts])


def is_pow2(t: torch.Tensor) -> torch.Tensor:
    mantissa, _ = torch.frexp(t)
    return mantissa == 0.5


def vllm_logprobs(result: dict[str, Any]) -> torch.Tensor:
    return torch.tensor([lp for out in result["outputs"] for lp in out["logprobs"]])


@functools.cache
def hf_logprobs(model_dir: str, fp8_fields_json: str | None, completions_key: tuple) -> torch.Tensor:
    """Teacher-forced logprobs of the given completions under HF (BF16, or FP8-emulated), the
    checkpoint's own architecture (Qwen3, DeepSeek-V3 / Moonlight, ...)."""
    import json

    from transformers import AutoModelForCausalLM

    from fp8_align.hf_emulation import apply_fp8_emulation

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    if fp8_fields_json is not None:
        apply_fp8_emulation(model, FP8Config.from_kwargs(**json.loads(fp8_fields_json)))
    values = []
    with torch.no_grad():
        for prompt, completion in completions_key:
            ids = torch.tensor([list(prompt) + list(completion)], device="cuda")
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            values.append(torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion, device="cuda")[:, None])[:, 0])
    del model
    torch.cuda.empty_cache()
    return torch.cat(values).cpu()


def hf_logprobs_of(model_dir: Path, fp8_fields: dict[str, Any] | None, result: dict[str, Any]) -> torch.Tensor:
    """`hf_logprobs` of an engine run's completions (`run_generation` output: prompt and
    generated ids per prompt) under the checkpoint in `model_dir`, BF16 (`fp8_fields` None) or
    FP8-emulated with those FP8Config fields."""
    import json

    completions = tuple((tuple(o["prompt_ids"]), tuple(o["token_ids"])) for o in result["outputs"])
    fields = None if fp8_fields is None else json.dumps(fp8_fields, sort_keys=True)
    return hf_logprobs(str(model_dir), fields, completions)


def mean_logprob_distance(label: str, a: torch.Tensor, b: torch.Tensor) -> float:
    """mean |a - b| of two logprob vectors (printed under `label` with the largest difference)."""
    diff = (a - b).abs()
    print(f"\n{label}: mean |dlogprob| {diff.mean().item():.3e}, max {diff.max().item():.3e}")
    return diff.mean().item()


def cuda_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        weights.update(load_file(file, device="cuda"))
    return weights


def fp8_state(model: torch.nn.Module) -> dict[str, dict[str, Any]]:
    """Worker side: codes (uint8 CPU copies: torch cannot unpickle an FP8 tensor, and a TP worker's
    result crosses a process), scales (CPU copies) and their data pointers per FP8 layer."""
    return {
        name: {
            **portable_fp8_codes(m.weight), "weight_scale_inv": m.weight_scale_inv.detach().cpu(),
            "pointers": [m.weight.data_ptr(), m.weight_scale_inv.data_ptr()],
        }  # fmt: skip
        for name, m in model.named_modules()
        if is_fp8_align_layer(m, "linear")
    }


def assert_codes_equal(state: dict[str, Any], model_dir: Path) -> None:
    """Layers 1.. of `state` (`fp8_state`) hold the reference codes and FP32 scales of `model_dir`."""
    checked = 0
    for layer in range(1, SMALL["num_hidden_layers"]):
        for projection in MERGED_SHARDS:
            entry = state[f"model.layers.{layer}.{projection}"]
            codes, scales = entry["weight"], entry["weight_scale_inv"]
            ref_codes, ref_scales = expected_codes(model_dir, layer, projection, False)
            assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)), (layer, projection)
            assert torch.equal(scales.view(torch.int32), ref_scales.view(torch.int32)), (layer, projection)
            checked += 1
    assert checked == (SMALL["num_hidden_layers"] - 1) * len(MERGED_SHARDS)


def start_from(llm: Any, model_dir: Path) -> dict[str, Any]:
    """Put `model_dir`'s weights into the one-GPU engine `llm` with `refit_weights`, whatever an
    earlier test left there; returns its FP8 state (`fp8_state`), checked to hold their codes."""
    refit_weights(llm, model_dir)
    state = llm.apply_model(fp8_state)[0]
    assert_codes_equal(state, model_dir)
    return state


def assert_same_storage(before: dict[str, Any], after: dict[str, Any]) -> None:
    """Every FP8 layer's codes and scales still live where they did (captured graphs stay valid)."""
    for name, entry in before.items():
        assert after[name]["pointers"] == entry["pointers"], f"{name}: storage moved"
