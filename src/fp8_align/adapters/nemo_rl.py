"""NeMo RL adapter: its ``ClippedPGLossFn`` tensors and ``loss_fn`` config in, fp8_align metrics and IS weights out.

Matched against NVIDIA-NeMo/RL ``nemo_rl/algorithms/loss_functions.py`` at commit
005a098a5fc04317a0ceb792e66a8b8076804618 (main after v0.5.0, with ``seq-mask-tis`` from PR #1899).
There, for a micro-batch ``data`` (a ``BatchedDataDict``):

- ``data["prev_logprobs"]`` (training engine, the old policy), ``data["generation_logprobs"]``
  (vLLM) and ``data["token_mask"]`` are [B, S] over the whole sequence (prompt included) and are
  sliced ``[:, 1:]`` to line up with next-token log-probs; ``data["sample_mask"]`` is [B];
- the token mask is ``token_mask[:, 1:] * sample_mask[:, None]``;
- the IS weight is ``exp(prev_logprobs - generation_logprobs)``: training-side old policy over
  generation policy, detached, multiplying the per-token clipped loss, when
  ``loss_fn.use_importance_sampling_correction`` is true;
- ``token_mult_prob_error`` is the masked mean of ``exp(|generation - prev|)``.

Turn it on in a NeMo RL GRPO config::

    loss_fn:
      use_importance_sampling_correction: true
      truncated_importance_sampling_ratio: 2.0     # null: untruncated weights
      truncated_importance_sampling_type: tis      # tis | icepop | seq-mask-tis
      truncated_importance_sampling_ratio_min: null  # lower bound for icepop / seq-mask-tis

Differences from NeMo RL: NaN/inf log-probs at valid tokens raise ``ValueError`` here, where
NeMo RL turns non-finite weights into 0 (``nan_to_num``) and, in ``nemo_rl/algorithms/utils.py``
(``mask_out_neg_inf_logprobs``), drops -inf tokens from the mask with a warning; to do the same,
pass ``token_mask`` already cleared at those tokens. Masked positions never matter here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from fp8_align.is_correction import (
    ImportanceWeights,
    importance_weighted_loss,
    masked_importance_weights,
    sequence_masked_importance_weights,
    sequence_truncated_importance_weights,
    truncated_importance_weights,
)
from fp8_align.metrics import as_bool_mask, masked_log_ratio, mismatch_metrics

#: Values of NeMo RL's ``loss_fn.truncated_importance_sampling_type``.
TRUNCATION_TYPES = ("tis", "icepop", "seq-mask-tis")


def nemo_rl_loss_mask(data: Mapping[str, Tensor]) -> Tensor:
    """The token mask ``ClippedPGLossFn`` uses: ``token_mask[:, 1:] * sample_mask[:, None]``.

    Args: data with "token_mask" [B, S] and "sample_mask" [B], bool or {0, 1}.
    Returns: bool [B, S - 1], aligned with ``prev_logprobs[:, 1:]``.
    Raises ValueError for masks that are not bool/{0, 1} or whose shapes do not fit.
    """
    token_mask = as_bool_mask(data["token_mask"])
    sample_mask = as_bool_mask(data["sample_mask"])
    if token_mask.ndim != 2 or sample_mask.shape != token_mask.shape[:1]:
        raise ValueError(
            "expected token_mask [B, S] and sample_mask [B], "
            f"got {tuple(token_mask.shape)} and {tuple(sample_mask.shape)}"
        )
    return token_mask[:, 1:] & sample_mask.unsqueeze(-1)


def nemo_rl_mismatch_metrics(data: Mapping[str, Tensor], kl_type: Literal["k1", "k3"] = "k3") -> dict[str, float]:
    """NeMo RL's mismatch metrics plus the |log-ratio| statistics, for logging.

    Args: data with "prev_logprobs", "generation_logprobs" [B, S] floating (nats), "token_mask"
    [B, S] and "sample_mask" [B]. kl_type: the estimator behind "gen_kl_error"; NeMo RL uses its
    ``reference_policy_kl_type`` (k3 by default) and both estimate KL(generation || training).
    Returns: {"token_mult_prob_error", "gen_kl_error", "max_abs_log_ratio", "abs_log_ratio_p50",
    "abs_log_ratio_p90", "abs_log_ratio_p99", "num_valid_tokens"}; the first two have NeMo RL's
    names and values (up to the per-micro-batch vs global normalisation).
    Raises ValueError on bad input or an unknown kl_type.
    """
    if kl_type not in ("k1", "k3"):
        raise ValueError(f"kl_type must be 'k1' or 'k3', got {kl_type!r}")
    metrics = mismatch_metrics(
        data["prev_logprobs"][:, 1:], data["generation_logprobs"][:, 1:], nemo_rl_loss_mask(data)
    )
    return {
        "token_mult_prob_error": metrics.mult_prob_error,
        "gen_kl_error": metrics.kl_k3 if kl_type == "k3" else metrics.kl_k1,
        "max_abs_log_ratio": metrics.max_abs_log_ratio,
        "abs_log_ratio_p50": metrics.abs_log_ratio_p50,
        "abs_log_ratio_p90": metrics.abs_log_ratio_p90,
        "abs_log_ratio_p99": metrics.abs_log_ratio_p99,
        "num_valid_tokens": float(metrics.num_tokens),
    }


def nemo_rl_importance_weights(data: Mapping[str, Tensor], loss_cfg: Mapping[str, Any]) -> ImportanceWeights:
    """The actor IS weights ``ClippedPGLossFn`` would apply, from its ``loss_fn`` config.

    Args: data as for :func:`nemo_rl_mismatch_metrics`. loss_cfg: NeMo RL's ``loss_fn`` mapping;
    reads use_importance_sampling_correction, truncated_importance_sampling_ratio,
    truncated_importance_sampling_type, truncated_importance_sampling_ratio_min and
    sequence_level_importance_ratios.
    Returns: :class:`ImportanceWeights` over [B, S - 1]:

    - correction off: weight 1 at every valid token;
    - token level, ratio null: exp(prev - gen), untruncated;
    - "tis": min(exp(prev - gen), ratio); "icepop": exp(prev - gen) inside [ratio_min, ratio],
      else 0; "seq-mask-tis": exp(prev - gen) in sequences whose geometric-mean ratio is inside
      [ratio_min, ratio], else 0;
    - sequence_level_importance_ratios (GSPO): exp(sum of prev - gen) per sequence, truncated at
      ratio for "tis".

    As in NeMo RL, an untruncated weight that overflows to inf becomes 0.
    Raises ValueError for the combinations NeMo RL rejects (a ratio without the correction,
    ratio <= 0, a missing or unknown type, seq-mask-tis with sequence-level ratios), for
    icepop/seq-mask-tis without ratio_min, and for icepop with sequence-level ratios (not
    supported here).
    """
    mask = nemo_rl_loss_mask(data)
    prev_logprobs = data["prev_logprobs"][:, 1:]
    generation_logprobs = data["generation_logprobs"][:, 1:]
    ratio = loss_cfg.get("truncated_importance_sampling_ratio")
    truncation = loss_cfg.get("truncated_importance_sampling_type") if ratio is not None else None
    ratio_min = loss_cfg.get("truncated_importance_sampling_ratio_min")
    sequence_level = bool(loss_cfg.get("sequence_level_importance_ratios", False))
    if not loss_cfg["use_importance_sampling_correction"]:
        if ratio is not None:
            raise ValueError("truncated_importance_sampling_ratio needs use_importance_sampling_correction: true")
        return _unit_weights(prev_logprobs, generation_logprobs, mask)
    if ratio is not None and truncation not in TRUNCATION_TYPES:
        raise ValueError(f"truncated_importance_sampling_type must be one of {TRUNCATION_TYPES}, got {truncation!r}")
    if truncation in ("icepop", "seq-mask-tis") and ratio_min is None:
        raise ValueError(
            f"truncated_importance_sampling_type {truncation!r} needs truncated_importance_sampling_ratio_min"
        )
    if sequence_level and truncation in ("icepop", "seq-mask-tis"):
        raise ValueError(f"{truncation!r} with sequence_level_importance_ratios is not supported")
    cap = math.inf if ratio is None else ratio
    if sequence_level:
        importance = sequence_truncated_importance_weights(
            prev_logprobs, generation_logprobs, mask, cap, aggregation="sum"
        )
    elif truncation == "icepop":
        importance = masked_importance_weights(prev_logprobs, generation_logprobs, mask, lo=ratio_min, hi=ratio)
    elif truncation == "seq-mask-tis":
        importance = sequence_masked_importance_weights(
            prev_logprobs, generation_logprobs, mask, lo=ratio_min, hi=ratio
        )
    else:
        importance = truncated_importance_weights(prev_logprobs, generation_logprobs, mask, cap)
    return dataclasses.replace(importance, weights=torch.nan_to_num(importance.weights, posinf=0.0))


def nemo_rl_actor_loss(
    clip_loss: Tensor,
    importance: ImportanceWeights,
    data: Mapping[str, Tensor],
    token_level_loss: bool,
    *,
    normalizer: float | Tensor | None = None,
) -> Tensor:
    """``ClippedPGLossFn``'s actor loss: IS weights times clipped loss, reduced per ``loss_fn.token_level_loss``.

    Args: clip_loss [B, S - 1], NeMo RL's per-token ``max(-A * ratio, -A * clipped_ratio)``
    (with grad); importance from :func:`nemo_rl_importance_weights`; data with "token_mask" and
    "sample_mask"; token_level_loss: True for token-mean, False for seq-mean-token-mean.
    normalizer: NeMo RL's ``global_valid_toks`` (token level) or ``global_valid_seqs`` (sequence
    level); None normalises by this micro-batch alone. With NeMo RL's ``global_valid_seqs`` a
    sequence with sample_mask 1 but no valid token counts in the denominator, as in NeMo RL.
    Returns: 0-dim loss tensor. Raises ValueError on bad input.
    """
    reduction = "token-mean" if token_level_loss else "seq-mean-token-mean"
    return importance_weighted_loss(
        clip_loss, importance.weights, nemo_rl_loss_mask(data), reduction, normalizer=normalizer
    )


def _unit_weights(prev_logprobs: Tensor, generation_logprobs: Tensor, mask: Tensor) -> ImportanceWeights:
    """Weight 1 at every valid token: NeMo RL with the correction switched off (inputs still validated)."""
    log_ratio, valid = masked_log_ratio(prev_logprobs, generation_logprobs, mask)
    return ImportanceWeights(
        weights=valid.to(log_ratio.dtype),
        level="token",
        num_units=int(valid.sum()),
        fraction_clipped=0.0,
        fraction_dropped=0.0,
        dropped=torch.zeros_like(valid),
    )
