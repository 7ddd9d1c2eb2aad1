"""Tests for fp8_align.adapters, against each stack's semantics written out by hand; runs the example scripts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8_align.adapters.nemo_rl import (
    nemo_rl_actor_loss,
    nemo_rl_importance_weights,
    nemo_rl_loss_mask,
    nemo_rl_mismatch_metrics,
)
from fp8_align.adapters.openrlhf import openrlhf_actor_loss, openrlhf_vllm_is_weights
from fp8_align.adapters.verl import verl_policy_loss, verl_rollout_correction

REPO_ROOT = Path(__file__).resolve().parents[1]
NAN = float("nan")


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(values * mask) / sum(mask): the masked mean all three stacks use."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum()
    return (values * mask).sum(dim) / mask.sum(dim)


# --- NeMo RL ---------------------------------------------------------------------------------


def nemo_rl_data() -> dict[str, torch.Tensor]:
    """[B=3, S=5] micro-batch: position 0 is the prompt, row 2 is padding-only, sample 1 is masked out."""
    generator = torch.Generator().manual_seed(1)
    generation = -2.0 * torch.rand(3, 5, generator=generator, dtype=torch.float64)
    prev = generation + 0.4 * torch.randn(3, 5, generator=generator, dtype=torch.float64)
    prev[2, 3] = NAN  # a masked position: must not matter
    return {
        "prev_logprobs": prev,
        "generation_logprobs": generation,
        "token_mask": torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [0, 1, 1, 0, 0]], dtype=torch.float32),
        "sample_mask": torch.tensor([1.0, 0.0, 1.0]),
    }


def nemo_rl_sliced(data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(prev[:, 1:], generation[:, 1:], token_mask[:, 1:] * sample_mask[:, None]) as ClippedPGLossFn builds them."""
    mask = data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)
    return data["prev_logprobs"][:, 1:], data["generation_logprobs"][:, 1:], mask


def test_nemo_rl_loss_mask_slices_and_applies_sample_mask() -> None:
    expected = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    assert torch.equal(nemo_rl_loss_mask(nemo_rl_data()), expected)


def test_nemo_rl_loss_mask_rejects_mismatched_sample_mask() -> None:
    data = nemo_rl_data()
    data["sample_mask"] = torch.ones(4)
    with pytest.raises(ValueError, match="sample_mask"):
        nemo_rl_loss_mask(data)


def test_nemo_rl_mismatch_metrics_match_nemo_formulas() -> None:
    data = nemo_rl_data()
    prev, generation, mask = nemo_rl_sliced(data)
    prev = torch.where(mask.bool(), prev, 0.0)  # NeMo RL would propagate the NaN; we ignore it
    log_ratio = prev - generation
    metrics = nemo_rl_mismatch_metrics(data)
    nemo_mult_prob_error = masked_mean(torch.exp((generation - prev).abs()), mask)
    assert metrics["token_mult_prob_error"] == pytest.approx(nemo_mult_prob_error.item())
    k3 = torch.exp(log_ratio) - 1 - log_ratio
    assert metrics["gen_kl_error"] == pytest.approx(masked_mean(k3, mask).item())
    k1_metrics = nemo_rl_mismatch_metrics(data, kl_type="k1")
    assert k1_metrics["gen_kl_error"] == pytest.approx(masked_mean(-log_ratio, mask).item())
    assert metrics["num_valid_tokens"] == 6.0


def nemo_rl_reference_weights(data: dict[str, torch.Tensor], cfg: dict) -> torch.Tensor:
    """NeMo RL's actor importance weights, written from its ClippedPGLossFn, at valid tokens."""
    prev, generation, mask = nemo_rl_sliced(data)
    prev = torch.where(mask.bool(), prev, 0.0)
    generation = torch.where(mask.bool(), generation, 0.0)
    if not cfg["use_importance_sampling_correction"]:
        return mask.double()
    ratio, kind = cfg.get("truncated_importance_sampling_ratio"), cfg.get("truncated_importance_sampling_type")
    if cfg.get("sequence_level_importance_ratios"):
        weights = torch.exp(((prev - generation) * mask).sum(-1, keepdim=True)).expand_as(prev)
    else:
        weights = torch.exp(prev - generation)
    if ratio is not None and kind == "tis":
        weights = weights.clamp(max=ratio)
    elif kind == "icepop":
        weights = weights * ((weights >= cfg["truncated_importance_sampling_ratio_min"]) & (weights <= ratio))
    elif kind == "seq-mask-tis":
        geometric_mean = torch.exp(masked_mean(prev - generation, data["token_mask"][:, 1:], dim=-1))
        kept = (geometric_mean >= cfg["truncated_importance_sampling_ratio_min"]) & (geometric_mean <= ratio)
        weights = weights * kept.unsqueeze(-1)
    return weights * mask


NEMO_CONFIGS = {
    "off": {"use_importance_sampling_correction": False},
    "untruncated": {"use_importance_sampling_correction": True},
    "tis": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_ratio": 1.2,
        "truncated_importance_sampling_type": "tis",
    },
    "icepop": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_ratio": 1.3,
        "truncated_importance_sampling_type": "icepop",
        "truncated_importance_sampling_ratio_min": 0.8,
    },
    "seq-mask-tis": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_ratio": 1.1,
        "truncated_importance_sampling_type": "seq-mask-tis",
        "truncated_importance_sampling_ratio_min": 0.9,
    },
    "gspo-tis": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_ratio": 1.5,
        "truncated_importance_sampling_type": "tis",
        "sequence_level_importance_ratios": True,
    },
}


@pytest.mark.parametrize("name", NEMO_CONFIGS)
def test_nemo_rl_importance_weights_match_nemo_formulas(name: str) -> None:
    data = nemo_rl_data()
    weights = nemo_rl_importance_weights(data, NEMO_CONFIGS[name]).weights
    torch.testing.assert_close(weights, nemo_rl_reference_weights(data, NEMO_CONFIGS[name]))


def test_nemo_rl_reference_configs_exercise_the_bounds() -> None:
    data = nemo_rl_data()
    assert nemo_rl_importance_weights(data, NEMO_CONFIGS["tis"]).fraction_clipped > 0
    assert nemo_rl_importance_weights(data, NEMO_CONFIGS["icepop"]).fraction_dropped > 0
    assert nemo_rl_importance_weights(data, NEMO_CONFIGS["seq-mask-tis"]).fraction_dropped > 0


def test_nemo_rl_untruncated_sequence_weight_that_overflows_becomes_zero() -> None:
    data = nemo_rl_data()
    data["prev_logprobs"] = data["prev_logprobs"].float()
    data["generation_logprobs"] = data["generation_logprobs"].float() - 40.0  # 4 tokens x 40 nats > float32 range
    cfg = {"use_importance_sampling_correction": True, "sequence_level_importance_ratios": True}
    weights = nemo_rl_importance_weights(data, cfg).weights
    assert torch.all(weights[0] == 0.0)  # NeMo RL's nan_to_num(posinf=0)
    assert torch.all(torch.isfinite(weights))


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        ({"use_importance_sampling_correction": False, "truncated_importance_sampling_ratio": 2.0}, "needs use_"),
        ({"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": 2.0}, "must be one of"),
        (
            {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_ratio": 2.0,
                "truncated_importance_sampling_type": "clip",
            },
            "must be one of",
        ),
        ({**NEMO_CONFIGS["icepop"], "truncated_importance_sampling_ratio_min": None}, "ratio_min"),
        ({**NEMO_CONFIGS["seq-mask-tis"], "sequence_level_importance_ratios": True}, "not supported"),
        ({**NEMO_CONFIGS["tis"], "truncated_importance_sampling_ratio": 0.0}, "cap must be > 0"),
    ],
)
def test_nemo_rl_bad_config_raises(cfg: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        nemo_rl_importance_weights(nemo_rl_data(), cfg)


@pytest.mark.parametrize("token_level_loss", [True, False])
def test_nemo_rl_actor_loss_matches_nemo_reduction(token_level_loss: bool) -> None:
    data = nemo_rl_data()
    data["token_mask"][2, 1:] = 0  # sample 2 stays in sample_mask but has no valid token
    importance = nemo_rl_importance_weights(data, NEMO_CONFIGS["tis"])
    clip_loss = torch.randn(3, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    _, _, mask = nemo_rl_sliced(data)
    token_mask = data["token_mask"][:, 1:]
    weighted = importance.weights * clip_loss
    if token_level_loss:
        global_valid = mask.sum()
        expected = (weighted * mask).sum() / global_valid
    else:
        global_valid = data["sample_mask"].sum()  # NeMo RL's global_valid_seqs counts sample 2
        per_sequence = torch.nan_to_num(masked_mean(weighted, token_mask, dim=-1))
        expected = (per_sequence * data["sample_mask"]).sum() / global_valid
    loss = nemo_rl_actor_loss(clip_loss, importance, data, token_level_loss, normalizer=global_valid)
    torch.testing.assert_close(loss, expected)


# --- OpenRLHF --------------------------------------------------------------------------------


def openrlhf_inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(old_log_probs, rollout_log_probs, action_mask), [4, 6], with a mismatch large enough to reach the bounds."""
    generator = torch.Generator().manual_seed(3)
    rollout = -3.0 * torch.rand(4, 6, generator=generator)
    old = rollout + 0.8 * torch.randn(4, 6, generator=generator)
    action_mask = torch.arange(6) < torch.tensor([[6], [4], [2], [5]])
    return old, rollout, action_mask


def openrlhf_reference_weights(correction_type: str, low: float, high: float) -> torch.Tensor:
    """OpenRLHF's vllm_is, written from its PolicyLoss.forward, times the action mask."""
    old, rollout, action_mask = openrlhf_inputs()
    log_ratio = old - rollout
    weights = torch.exp(log_ratio)
    if correction_type == "tis":
        weights = weights.clamp(min=low, max=high)
    elif correction_type == "icepop":
        weights = weights * ((weights >= low) & (weights <= high))
    else:
        sequence_ratio = torch.exp(masked_mean(log_ratio, action_mask, dim=-1))
        weights = weights * ((sequence_ratio >= low) & (sequence_ratio <= high)).unsqueeze(-1)
    return weights * action_mask


@pytest.mark.parametrize(
    ("correction_type", "low", "high"), [("tis", 0.5, 5.0), ("icepop", 0.5, 2.0), ("seq-mask-tis", 0.8, 1.25)]
)
def test_openrlhf_weights_match_openrlhf_formulas(correction_type: str, low: float, high: float) -> None:
    old, rollout, action_mask = openrlhf_inputs()
    result = openrlhf_vllm_is_weights(old, rollout, action_mask, correction_type, (low, high))
    torch.testing.assert_close(result.weights, openrlhf_reference_weights(correction_type, low, high))
    assert result.fraction_clipped + result.fraction_dropped > 0  # the case exercises a bound


@pytest.mark.parametrize(
    ("correction_type", "threshold", "message"),
    [
        ("mis", (0.5, 5.0), "correction_type"),
        ("tis", (5.0, 0.5), "floor must be < cap"),
        ("icepop", (2.0, 2.0), "lo must be < hi"),
    ],
)
def test_openrlhf_bad_arguments_raise(correction_type: str, threshold: tuple[float, float], message: str) -> None:
    old, rollout, action_mask = openrlhf_inputs()
    with pytest.raises(ValueError, match=message):
        openrlhf_vllm_is_weights(old, rollout, action_mask, correction_type, threshold)


@pytest.mark.parametrize("token_level_loss", [True, False])
def test_openrlhf_actor_loss_matches_aggregate_loss(token_level_loss: bool) -> None:
    old, rollout, action_mask = openrlhf_inputs()
    action_mask[2] = False  # an empty sequence: OpenRLHF's aggregate_loss leaves it out
    importance = openrlhf_vllm_is_weights(old, rollout, action_mask)
    per_token_loss = torch.randn(4, 6, generator=torch.Generator().manual_seed(4))
    weighted = importance.weights * per_token_loss
    if token_level_loss:
        expected = masked_mean(weighted, action_mask)
    else:
        token_counts = action_mask.sum(-1)
        sequence_loss = (weighted * action_mask).sum(-1) / (token_counts + 1e-8)
        expected = masked_mean(sequence_loss, token_counts > 0)
    torch.testing.assert_close(openrlhf_actor_loss(per_token_loss, importance, action_mask, token_level_loss), expected)


# --- verl ------------------------------------------------------------------------------------


def verl_batch() -> dict[str, torch.Tensor]:
    """old/rollout log-probs [4, 5] and an int64 response_mask.

    Row 0: training favours every token (ratio ~1.8). Row 1: training disfavours them (~0.67).
    Row 3: a small per-token excess (~1.13) that only the product over its 3 tokens (~1.43) makes large.
    """
    generator = torch.Generator().manual_seed(5)
    rollout = -2.0 * torch.rand(4, 5, generator=generator)
    old = rollout + 0.02 * torch.randn(4, 5, generator=generator)
    old[0] += 0.6
    old[1] -= 0.4
    old[3] += 0.12
    return {
        "old_log_probs": old,
        "rollout_log_probs": rollout,
        "response_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
    }


def test_verl_token_is_and_metrics_match_verl_formulas() -> None:
    batch = verl_batch()
    result = verl_rollout_correction(batch, {"rollout_is": "token", "rollout_is_threshold": 1.5})
    log_ratio = batch["old_log_probs"] - batch["rollout_log_probs"]
    expected = torch.exp(log_ratio).clamp(max=1.5) * batch["response_mask"]
    torch.testing.assert_close(result.rollout_is_weights, expected)
    assert torch.equal(result.response_mask, batch["response_mask"])
    mask = batch["response_mask"]
    metrics = result.metrics
    verl_kl = masked_mean(batch["rollout_log_probs"] - batch["old_log_probs"], mask)
    verl_k3_kl = masked_mean(torch.exp(log_ratio) - log_ratio - 1, mask)
    verl_fraction_high = masked_mean((torch.exp(log_ratio) > 1.5).float(), mask)
    assert metrics["rollout_corr/kl"] == pytest.approx(verl_kl.item(), rel=1e-5)
    assert metrics["rollout_corr/k3_kl"] == pytest.approx(verl_k3_kl.item(), rel=1e-5)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(verl_fraction_high.item())
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] > 0


def test_verl_sequence_is_uses_the_product_of_ratios() -> None:
    batch = verl_batch()
    result = verl_rollout_correction(batch, {"rollout_is": "sequence", "rollout_is_threshold": 3.0})
    log_ratio = batch["old_log_probs"] - batch["rollout_log_probs"]
    sequence_weight = torch.exp((log_ratio * batch["response_mask"]).sum(-1, keepdim=True)).clamp(max=3.0)
    torch.testing.assert_close(result.rollout_is_weights, sequence_weight * batch["response_mask"])


@pytest.mark.parametrize("rollout_rs", ["token", "sequence", "geometric"])
def test_verl_rejection_sampling_matches_verl_masks(rollout_rs: str) -> None:
    batch = verl_batch()
    upper = 1.3
    result = verl_rollout_correction(batch, {"rollout_rs": rollout_rs, "rollout_rs_threshold": upper})
    mask = batch["response_mask"]
    log_ratio = batch["old_log_probs"] - batch["rollout_log_probs"]
    if rollout_rs == "token":
        ratio = torch.exp(log_ratio)
    elif rollout_rs == "sequence":
        ratio = torch.exp((log_ratio * mask).sum(-1, keepdim=True))
    else:
        ratio = torch.exp(masked_mean(log_ratio, mask, dim=-1)).unsqueeze(-1)
    kept = (ratio >= 1 / upper) & (ratio <= upper)  # lower threshold defaults to 1 / upper
    assert torch.equal(result.response_mask, mask * kept)
    assert result.response_mask.dtype == mask.dtype
    assert not result.response_mask[0].any()  # rejected by the upper threshold
    assert not result.response_mask[1].any()  # rejected by the default lower threshold 1 / upper
    assert result.response_mask[3].any() == (rollout_rs != "sequence")  # only the product exceeds 1.3
    assert result.rollout_is_weights is None
    rejected_share = ((mask == 1) & ~kept).sum().item() / mask.sum().item()
    assert result.metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected_share)


def test_verl_policy_loss_uses_weights_and_the_rejection_sampled_mask() -> None:
    batch = verl_batch()
    config = {"rollout_is": "token", "rollout_rs": "geometric", "rollout_rs_threshold": 1.3}
    correction = verl_rollout_correction(batch, config)
    pg_losses = torch.randn(4, 5, generator=torch.Generator().manual_seed(6))
    expected = masked_mean(pg_losses * correction.rollout_is_weights, correction.response_mask)
    torch.testing.assert_close(verl_policy_loss(pg_losses, correction), expected)
    no_is = verl_rollout_correction(batch, {"rollout_is": None})
    torch.testing.assert_close(verl_policy_loss(pg_losses, no_is), masked_mean(pg_losses, batch["response_mask"]))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"rollout_is": "geometric"}, "rollout_is must be"),
        ({"rollout_rs": "batch", "rollout_rs_threshold": 2.0}, "rollout_rs must be"),
        ({"rollout_rs": "token"}, "rollout_rs_threshold"),
        ({"rollout_rs": "token", "rollout_rs_threshold": 0.0}, "rollout_rs_threshold"),
        ({"rollout_is": "token", "rollout_token_veto_threshold": 1e-4}, "not implemented"),
        ({"rollout_is": "token", "rollout_is_batch_normalize": True}, "not implemented"),
        ({"rollout_is": "token", "rollout_is_threshold": -1.0}, "cap must be > 0"),
    ],
)
def test_verl_bad_config_raises(config: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        verl_rollout_correction(verl_batch(), config)


def test_verl_policy_loss_rejects_unsupported_agg_mode() -> None:
    correction = verl_rollout_correction(verl_batch(), {"rollout_is": "token"})
    with pytest.raises(ValueError, match="reduction"):
        verl_policy_loss(torch.zeros(4, 5), correction, loss_agg_mode="seq-mean-token-sum")


# --- examples --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("script", "expected_output"),
    [("is_nemo_rl.py", "token_mult_prob_error"), ("is_openrlhf.py", "seq-mask-tis"), ("is_verl.py", "rollout_corr/kl")],
)
def test_example_script_runs(script: str, expected_output: str) -> None:
    python_path = os.pathsep.join(filter(None, [str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path}
    completed = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    assert expected_output in completed.stdout
