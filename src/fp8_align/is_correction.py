"""Importance-sampling (IS) weights that correct for the training/generation mismatch, and the loss that uses them.

Tokens are sampled by the generation engine (vLLM), but the policy gradient is taken for the
training engine's policy. With the per-token log-ratio ``r = train_logprobs - gen_logprobs``
(see :mod:`fp8_align.metrics`), the IS weight of a token is ``exp(r) = p_train / p_gen``.
Raw weights are unbounded, so every variant here bounds them:

- :func:`truncated_importance_weights` (token level, TIS): ``clamp(exp(r), floor, cap)``;
- :func:`masked_importance_weights` (token level, ICEPOP): ``exp(r)`` if ``lo <= exp(r) <= hi``, else 0;
- :func:`sequence_truncated_importance_weights` (sequence level): ``min(exp(s), cap)`` on every
  valid token of the sequence;
- :func:`sequence_masked_importance_weights` (sequence level, "seq-mask-tis"): ``exp(r)`` if
  ``lo <= exp(s) <= hi``, else 0 for the whole sequence;

where ``s`` is the sequence's aggregated log-ratio: ``mean`` of ``r`` over its valid tokens
(``exp(s)`` = geometric mean of the ratios, the default) or their ``sum`` (``exp(s)`` = product).
Truncation happens in log space (``exp(min(r, log cap))``), so a truncated weight never
overflows; only untruncated weights (``cap=math.inf``, or the token weights of
"seq-mask-tis") can reach inf, and :func:`importance_weighted_loss` rejects those.

All weights are detached (no gradient flows through them), 0 at masked positions, and computed
in float32 (float64 for float64 input). Input conventions (masks, NaN at masked positions,
all-masked batches) are those of :mod:`fp8_align.metrics`. :func:`importance_weighted_loss`
multiplies a per-token policy-gradient loss by the weights and reduces it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from fp8_align.metrics import as_bool_mask, check_finite_where_valid, masked_log_ratio, require_float_matrix

Level = Literal["token", "sequence"]
Aggregation = Literal["mean", "sum"]
Reduction = Literal["token-mean", "seq-mean-token-mean"]

REDUCTIONS: tuple[Reduction, ...] = ("token-mean", "seq-mean-token-mean")
AGGREGATIONS: tuple[Aggregation, ...] = ("mean", "sum")


@dataclass(frozen=True)
class ImportanceWeights:
    """IS weights of a batch and how many of them were bounded.

    weights: [B, T] float32/float64, detached, >= 0, 0 at masked positions.
    level: "token" or "sequence": the unit that ``num_units`` and the fractions count.
    num_units: valid tokens (token level) or sequences with at least one valid token (sequence level).
    fraction_clipped: fraction of units whose ratio was truncated to ``cap`` (or raised to ``floor``).
    fraction_dropped: fraction of units whose ratio fell outside [lo, hi] and got weight 0.
    dropped: [B, T] bool, valid tokens given weight 0 by the [lo, hi] rule (all False when truncating).
    Fractions are 0.0 when num_units is 0.
    """

    weights: Tensor
    level: Level
    num_units: int
    fraction_clipped: float
    fraction_dropped: float
    dropped: Tensor


def truncated_importance_weights(
    train_logprobs: Tensor, gen_logprobs: Tensor, mask: Tensor, cap: float = 2.0, *, floor: float = 0.0
) -> ImportanceWeights:
    """Token-level truncated IS (TIS): ``clamp(exp(r), floor, cap)``, computed as ``exp(clamp(r, log floor, log cap))``.

    Args: train_logprobs, gen_logprobs: [B, T] floating (nats); mask: [B, T] bool or {0, 1}.
    cap: upper bound, > 0; ``math.inf`` disables truncation. floor: lower bound, 0 <= floor < cap;
    the default 0 leaves small ratios alone (OpenRLHF's TIS raises them to its low threshold).
    Returns: :class:`ImportanceWeights` at token level; equal log-probs give weight exactly 1
    (for floor <= 1 <= cap). fraction_clipped counts tokens bounded on either side.
    Raises ValueError for cap <= 0 or NaN, floor outside [0, cap), or bad input.
    """
    _check_range("floor", floor, "cap", cap)
    log_ratio, valid = masked_log_ratio(train_logprobs, gen_logprobs, mask)
    log_floor, log_cap = _log_bound(floor), math.log(cap)
    # The outer clamp only absorbs rounding of exp(log(cap)) to one ulp above cap.
    ratio = torch.exp(log_ratio.clamp(min=log_floor, max=log_cap)).clamp(min=floor, max=cap)
    clipped = valid & ((log_ratio > log_cap) | (log_ratio < log_floor))
    return ImportanceWeights(
        weights=torch.where(valid, ratio, 0.0),
        level="token",
        num_units=int(valid.sum()),
        fraction_clipped=_fraction(clipped, valid),
        fraction_dropped=0.0,
        dropped=torch.zeros_like(valid),
    )


def masked_importance_weights(
    train_logprobs: Tensor, gen_logprobs: Tensor, mask: Tensor, *, lo: float, hi: float
) -> ImportanceWeights:
    """Token-level masked IS (ICEPOP): weight ``exp(r)`` where ``lo <= exp(r) <= hi``, 0 (dropped) elsewhere.

    Args: train_logprobs, gen_logprobs: [B, T] floating (nats); mask: [B, T] bool or {0, 1};
    lo, hi: ratio bounds, 0 <= lo < hi (``hi`` may be ``math.inf``).
    Returns: :class:`ImportanceWeights` at token level; ``dropped`` marks the zeroed tokens and
    ``fraction_dropped`` is their share of valid tokens. Whether dropped tokens still count in
    the loss denominator is the caller's choice: pass ``mask`` (NeMo RL, OpenRLHF) or
    ``mask & ~dropped`` (verl's rejection sampling) to :func:`importance_weighted_loss`.
    Raises ValueError for lo < 0, lo >= hi, NaN bounds, or bad input.
    """
    _check_range("lo", lo, "hi", hi)
    log_ratio, valid = masked_log_ratio(train_logprobs, gen_logprobs, mask)
    kept = valid & (log_ratio >= _log_bound(lo)) & (log_ratio <= math.log(hi))
    dropped = valid & ~kept
    return ImportanceWeights(
        weights=torch.where(kept, torch.exp(log_ratio).clamp(min=lo, max=hi), 0.0),
        level="token",
        num_units=int(valid.sum()),
        fraction_clipped=0.0,
        fraction_dropped=_fraction(dropped, valid),
        dropped=dropped,
    )


def sequence_truncated_importance_weights(
    train_logprobs: Tensor,
    gen_logprobs: Tensor,
    mask: Tensor,
    cap: float = 2.0,
    *,
    aggregation: Aggregation = "mean",
) -> ImportanceWeights:
    """Sequence-level truncated IS: one weight ``min(exp(s), cap)`` per sequence, broadcast to its valid tokens.

    s = mean of r over the sequence's valid tokens (``aggregation="mean"``: exp(s) is the
    geometric mean of the token ratios) or their sum (``"sum"``: exp(s) is the sequence
    likelihood ratio, as verl's ``rollout_is="sequence"`` and NeMo RL's
    ``sequence_level_importance_ratios``).
    Args: train_logprobs, gen_logprobs: [B, T] floating (nats); mask: [B, T] bool or {0, 1};
    cap: > 0, ``math.inf`` disables truncation (then a large summed log-ratio can overflow to inf).
    Returns: :class:`ImportanceWeights` at sequence level: weights constant over each sequence's
    valid tokens; fraction_clipped is the share of non-empty sequences truncated.
    Raises ValueError for cap <= 0 or NaN, an unknown aggregation, or bad input.
    """
    _check_range("floor", 0.0, "cap", cap)
    _check_aggregation(aggregation)
    log_ratio, valid = masked_log_ratio(train_logprobs, gen_logprobs, mask)
    seq_log_ratio, non_empty = _sequence_log_ratio(log_ratio, valid, aggregation)
    log_cap = math.log(cap)
    seq_weight = torch.exp(seq_log_ratio.clamp(max=log_cap)).clamp(max=cap)
    return ImportanceWeights(
        weights=torch.where(valid, seq_weight.unsqueeze(-1), 0.0),
        level="sequence",
        num_units=int(non_empty.sum()),
        fraction_clipped=_fraction(non_empty & (seq_log_ratio > log_cap), non_empty),
        fraction_dropped=0.0,
        dropped=torch.zeros_like(valid),
    )


def sequence_masked_importance_weights(
    train_logprobs: Tensor,
    gen_logprobs: Tensor,
    mask: Tensor,
    *,
    lo: float,
    hi: float,
    aggregation: Aggregation = "mean",
) -> ImportanceWeights:
    """Sequence-level masking, token-level weights ("seq-mask-tis"): drop sequences with ``exp(s)`` outside [lo, hi].

    s as in :func:`sequence_truncated_importance_weights`. Tokens of kept sequences get their own
    untruncated ratio ``exp(r)`` (as NeMo RL and OpenRLHF do; in float32 it is inf for r > ~88.7);
    tokens of dropped sequences get 0.
    Args: train_logprobs, gen_logprobs: [B, T] floating (nats); mask: [B, T] bool or {0, 1};
    lo, hi: bounds on exp(s), 0 <= lo < hi (NeMo RL's reference bounds for the geometric mean
    are 0.999 and 1.002); aggregation: "mean" (geometric mean) or "sum" (product).
    Returns: :class:`ImportanceWeights` at sequence level; ``dropped`` marks the valid tokens of
    dropped sequences and fraction_dropped is the share of non-empty sequences dropped.
    Raises ValueError for lo < 0, lo >= hi, NaN bounds, an unknown aggregation, or bad input.
    """
    _check_range("lo", lo, "hi", hi)
    _check_aggregation(aggregation)
    log_ratio, valid = masked_log_ratio(train_logprobs, gen_logprobs, mask)
    seq_log_ratio, non_empty = _sequence_log_ratio(log_ratio, valid, aggregation)
    seq_kept = (seq_log_ratio >= _log_bound(lo)) & (seq_log_ratio <= math.log(hi))
    kept = valid & seq_kept.unsqueeze(-1)
    return ImportanceWeights(
        weights=torch.where(kept, torch.exp(log_ratio), 0.0),
        level="sequence",
        num_units=int(non_empty.sum()),
        fraction_clipped=0.0,
        fraction_dropped=_fraction(non_empty & ~seq_kept, non_empty),
        dropped=valid & ~kept,
    )


def importance_weighted_loss(
    per_token_loss: Tensor,
    weights: Tensor,
    mask: Tensor,
    reduction: Reduction = "token-mean",
    *,
    normalizer: float | Tensor | None = None,
) -> Tensor:
    """Scalar loss ``reduce(weights * per_token_loss)`` over valid tokens; the weights never carry gradient.

    Reductions, with m the mask and w the (detached) weights:

    - ``"token-mean"``: sum over valid tokens of w*loss, divided by the number of valid tokens;
    - ``"seq-mean-token-mean"``: for each sequence with at least one valid token, the mean of
      w*loss over its valid tokens; then the mean over those sequences (empty sequences are left
      out of both numerator and denominator).

    Args: per_token_loss: [B, T] floating, e.g. the clipped PPO/GRPO surrogate; it carries the
    gradient to the current policy log-probs. weights: [B, T] floating, finite and >= 0 at valid
    tokens (e.g. ``ImportanceWeights.weights``); detached here. mask: [B, T] bool or {0, 1}.
    normalizer: the outer denominator summed over all micro-batches and ranks (total valid tokens
    for token-mean, total non-empty sequences for seq-mean-token-mean) so that micro-batch losses
    add up to the global-batch loss; None uses this batch's own count.
    Returns: 0-dim tensor in the promoted dtype of loss and weights. Masked positions are ignored
    (NaN allowed there). With no valid token and normalizer=None the loss is 0.0, still attached
    to the graph, so backward() gives zero gradients.
    Raises ValueError for bad shapes/dtypes/masks, non-finite loss or weights (or negative
    weights) at valid tokens, an unknown reduction, or normalizer <= 0.
    """
    require_float_matrix("per_token_loss", per_token_loss)
    require_float_matrix("weights", weights)
    if weights.shape != per_token_loss.shape:
        raise ValueError(f"weights shape {tuple(weights.shape)} != per_token_loss shape {tuple(per_token_loss.shape)}")
    if weights.device != per_token_loss.device:
        raise ValueError(f"weights are on {weights.device} but per_token_loss is on {per_token_loss.device}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if normalizer is not None and not float(normalizer) > 0:
        raise ValueError(f"normalizer must be > 0 (a count of tokens or sequences), got {normalizer}")
    valid = as_bool_mask(mask, per_token_loss)
    detached_weights = weights.detach()
    check_finite_where_valid("per_token_loss", per_token_loss.detach(), valid)
    check_finite_where_valid("weights", detached_weights, valid)
    if bool((valid & (detached_weights < 0)).any()):
        raise ValueError("weights must be >= 0 at valid tokens")
    weighted = torch.where(valid, per_token_loss * detached_weights, 0.0)
    if reduction == "token-mean":
        denominator = valid.sum().clamp(min=1) if normalizer is None else normalizer
        return weighted.sum() / denominator
    tokens_per_sequence = valid.sum(dim=-1)
    sequence_means = weighted.sum(dim=-1) / tokens_per_sequence.clamp(min=1)
    denominator = (tokens_per_sequence > 0).sum().clamp(min=1) if normalizer is None else normalizer
    return sequence_means.sum() / denominator


def _sequence_log_ratio(log_ratio: Tensor, valid: Tensor, aggregation: Aggregation) -> tuple[Tensor, Tensor]:
    """Per-sequence aggregated log-ratio [B] (mean or sum over valid tokens) and a [B] bool of non-empty sequences."""
    counts = valid.sum(dim=-1)
    totals = log_ratio.sum(dim=-1)  # masked positions hold 0
    seq_log_ratio = totals / counts.clamp(min=1) if aggregation == "mean" else totals
    return seq_log_ratio, counts > 0


def _check_range(low_name: str, low: float, high_name: str, high: float) -> None:
    """Raise ValueError unless 0 <= low < high (high may be inf; NaN is rejected)."""
    if math.isnan(low) or math.isnan(high):
        raise ValueError(f"{low_name} and {high_name} must not be NaN, got {low} and {high}")
    if high <= 0:
        raise ValueError(f"{high_name} must be > 0, got {high}")
    if low < 0:
        raise ValueError(f"{low_name} must be >= 0, got {low}")
    if low >= high:
        raise ValueError(f"{low_name} must be < {high_name}, got {low_name}={low}, {high_name}={high}")


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def _log_bound(bound: float) -> float:
    """log of a non-negative bound, with log(0) = -inf."""
    return math.log(bound) if bound > 0 else -math.inf


def _fraction(selected: Tensor, universe: Tensor) -> float:
    """Share of True entries of ``universe`` that are also True in ``selected``; 0.0 for an empty universe."""
    total = int(universe.sum())
    return int((selected & universe).sum()) / total if total else 0.0
