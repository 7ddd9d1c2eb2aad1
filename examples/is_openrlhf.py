"""OpenRLHF: the three vLLM IS corrections of PolicyLoss on synthetic actor-loss inputs.

Synthetic batch on CPU; runs in a few seconds. In an OpenRLHF run the correction is switched on
with the trainer flags, and PolicyLoss applies it itself:

    python -m openrlhf.cli.train_ppo_ray ... \\
        --enable_vllm_is_correction --vllm_is_correction_type tis --vllm_is_truncated_threshold 0.5 5.0

Run: python examples/is_openrlhf.py
"""

from __future__ import annotations

import torch

from fp8_align.adapters.openrlhf import CORRECTION_TYPES, openrlhf_actor_loss, openrlhf_vllm_is_weights
from fp8_align.metrics import mismatch_metrics

BATCH, NUM_ACTIONS = 6, 12
CLIP_EPS = 0.2
THRESHOLD = (0.5, 5.0)


def synthetic_actor_inputs(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """PolicyLoss.forward inputs, [B, T] over action tokens.

    Old and rollout log-probs disagree far more than FP8 would make them, so that some weights
    reach the thresholds.
    """
    rollout_log_probs = -2.0 * torch.rand(BATCH, NUM_ACTIONS, generator=generator)
    old_log_probs = (rollout_log_probs + 0.6 * torch.randn(BATCH, NUM_ACTIONS, generator=generator)).clamp(max=0.0)
    action_lengths = torch.tensor([12, 9, 5, 12, 3, 8]).unsqueeze(-1)
    return {
        "old_log_probs": old_log_probs,
        "rollout_log_probs": rollout_log_probs,
        "action_mask": torch.arange(NUM_ACTIONS) < action_lengths,
        "advantages": torch.randn(BATCH, 1, generator=generator).expand(BATCH, NUM_ACTIONS),
    }


def main() -> None:
    inputs = synthetic_actor_inputs(torch.Generator().manual_seed(0))
    summary = mismatch_metrics(inputs["old_log_probs"], inputs["rollout_log_probs"], inputs["action_mask"])
    print(f"token_mult_prob_error {summary.mult_prob_error:.4f}, vllm_kl (k1) {summary.kl_k1:.5f}")

    for correction_type in CORRECTION_TYPES:
        importance = openrlhf_vllm_is_weights(
            inputs["old_log_probs"], inputs["rollout_log_probs"], inputs["action_mask"], correction_type, THRESHOLD
        )
        log_probs = inputs["old_log_probs"].clone().requires_grad_(True)  # current policy, with grad
        ratio = torch.exp(log_probs - inputs["old_log_probs"])
        advantages = inputs["advantages"]
        per_token_loss = -torch.min(ratio * advantages, ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS) * advantages)
        loss = openrlhf_actor_loss(per_token_loss, importance, inputs["action_mask"], token_level_loss=True)
        loss.backward()
        print(
            f"{correction_type:>13}: loss {loss.item():+.5f}, clipped {importance.fraction_clipped:.1%}, "
            f"dropped {importance.fraction_dropped:.1%} of {importance.num_units} {importance.level}s"
        )
        assert torch.isfinite(loss) and log_probs.grad is not None


if __name__ == "__main__":
    main()
