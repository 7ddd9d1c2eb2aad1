"""verl adapter: batch keys and ``algorithm.rollout_correction`` in; IS weights, rejection mask, metrics out.

Matched against volcengine/verl ``verl/trainer/ppo/rollout_corr_helper.py`` at commit
0b4e2a814129c07f016787cbce476132ceb6c5cb (``compute_rollout_correction_and_add_to_batch``) and
``docs/algo/rollout_corr.md``. There, with batch tensors [B, T] over response tokens:

- ``batch["old_log_probs"]`` (training engine), ``batch["rollout_log_probs"]`` (vLLM, needs
  ``actor_rollout_ref.rollout.calculate_log_probs: true``) and ``batch["response_mask"]``;
- IS weights (``rollout_is``): "token": ``min(exp(old - rollout), rollout_is_threshold)``;
  "sequence": ``min(exp(sum of old - rollout), rollout_is_threshold)`` broadcast; zero on padding;
  detached; stored as ``batch["rollout_is_weights"]`` and multiplied into ``pg_losses``;
- rejection sampling (``rollout_rs``): "token" / "sequence" (product) / "geometric" (geometric
  mean) ratios outside [rollout_rs_threshold_lower (default 1 / upper), rollout_rs_threshold]
  are removed from ``batch["response_mask"]``, hence from the loss denominator too;
- metrics under "rollout_corr/": "kl" = mean(rollout - old) and "k3_kl" = mean(exp(r) - 1 - r).

Turn it on in the trainer config::

    algorithm:
      rollout_correction:
        rollout_is: token            # token | sequence | null
        rollout_is_threshold: 2.0
        rollout_rs: null             # token | sequence | geometric | null
        rollout_rs_threshold: null
        rollout_rs_threshold_lower: null
    actor_rollout_ref:
      rollout:
        calculate_log_probs: true

Differences from verl: an all-masked batch gives defined results instead of verl's
``ValueError``; log-ratios are not clamped to [-20, 20] before exp (truncation happens in log
space, so nothing overflows; ratios below e^-20 stay exact instead of being raised to e^-20);
sequence-level fractions count non-empty sequences only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from fp8_align.is_correction import (
    importance_weighted_loss,
    masked_importance_weights,
    sequence_masked_importance_weights,
    sequence_truncated_importance_weights,
    truncated_importance_weights,
)
from fp8_align.metrics import as_bool_mask, mismatch_metrics

#: Values of verl's ``rollout_is`` (None disables IS weights).
ROLLOUT_IS_LEVELS = ("token", "sequence")
#: Values of verl's ``rollout_rs`` (None disables rejection sampling).
ROLLOUT_RS_LEVELS = ("token", "sequence", "geometric")
#: verl's ``rollout_is_threshold`` default.
DEFAULT_ROLLOUT_IS_THRESHOLD = 2.0


@dataclass(frozen=True)
class VerlRolloutCorrection:
    """What verl's ``compute_rollout_correction_and_add_to_batch`` writes back.

    rollout_is_weights: [B, T] float32/float64, detached, or None when ``rollout_is`` is null
    (batch key "rollout_is_weights"). response_mask: [B, T], the input's dtype, with rejected
    tokens set to 0 (batch key "response_mask"). metrics: "rollout_corr/..." scalars.
    """

    rollout_is_weights: Tensor | None
    response_mask: Tensor
    metrics: dict[str, float]


def verl_rollout_correction(
    batch: Mapping[str, Tensor], rollout_correction: Mapping[str, Any]
) -> VerlRolloutCorrection:
    """IS weights, rejection-sampled response mask and metrics for one verl batch.

    Args: batch with "old_log_probs", "rollout_log_probs" [B, T] floating (nats) and
    "response_mask" [B, T] bool or {0, 1}. rollout_correction: verl's
    ``algorithm.rollout_correction`` mapping; reads rollout_is, rollout_is_threshold, rollout_rs,
    rollout_rs_threshold, rollout_rs_threshold_lower. Bypass-mode keys need nothing here (verl
    then passes rollout log-probs as old log-probs, giving weight 1).
    Returns: :class:`VerlRolloutCorrection`. Metrics: "rollout_corr/kl", "rollout_corr/k3_kl",
    "rollout_corr/token_mult_prob_error", plus "rollout_corr/rollout_is_ratio_fraction_high"
    (share of tokens or sequences truncated) when IS is on and
    "rollout_corr/rollout_rs_masked_fraction" (share of valid tokens rejected) when RS is on.
    Raises ValueError for unknown levels, a missing rs threshold, the unimplemented
    rollout_token_veto_threshold / rollout_is_batch_normalize, or bad input.
    """
    rollout_is = rollout_correction.get("rollout_is")
    rollout_rs = rollout_correction.get("rollout_rs")
    if rollout_is is not None and rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {ROLLOUT_IS_LEVELS} or None, got {rollout_is!r}")
    if rollout_rs is not None and rollout_rs not in ROLLOUT_RS_LEVELS:
        raise ValueError(f"rollout_rs must be one of {ROLLOUT_RS_LEVELS} or None, got {rollout_rs!r}")
    for unsupported in ("rollout_token_veto_threshold", "rollout_is_batch_normalize"):
        if rollout_correction.get(unsupported):
            raise ValueError(f"{unsupported} is not implemented by this adapter; leave it null/false")
    old_log_probs, rollout_log_probs = batch["old_log_probs"], batch["rollout_log_probs"]
    response_mask = batch["response_mask"]
    summary = mismatch_metrics(old_log_probs, rollout_log_probs, response_mask)
    metrics = {
        "rollout_corr/kl": summary.kl_k1,
        "rollout_corr/k3_kl": summary.kl_k3,
        "rollout_corr/token_mult_prob_error": summary.mult_prob_error,
    }
    weights = None
    if rollout_is is not None:
        threshold = rollout_correction.get("rollout_is_threshold", DEFAULT_ROLLOUT_IS_THRESHOLD)
        importance = (
            truncated_importance_weights(old_log_probs, rollout_log_probs, response_mask, cap=threshold)
            if rollout_is == "token"
            else sequence_truncated_importance_weights(
                old_log_probs, rollout_log_probs, response_mask, cap=threshold, aggregation="sum"
            )
        )
        weights = importance.weights
        metrics["rollout_corr/rollout_is_ratio_fraction_high"] = importance.fraction_clipped
    kept_mask = response_mask
    if rollout_rs is not None:
        rejected = _rejected_tokens(old_log_probs, rollout_log_probs, response_mask, rollout_rs, rollout_correction)
        valid_count = int(as_bool_mask(response_mask).sum())
        metrics["rollout_corr/rollout_rs_masked_fraction"] = int(rejected.sum()) / valid_count if valid_count else 0.0
        kept_mask = response_mask * (~rejected).to(response_mask.dtype)
    return VerlRolloutCorrection(rollout_is_weights=weights, response_mask=kept_mask, metrics=metrics)


def verl_policy_loss(
    pg_losses: Tensor, correction: VerlRolloutCorrection, loss_agg_mode: str = "token-mean"
) -> Tensor:
    """verl's ``pg_losses * rollout_is_weights`` followed by ``agg_loss`` over the corrected response mask.

    Args: pg_losses [B, T], verl's per-token clipped policy loss (with grad); correction from
    :func:`verl_rollout_correction` (weights None means 1); loss_agg_mode: "token-mean" or
    "seq-mean-token-mean" (verl's other modes are not supported).
    Returns: 0-dim loss tensor. Unlike verl, seq-mean-token-mean leaves fully rejected sequences
    out of the mean instead of producing 0/0.
    Raises ValueError on bad input or another loss_agg_mode.
    """
    weights = correction.rollout_is_weights
    if weights is None:
        weights = torch.ones_like(pg_losses)
    return importance_weighted_loss(pg_losses, weights, correction.response_mask, loss_agg_mode)


def _rejected_tokens(
    old_log_probs: Tensor,
    rollout_log_probs: Tensor,
    response_mask: Tensor,
    rollout_rs: str,
    rollout_correction: Mapping[str, Any],
) -> Tensor:
    """[B, T] bool: valid tokens verl's rejection sampling removes at level ``rollout_rs``."""
    upper = rollout_correction.get("rollout_rs_threshold")
    if upper is None or not upper > 0:
        raise ValueError(f"rollout_rs_threshold must be set to a value > 0 when rollout_rs is enabled, got {upper}")
    lower = rollout_correction.get("rollout_rs_threshold_lower")
    lower = 1.0 / upper if lower is None else lower
    if rollout_rs == "token":
        return masked_importance_weights(old_log_probs, rollout_log_probs, response_mask, lo=lower, hi=upper).dropped
    aggregation = "sum" if rollout_rs == "sequence" else "mean"
    return sequence_masked_importance_weights(
        old_log_probs, rollout_log_probs, response_mask, lo=lower, hi=upper, aggregation=aggregation
    ).dropped
