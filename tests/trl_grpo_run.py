"""TRL's real GRPOTrainer (colocate mode) on an fp8_align engine, run in a process of its own by
tests/test_trl.py: `python tests/trl_grpo_run.py SPEC.json OUT.json`.

TRL builds its `vllm.LLM` in this process with `distributed_executor_backend="external_launcher"`
(it sets RANK, WORLD_SIZE and MASTER_ADDR/PORT for that), which is why this is not run inside a
pytest worker. SPEC: {"model", "fp8_config" (FP8Config fields), "kv_calibration_prompts",
"steps", "llm_kwargs" (merged over what TRL passes: the CPU engine's KV-cache size and
compilation mode)}. OUT: what the test checks: the engine's FP8 layers and their storage pointers
before training, after it (as the last step's sync left them) and after TRL's own sync of the final
weights (`VLLMGeneration.sync_weights`), the trainer's final BF16 weights, the engine's K/V scales
and the trainer-side scales of the final weights, TRL's logged metrics.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with the tests' worker functions

from fp8_align.config import FP8Config  # noqa: E402
from fp8_align.trl_engine import patch_trl_engine, trainer_kv_scales  # noqa: E402
from fp8_align.vllm_plugin.kv.scales import read_kv_scales  # noqa: E402
from tests.engines import fp8_layers, fp8_storage_pointers  # noqa: E402

#: Prompts of the run (text: TRL tokenizes them with the model's chat template).
PROMPTS = ["Write a haiku about the sea.", "Count to five.", "Name a color.", "Say hi."]


def reward_length(completions: list[Any], **kwargs: Any) -> list[float]:
    """Reward completions of about 20 characters (a reward that needs no model)."""
    return [-abs(20 - len(str(completion))) for completion in completions]


def layer_copies(llm: Any) -> dict[str, dict[str, Any]]:
    """`fp8_layers(llm)`, each tensor copied: TRL's engine runs in this process, where the worker's
    tensors come back as they are, so later syncs would write into an earlier snapshot."""
    return {name: {key: value.clone() if isinstance(value, torch.Tensor) else value for key, value in entry.items()}
            for name, entry in fp8_layers(llm).items()}  # fmt: skip


def main(spec_path: str, out_path: str) -> None:
    import pyarrow as pa
    import trl.generation.vllm_generation as vllm_generation
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    spec = json.loads(Path(spec_path).read_text())
    cfg = FP8Config.from_kwargs(**spec["fp8_config"])
    patch_trl_engine(cfg, spec.get("kv_calibration_prompts"))
    patched = vllm_generation.LLM  # the CPU engine's settings over TRL's (its KV cache is a share of the host otherwise)
    vllm_generation.LLM = lambda **kwargs: patched(**{**kwargs, **spec["llm_kwargs"]})
    # a fingerprint given: datasets 5.2 cannot hash a pyarrow 26 table with dill 0.4 to make one
    dataset = Dataset(pa.table({"prompt": PROMPTS * 2}), fingerprint="fp8_align_trl_prompts")
    # a learning rate that moves BF16 weights by more than their rounding in one step (TRL steps the BF16 model itself)
    args = GRPOConfig(
        output_dir=str(Path(out_path).parent / "grpo"), max_steps=spec["steps"], per_device_train_batch_size=4,
        num_generations=4, gradient_accumulation_steps=1, max_completion_length=8, use_vllm=True, vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.25, vllm_max_model_length=256, model_init_kwargs={"dtype": "bfloat16"}, bf16=True,
        use_cpu=True, logging_steps=1, report_to="none", save_strategy="no", learning_rate=1e-2, seed=0,
    )  # fmt: skip
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=reward_length, args=args, train_dataset=dataset)
    llm = trainer.vllm_generation.llm
    before = {"layers": layer_copies(llm), "pointers": llm.apply_model(fp8_storage_pointers)[0]}
    trainer.train()
    trained_layers = layer_copies(llm)  # as the last step's sync left them (the last update is not synced yet)
    trainer.vllm_generation.sync_weights()  # TRL's own sync of the final weights
    model = trainer.accelerator.unwrap_model(trainer.model)
    trained = {name: param.detach().to(torch.bfloat16).cpu() for name, param in model.named_parameters()}
    out = {
        "before": before, "during": trained_layers, "after": layer_copies(llm), "pointers_after": llm.apply_model(fp8_storage_pointers)[0],
        "trained": trained,
        "engine_kv_scales": read_kv_scales(llm)[0] if cfg.kv_cache_dtype == "fp8" else None,
        "trainer_kv_scales": trainer_kv_scales(model, spec["kv_calibration_prompts"]) if cfg.kv_cache_dtype == "fp8" else None,
        "log_history": trainer.state.log_history,
    }  # fmt: skip
    torch.save(out, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])
