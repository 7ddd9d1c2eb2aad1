"""One arm of the GRPO experiment: rollout with vLLM, score, train, push weights, repeat.

Per step the JSON row holds: mean reward, the mismatch between the engine's log-probs of the
sampled tokens and the trainer's log-probs of the same tokens at the same weights
(`fp8_align.metrics.mismatch_metrics`), the fraction of tokens TIS would truncate (reported in
every arm, applied only in TIS arms), loss statistics, and the time split (rollout, trainer
log-probs, training, weight push, KV-scale push). Validation accuracy (greedy, held-out
problems) is measured every `validate_every` steps and after the last one. The JSON is rewritten
after every step, so a run cut off by a time limit keeps what it measured.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fp8_align.error_bench.scoring import pad_logprobs
from fp8_align.config import FP8Config
from fp8_align.is_correction import truncated_importance_weights
from fp8_align.metrics import mismatch_metrics
from fp8_align.vllm_plugin import calibrate_kv_scales, engine_kv_scales, push_kv_scales

from .arms import Arm, RunSettings
from .engine import check_engine_weights, push_weights, sample, start_engine
from .policy import GRPOPolicy, PackedSequences, group_advantages, pack_sequences
from .task import Problem, exact_match_reward, prompt_token_ids, split_problems, step_batch

#: rows of the step's rollouts the trainer's KV-scale calibration forward runs over
KV_CALIBRATION_SEQUENCES = 64


def calibration_rows(packed: PackedSequences) -> range:
    """The rows of `packed` the K/V-scale calibration forward runs over (its first KV_CALIBRATION_SEQUENCES)."""
    return range(min(KV_CALIBRATION_SEQUENCES, packed.num_sequences))


def trainer_kv_scales(policy: GRPOPolicy, packed: PackedSequences) -> dict[int, dict[str, float]]:
    """The FP8 KV-cache scales the (non-bitwise) trainer's forward measures on the first
    KV_CALIBRATION_SEQUENCES of `packed` ({layer: {k_scale, v_scale, q_scale}}), to push to the engine."""
    return policy.kv_scales(packed, calibration_rows(packed))


def update_kv_scales(llm: Any, policy: GRPOPolicy, packed: PackedSequences) -> None:
    """New FP8 KV-cache scales for the next rollout, from the first KV_CALIBRATION_SEQUENCES of
    `packed`. A bitwise trainer (which scores through the engine's kernels, not the HF modules the
    trainer-side calibrator hooks): the engine measures them (`calibrate_kv_scales`, which pushes)
    and the trainer takes exactly what the engine holds (`engine_kv_scales`). Otherwise the
    trainer's forward measures them and they are pushed to the engine."""
    if policy.bitwise is None:
        push_kv_scales(llm, trainer_kv_scales(policy, packed))
        return
    calibrate_kv_scales(llm, [packed.sequence(row) for row in calibration_rows(packed)], include_q=False)
    policy.bitwise.set_kv_scales(engine_kv_scales(llm))


def validation_accuracy(llm: Any, prompts: list[list[int]], problems: list[Problem], max_tokens: int) -> float:
    """Greedy exact-match accuracy of the engine on held-out problems."""
    rollouts = sample(llm, prompts, 1, max_tokens, 0.0, seed=0)
    return sum(exact_match_reward(r.text, problems[r.prompt_index]) for r in rollouts) / len(problems)


def run_arm(arm: Arm, settings: RunSettings, checkpoint: Path, out_path: Path, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Run `settings.steps` GRPO steps of `arm` (fewer if `settings.max_seconds` runs out); write
    and return the result document."""
    from transformers import AutoTokenizer

    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with functions
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # the trainer initializes CUDA in this process
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # arms share one GPU
    started = time.perf_counter()
    torch.manual_seed(settings.seed)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    train, validation = split_problems(settings.operand_low, settings.operand_high, settings.validation_fraction, settings.seed)
    validation = validation[: settings.validation_size]
    validation_prompts = prompt_token_ids(tokenizer, validation)
    fp8 = settings.fp8_config(arm)
    clock = time.perf_counter()
    llm = start_engine(checkpoint, fp8, settings.seed, settings.llm_kwargs)
    engine_start_s = time.perf_counter() - clock
    policy = GRPOPolicy(
        checkpoint, settings.device, fp8 if arm.training_fp8 else None, settings.lr, settings.grad_clip, settings.max_tokens_per_forward
    )
    num_layers = int(policy.model.config.num_hidden_layers)
    doc: dict[str, Any] = {
        "arm": arm.name, "label": arm.label, "arm_definition": vars(arm), "settings": settings.as_dict(),
        "fp8_config": None if fp8 is None else fp8.model_dump(mode="json"),
        "trainer_fp8_layers": len(policy.fp8_layers), "engine_start_s": engine_start_s,
        "environment": _environment(settings.device), "steps": [], "validation": [], "stopped": None,
    }  # fmt: skip
    if arm.kv_cache_fp8:
        # the first rollout's scales: the trainer's forward over validation prompts + their answers
        answers = [tokenizer.encode(p.answer, add_special_tokens=False) for p in validation]
        packed = pack_sequences(validation_prompts, answers)
        update_kv_scales(llm, policy, packed)
    for step in range(settings.steps):
        if time.perf_counter() - started > settings.max_seconds:
            doc["stopped"] = f"time budget of {settings.max_seconds:.0f} s reached before step {step}"
            break
        if step % settings.validate_every == 0:
            doc["validation"].append({"step": step, "accuracy": validation_accuracy(llm, validation_prompts, validation, settings.max_tokens)})
        row = _train_step(arm, settings, llm, policy, fp8, train, tokenizer, step, num_layers)
        doc["steps"].append(row)
        say(
            f"[{arm.name}] step {step}: reward {row['reward_mean']:.3f} mult_prob_error {row['mismatch']['mult_prob_error']:.4f} "
            f"tis_clip {row['tis_clip_fraction']:.4f} ({row['seconds']['total']:.2f} s)"
        )
        _write(doc, out_path)
    doc["validation"].append(
        {"step": len(doc["steps"]), "accuracy": validation_accuracy(llm, validation_prompts, validation, settings.max_tokens)}
    )
    doc["wall_s"] = time.perf_counter() - started
    _write(doc, out_path)
    say(f"[{arm.name}] validation accuracy: " + ", ".join(f"{v['step']}:{v['accuracy']:.3f}" for v in doc["validation"]))
    return doc


def _train_step(
    arm: Arm, settings: RunSettings, llm: Any, policy: GRPOPolicy, fp8: FP8Config | None, train: list[Problem], tokenizer: Any,
    step: int, num_layers: int,
) -> dict[str, Any]:  # fmt: skip
    seconds: dict[str, float] = {}
    clock = time.perf_counter()
    problems = step_batch(train, settings.prompts_per_step, settings.seed, step)
    prompts = prompt_token_ids(tokenizer, problems)
    rollouts = sample(llm, prompts, settings.group_size, settings.max_tokens, settings.temperature, seed=settings.seed * 10**6 + step * 10**3)
    seconds["rollout"] = time.perf_counter() - clock
    rewards = torch.tensor([exact_match_reward(r.text, problems[r.prompt_index]) for r in rollouts])
    advantages = group_advantages(rewards, settings.group_size)
    packed = pack_sequences([prompts[r.prompt_index] for r in rollouts], [r.token_ids for r in rollouts])
    gen_logprobs, gen_mask = pad_logprobs([r.logprobs for r in rollouts])
    if not torch.equal(gen_mask, packed.mask):
        raise RuntimeError("the engine returned a log-prob count different from its token count")
    clock = time.perf_counter()
    old_logprobs = policy.all_logprobs(packed)
    seconds["trainer_logprobs"] = time.perf_counter() - clock
    gen_logprobs, mask = gen_logprobs.to(old_logprobs.device), packed.mask.to(old_logprobs.device)
    mismatch = mismatch_metrics(old_logprobs, gen_logprobs, mask)
    tis = truncated_importance_weights(old_logprobs, gen_logprobs, mask, cap=settings.tis_cap)
    is_weights = tis.weights if arm.tis else mask.to(torch.float32)
    clock = time.perf_counter()
    stats = policy.update(packed, advantages, old_logprobs, is_weights, settings.clip_eps, settings.minibatches)
    seconds["train"] = time.perf_counter() - clock
    seconds["weight_push"] = push_weights(llm, policy.bf16_weights())
    checked = f"model.layers.{step % num_layers}.mlp.down_proj"
    check_engine_weights(llm, checked, policy.model.get_submodule(checked).weight, fp8)
    if arm.kv_cache_fp8:
        clock = time.perf_counter()
        update_kv_scales(llm, policy, packed)
        seconds["kv_scales"] = time.perf_counter() - clock
    seconds["total"] = sum(seconds.values())
    return {
        "step": step,
        "reward_mean": float(rewards.mean()),
        "groups_with_signal": int((rewards.reshape(-1, settings.group_size).std(dim=1) > 0).sum()),
        "completion_tokens": int(mask.sum()),
        "mismatch": vars(mismatch),
        "tis_clip_fraction": tis.fraction_clipped,
        "tis_applied": arm.tis,
        **stats,
        "sync_checked": checked,
        "seconds": seconds,
    }


def _write(doc: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


def _environment(device: str) -> dict[str, Any]:
    import transformers
    import vllm

    env = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "torch": torch.__version__, "vllm": vllm.__version__,
        "transformers": transformers.__version__, "device": device,
    }  # fmt: skip
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name(0)
    return env
