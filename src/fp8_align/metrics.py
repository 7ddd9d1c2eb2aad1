"""How far training log-probs drift from generation log-probs on the sampled tokens.

Every function takes per-token log-probabilities of the *sampled* tokens, shape [B, T] (batch,
token position), in nats:

- ``train_logprobs``: from the training engine (Megatron; NeMo RL's ``prev_logprobs``, verl's
  ``old_log_probs``, OpenRLHF's ``old_log_probs``);
- ``gen_logprobs``: from the generation engine (vLLM; NeMo RL's ``generation_logprobs``, verl's
  ``rollout_log_probs``, OpenRLHF's ``rollout_log_probs``);
- ``mask``: [B, T], bool or any real dtype holding only 0 and 1; True/1 marks a token to count.

The log-ratio is ``r = train_logprobs - gen_logprobs``. Because the tokens were sampled from the
generation policy, averages of functions of ``r`` over valid tokens estimate expectations under
the generation policy.

Conventions shared with :mod:`fp8_align.is_correction`:

- Math runs in float32, or in float64 when either log-prob tensor is float64; bf16/fp16 inputs are
  upcast *before* subtracting.
- Masked positions are ignored entirely: their values may be anything, NaN and inf included, and
  never reach a result. Non-finite values at valid positions raise ``ValueError``.
- Results are detached: nothing here is differentiable.
- An all-masked batch (or an empty one) is not an error: it gives the "no evidence of mismatch"
  values (error 1.0, KL 0.0, ``|r|`` statistics 0.0) with a token count of 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

#: Quantiles of ``|r|`` reported by :func:`mismatch_metrics` (as ``abs_log_ratio_p50/p90/p99``).
ABS_LOG_RATIO_QUANTILES = (0.5, 0.9, 0.99)


# --- input validation (shared with fp8_align.is_correction) ---------------------------------


def require_float_matrix(name: str, value: object) -> Tensor:
    """Return ``value`` if it is a floating-point torch tensor of shape [B, T]; else ValueError."""
    if not isinstance(value, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise ValueError(f"{name} must have a floating dtype (log-probs in nats), got {value.dtype}")
    if value.ndim != 2:
        raise ValueError(f"{name} must have shape [B, T], got shape {tuple(value.shape)}")
    return value


def as_bool_mask(mask: object, like: Tensor | None = None) -> Tensor:
    """Validate a token mask and return it as a bool tensor of the same shape.

    mask: bool, or any real dtype whose values are all exactly 0 or 1 (NaN, 0.5, 2, -1 are
    rejected). like: when given, ``mask`` must have its shape and device.
    Raises ValueError otherwise.
    """
    if not isinstance(mask, Tensor):
        raise ValueError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if like is not None and mask.shape != like.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} != values shape {tuple(like.shape)}")
    if like is not None and mask.device != like.device:
        raise ValueError(f"mask is on {mask.device} but values are on {like.device}")
    if mask.dtype == torch.bool:
        return mask
    if mask.is_complex():
        raise ValueError(f"mask must be bool or hold only 0 and 1, got complex dtype {mask.dtype}")
    if not bool(((mask == 0) | (mask == 1)).all()):
        offending = mask[(mask != 0) & (mask != 1)].flatten()[:3].tolist()
        raise ValueError(f"mask must be bool or hold only 0 and 1, found values such as {offending}")
    return mask != 0


def check_finite_where_valid(name: str, values: Tensor, valid: Tensor) -> None:
    """Raise ValueError if ``values`` [B, T] has NaN or +-inf where ``valid`` [B, T] (bool) is True."""
    bad = valid & ~torch.isfinite(values)
    if bool(bad.any()):
        b, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name} has {int(bad.sum())} non-finite value(s) at valid (unmasked) positions, "
            f"first at [{b}, {t}] = {values[b, t].item()}; mask such tokens out or fix their source"
        )


def masked_log_ratio(train_logprobs: Tensor, gen_logprobs: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Validated per-token log-ratio ``r = train_logprobs - gen_logprobs``.

    Args: train_logprobs, gen_logprobs: [B, T] floating, nats. mask: [B, T] bool or {0, 1}.
    Returns: ``(log_ratio, valid)``: log_ratio [B, T] float32 (float64 if an input is float64),
    detached, 0.0 at masked positions; valid [B, T] bool.
    Raises ValueError on a non-tensor or non-floating input, shapes that differ or are not 2-D,
    tensors on different devices, a mask that is not bool/{0, 1}, or NaN/inf at a valid position.
    """
    require_float_matrix("train_logprobs", train_logprobs)
    require_float_matrix("gen_logprobs", gen_logprobs)
    if train_logprobs.shape != gen_logprobs.shape:
        raise ValueError(
            f"train_logprobs shape {tuple(train_logprobs.shape)} != gen_logprobs shape {tuple(gen_logprobs.shape)}"
        )
    if train_logprobs.device != gen_logprobs.device:
        raise ValueError(f"train_logprobs is on {train_logprobs.device} but gen_logprobs is on {gen_logprobs.device}")
    valid = as_bool_mask(mask, train_logprobs)
    dtype = torch.float64 if torch.float64 in (train_logprobs.dtype, gen_logprobs.dtype) else torch.float32
    train = train_logprobs.detach().to(dtype)
    gen = gen_logprobs.detach().to(dtype)
    check_finite_where_valid("train_logprobs", train, valid)
    check_finite_where_valid("gen_logprobs", gen, valid)
    return torch.where(valid, train - gen, 0.0), valid


# --- metrics ------------------------------------------------------------------------------


@dataclass(frozen=True)
class MismatchMetrics:
    """Summary of the train/generation log-prob mismatch over the valid tokens of a batch.

    num_tokens: valid tokens counted. mult_prob_error: mean of exp(|r|) (1.0 = identical).
    kl_k1: mean(-r). kl_k3: mean(exp(r) - 1 - r). Both estimate KL(gen || train) in nats.
    max_abs_log_ratio, abs_log_ratio_p50/p90/p99: max and quantiles (linear interpolation) of |r|.
    """

    num_tokens: int
    mult_prob_error: float
    kl_k1: float
    kl_k3: float
    max_abs_log_ratio: float
    abs_log_ratio_p50: float
    abs_log_ratio_p90: float
    abs_log_ratio_p99: float


@dataclass(frozen=True)
class PerPositionMultProbError:
    """Token multiplicative probability error per position along T.

    error: [T], mean over the batch of exp(|r|) at each position; 1.0 where no token is valid.
    num_tokens: [T] int64, valid tokens at each position.
    """

    error: Tensor
    num_tokens: Tensor


def token_mult_prob_error(train_logprobs: Tensor, gen_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Mean over valid tokens of exp(|train - gen|): NeMo RL's ``token_mult_prob_error``.

    Args: train_logprobs, gen_logprobs: [B, T] floating (nats); mask: [B, T] bool or {0, 1}.
    Returns: 0-dim tensor, float32 (float64 for float64 input), detached. 1.0 means identical
    log-probs; below about 1.03-1.05 is usually acceptable for RL. 1.0 for an all-masked batch.
    In float32 the result is inf if some |r| exceeds ~88.7.
    Raises ValueError on bad input (see :func:`masked_log_ratio`).
    """
    log_ratio, valid = masked_log_ratio(train_logprobs, gen_logprobs, mask)
    count = valid.sum()
    total = torch.where(valid, torch.exp(log_ratio.abs()), 0.0).sum()
    return torch.where(count > 0, total / count.clamp(min=1), torch.ones((), dtype=total.dtype, device=total.device))


def mismatch_metrics(train_logprobs: Tensor, gen_logprobs: Tensor, mask: Tensor) -> MismatchMetrics:
    """All mismatch statistics of one batch, as Python numbers.

    With r = train_logprobs - gen_logprobs on tokens sampled from the generation policy:

    - ``mult_prob_error`` = mean(exp(|r|)), as :func:`token_mult_prob_error`;
    - ``kl_k1`` = mean(-r), an unbiased estimate of KL(gen || train) = E_gen[log gen - log train];
      single tokens can make it negative;
    - ``kl_k3`` = mean(exp(r) - 1 - r), an unbiased and never-negative estimate of the same
      KL(gen || train) (unbiased because E_gen[exp(r)] = 1), with lower variance than k1;
    - ``max_abs_log_ratio`` and ``abs_log_ratio_p50/p90/p99``: max and linearly interpolated
      quantiles of |r| (the same definition as ``torch.quantile``).

    Args: train_logprobs, gen_logprobs: [B, T] floating (nats); mask: [B, T] bool or {0, 1}.
    Returns: :class:`MismatchMetrics`; for an all-masked batch num_tokens=0, mult_prob_error=1.0
    and every other field 0.0.
    Raises ValueError on bad input (see :func:`masked_log_ratio`).
    """
    log_ratio, valid = masked_log_ratio(train_logprobs, gen_logprobs, mask)
    r = log_ratio[valid]
    if r.numel() == 0:
        return MismatchMetrics(0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    abs_sorted = r.abs().sort().values
    p50, p90, p99 = _sorted_quantiles(abs_sorted, ABS_LOG_RATIO_QUANTILES)
    # e^r - 1 - r >= 0 holds exactly; the clamp only removes rounding-level negatives.
    k3_terms = (torch.expm1(r) - r).clamp(min=0.0)
    return MismatchMetrics(
        num_tokens=r.numel(),
        mult_prob_error=float(torch.exp(abs_sorted).mean()),
        kl_k1=float((-r).mean()),
        kl_k3=float(k3_terms.mean()),
        max_abs_log_ratio=float(abs_sorted[-1]),
        abs_log_ratio_p50=p50,
        abs_log_ratio_p90=p90,
        abs_log_ratio_p99=p99,
    )


def per_position_mult_prob_error(
    train_logprobs: Tensor, gen_logprobs: Tensor, mask: Tensor
) -> PerPositionMultProbError:
    """exp(|train - gen|) averaged over the batch at each token position.

    Use it to see whether the mismatch grows along the response (e.g. with KV-cache precision).
    Args: train_logprobs, gen_logprobs: [B, T] floating (nats); mask: [B, T] bool or {0, 1}.
    Returns: :class:`PerPositionMultProbError` with error [T] (float32/float64, 1.0 where a
    position has no valid token) and num_tokens [T] int64.
    Raises ValueError on bad input (see :func:`masked_log_ratio`).
    """
    log_ratio, valid = masked_log_ratio(train_logprobs, gen_logprobs, mask)
    counts = valid.sum(dim=0)
    totals = torch.where(valid, torch.exp(log_ratio.abs()), 0.0).sum(dim=0)
    error = torch.where(counts > 0, totals / counts.clamp(min=1), 1.0)
    return PerPositionMultProbError(error=error, num_tokens=counts)


def _sorted_quantiles(sorted_values: Tensor, quantiles: tuple[float, ...]) -> list[float]:
    """Linearly interpolated quantiles of a sorted, non-empty 1-D tensor (no size limit, unlike torch.quantile)."""
    last = sorted_values.numel() - 1
    results = []
    for q in quantiles:
        position = q * last
        lower = int(position)
        upper = min(lower + 1, last)
        fraction = position - lower
        low_value = float(sorted_values[lower])
        results.append(low_value + fraction * (float(sorted_values[upper]) - low_value))
    return results
