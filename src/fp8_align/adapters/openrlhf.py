"""OpenRLHF adapter: its ``PolicyLoss`` inputs and vLLM IS flags in, fp8_align IS weights and actor loss out.

Matched against OpenRLHF ``openrlhf/models/loss.py`` (``PolicyLoss``) and
``openrlhf/cli/train_ppo_ray.py`` in the form that has ``--vllm_is_correction_type``
(tis / icepop / seq-mask-tis, after the first TIS version of PR #1098). The copy of
OpenRLHF/OpenRLHF in our code index (commit f5b3f08a05fd6cbd9a5b712ed931bbb72c24f2c4) predates
the correction, so the code was read from a downstream copy of that ``loss.py``; see
docs/importance_sampling.md. There, with tensors [B, T] over action (response) tokens:

- ``PolicyLoss.forward(log_probs, old_log_probs, advantages, action_mask, rollout_log_probs)``:
  ``log_probs`` is the current policy (with grad), ``old_log_probs`` the training engine's
  log-probs of the behaviour policy, ``rollout_log_probs`` vLLM's;
- the vLLM IS weight is ``exp(old_log_probs - rollout_log_probs)``, detached, multiplying the
  per-token PPO loss when ``policy_loss_type == "ppo"``, with
  ``vllm_is_truncated_threshold = [low, high]`` (default [0.5, 5.0]):

  - "tis": ``clamp(weight, low, high)`` (both sides);
  - "icepop": weight inside [low, high], else 0;
  - "seq-mask-tis": weight, for sequences whose geometric-mean weight is inside [low, high],
    else 0;
- the loss is then a token mean over ``action_mask`` (``token_level_loss``) or a mean over
  non-empty sequences of per-sequence token means; OpenRLHF's ``vllm_kl`` is
  mean(rollout_log_probs - old_log_probs) = :attr:`fp8_align.metrics.MismatchMetrics.kl_k1`.

Turn it on with ``python -m openrlhf.cli.train_ppo_ray ... --enable_vllm_is_correction
--vllm_is_correction_type tis --vllm_is_truncated_threshold 0.5 5.0``.
"""

from __future__ import annotations

from torch import Tensor

from fp8_align.is_correction import (
    ImportanceWeights,
    importance_weighted_loss,
    masked_importance_weights,
    sequence_masked_importance_weights,
    truncated_importance_weights,
)

#: Values of OpenRLHF's ``--vllm_is_correction_type``.
CORRECTION_TYPES = ("tis", "icepop", "seq-mask-tis")

#: OpenRLHF's default ``--vllm_is_truncated_threshold`` (low, high).
DEFAULT_TRUNCATED_THRESHOLD = (0.5, 5.0)


def openrlhf_vllm_is_weights(
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    action_mask: Tensor,
    correction_type: str = "tis",
    truncated_threshold: tuple[float, float] = DEFAULT_TRUNCATED_THRESHOLD,
) -> ImportanceWeights:
    """The vLLM IS weights ``PolicyLoss`` multiplies into its per-token loss.

    Args: old_log_probs, rollout_log_probs: [B, T] floating (nats); action_mask: [B, T] bool or
    {0, 1}; correction_type: "tis", "icepop" or "seq-mask-tis"; truncated_threshold: (low, high).
    Returns: :class:`ImportanceWeights` [B, T] (0 at masked positions, which OpenRLHF leaves
    unmasked in the weight but masks in the reduction: same loss).
    Raises ValueError for an unknown type, low < 0, low >= high, or bad input.
    """
    low, high = truncated_threshold
    if correction_type == "tis":
        return truncated_importance_weights(old_log_probs, rollout_log_probs, action_mask, cap=high, floor=low)
    if correction_type == "icepop":
        return masked_importance_weights(old_log_probs, rollout_log_probs, action_mask, lo=low, hi=high)
    if correction_type == "seq-mask-tis":
        return sequence_masked_importance_weights(old_log_probs, rollout_log_probs, action_mask, lo=low, hi=high)
    raise ValueError(f"correction_type must be one of {CORRECTION_TYPES}, got {correction_type!r}")


def openrlhf_actor_loss(
    per_token_loss: Tensor,
    importance: ImportanceWeights,
    action_mask: Tensor,
    token_level_loss: bool = True,
    *,
    normalizer: float | Tensor | None = None,
) -> Tensor:
    """``PolicyLoss``'s reduction of ``vllm_is * loss``.

    Args: per_token_loss [B, T], OpenRLHF's PPO loss ``-min(ratio * A, clipped_ratio * A)``
    (with grad); importance from :func:`openrlhf_vllm_is_weights`; action_mask [B, T];
    token_level_loss: OpenRLHF's flag (True: token mean, False: mean of per-sequence token means
    over non-empty sequences). normalizer: OpenRLHF's ``batch_num_tokens / dp_size`` (token level)
    or ``global_batch_size / dp_size`` (sequence level); None normalises by this batch alone.
    Returns: 0-dim loss tensor. Raises ValueError on bad input.
    """
    reduction = "token-mean" if token_level_loss else "seq-mean-token-mean"
    return importance_weighted_loss(per_token_loss, importance.weights, action_mask, reduction, normalizer=normalizer)
