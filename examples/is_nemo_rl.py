"""NeMo RL: mismatch metrics and truncated importance sampling on ClippedPGLossFn-shaped tensors.

Synthetic micro-batch on CPU; runs in a few seconds. In a NeMo RL GRPO run the same correction
is switched on in the config, and ClippedPGLossFn applies it itself:

    loss_fn:
      use_importance_sampling_correction: true
      truncated_importance_sampling_ratio: 2.0
      truncated_importance_sampling_type: tis

Run: python examples/is_nemo_rl.py
"""

from __future__ import annotations

import torch

from fp8_align.adapters.nemo_rl import nemo_rl_actor_loss, nemo_rl_importance_weights, nemo_rl_mismatch_metrics

BATCH, SEQ_LEN, PROMPT_LEN = 4, 16, 5
CLIP_EPS = 0.2
LOSS_CFG = {
    "use_importance_sampling_correction": True,
    "truncated_importance_sampling_ratio": 2.0,
    "truncated_importance_sampling_type": "tis",
}


def synthetic_microbatch(generator: torch.Generator) -> dict[str, torch.Tensor]:
    """A NeMo RL micro-batch: [B, S] log-probs and token_mask over prompt + response, [B] sample_mask."""
    generation_logprobs = -3.0 * torch.rand(BATCH, SEQ_LEN, generator=generator)
    fp8_noise = 0.05 * torch.randn(BATCH, SEQ_LEN, generator=generator)
    prev_logprobs = (generation_logprobs + fp8_noise).clamp(max=0.0)
    response_lengths = torch.tensor([11, 7, 9, 4])
    positions = torch.arange(SEQ_LEN)
    token_mask = (positions >= PROMPT_LEN) & (positions < PROMPT_LEN + response_lengths.unsqueeze(-1))
    advantages = torch.randn(BATCH, 1, generator=generator).expand(BATCH, SEQ_LEN)
    return {
        "prev_logprobs": prev_logprobs,
        "generation_logprobs": generation_logprobs,
        "token_mask": token_mask.float(),
        "sample_mask": torch.tensor([1.0, 1.0, 1.0, 0.0]),
        "advantages": advantages,
    }


def main() -> None:
    data = synthetic_microbatch(torch.Generator().manual_seed(0))
    print("mismatch:", {k: round(v, 5) for k, v in nemo_rl_mismatch_metrics(data).items()})

    importance = nemo_rl_importance_weights(data, LOSS_CFG)
    print(f"IS weights: {importance.num_units} tokens, {importance.fraction_clipped:.1%} truncated at 2.0")

    # What ClippedPGLossFn computes from the logits; here a leaf so the gradient can be inspected.
    curr_logprobs = data["prev_logprobs"][:, 1:].clone().requires_grad_(True)
    advantages = data["advantages"][:, 1:]
    ratios = torch.exp(curr_logprobs - data["prev_logprobs"][:, 1:])
    clip_loss = torch.max(-advantages * ratios, -advantages * ratios.clamp(1 - CLIP_EPS, 1 + CLIP_EPS))
    loss = nemo_rl_actor_loss(clip_loss, importance, data, token_level_loss=True)
    loss.backward()
    print(f"actor loss {loss.item():.5f}, grad norm {curr_logprobs.grad.norm().item():.5f}")

    assert torch.isfinite(loss) and float(importance.weights.max()) <= 2.0
    assert not importance.weights.requires_grad


if __name__ == "__main__":
    main()
