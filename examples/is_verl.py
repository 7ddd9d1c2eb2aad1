"""verl: rollout correction (token-level TIS plus geometric rejection sampling) on a synthetic batch.

Synthetic batch on CPU; runs in a few seconds. In a verl run the same correction is switched on
in the trainer config, and verl's trainer applies it itself:

    algorithm:
      rollout_correction:
        rollout_is: token
        rollout_is_threshold: 2.0
        rollout_rs: geometric
        rollout_rs_threshold: 1.05
    actor_rollout_ref:
      rollout:
        calculate_log_probs: true

Run: python examples/is_verl.py
"""

from __future__ import annotations

import torch

from fp8_align.adapters.verl import verl_policy_loss, verl_rollout_correction

BATCH, RESPONSE_LEN = 8, 20
CLIP_EPS = 0.2
ROLLOUT_CORRECTION = {
    "rollout_is": "token",
    "rollout_is_threshold": 2.0,
    "rollout_rs": "geometric",
    "rollout_rs_threshold": 1.05,
}


def synthetic_batch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """verl batch tensors [B, T] over response tokens; two rows get a large mismatch to be rejected."""
    rollout_log_probs = -2.5 * torch.rand(BATCH, RESPONSE_LEN, generator=generator)
    noise = 0.02 * torch.randn(BATCH, RESPONSE_LEN, generator=generator)
    noise[:2] += 0.5  # training assigns these two responses much more probability than vLLM did
    old_log_probs = (rollout_log_probs + noise).clamp(max=0.0)
    lengths = torch.randint(4, RESPONSE_LEN + 1, (BATCH, 1), generator=generator)
    return {
        "old_log_probs": old_log_probs,
        "rollout_log_probs": rollout_log_probs,
        "response_mask": (torch.arange(RESPONSE_LEN) < lengths).long(),
        "advantages": torch.randn(BATCH, 1, generator=generator).expand(BATCH, RESPONSE_LEN),
    }


def main() -> None:
    batch = synthetic_batch(torch.Generator().manual_seed(0))
    correction = verl_rollout_correction(batch, ROLLOUT_CORRECTION)
    for key, value in correction.metrics.items():
        print(f"{key}: {value:.5f}")

    log_prob = batch["old_log_probs"].clone().requires_grad_(True)  # current policy, with grad
    ratio = torch.exp(log_prob - batch["old_log_probs"])
    advantages = batch["advantages"]
    pg_losses = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - CLIP_EPS, 1 + CLIP_EPS))
    loss = verl_policy_loss(pg_losses, correction, loss_agg_mode="token-mean")
    loss.backward()
    print(f"pg_loss {loss.item():+.5f}; rows kept by RS: {correction.response_mask.any(dim=-1).tolist()}")

    assert torch.isfinite(loss)
    assert not correction.response_mask[:2].any(), "the two mismatched responses should be rejected"


if __name__ == "__main__":
    main()
