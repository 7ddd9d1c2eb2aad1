"""Tests for fp8_align.metrics: hand-computed values, properties, dtype handling and input errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fp8_align.metrics import (
    as_bool_mask,
    masked_log_ratio,
    mismatch_metrics,
    per_position_mult_prob_error,
    token_mult_prob_error,
)
from tests.strategies import INF, NAN, PROPERTY_SETTINGS, logprob_batches


# r = train - gen = [0.5, -1.0] at the two valid tokens; the third token is masked (and NaN).
TRAIN = torch.tensor([[-1.0, -2.0, NAN]])
GEN = torch.tensor([[-1.5, -1.0, -0.3]])
MASK = torch.tensor([[1, 1, 0]])


def test_token_mult_prob_error_hand_computed() -> None:
    expected = (math.exp(0.5) + math.exp(1.0)) / 2
    assert token_mult_prob_error(TRAIN, GEN, MASK).item() == pytest.approx(expected, rel=1e-6)


def test_mismatch_metrics_hand_computed() -> None:
    metrics = mismatch_metrics(TRAIN, GEN, MASK)
    assert metrics.num_tokens == 2
    assert metrics.mult_prob_error == pytest.approx((math.exp(0.5) + math.exp(1.0)) / 2, rel=1e-6)
    assert metrics.kl_k1 == pytest.approx((-0.5 + 1.0) / 2, rel=1e-6)
    k3_expected = ((math.exp(0.5) - 1 - 0.5) + (math.exp(-1.0) - 1 + 1.0)) / 2
    assert metrics.kl_k3 == pytest.approx(k3_expected, rel=1e-6)
    assert metrics.max_abs_log_ratio == pytest.approx(1.0)
    # |r| sorted = [0.5, 1.0]; the q-quantile sits at position q * (n - 1) = q.
    assert metrics.abs_log_ratio_p50 == pytest.approx(0.75, rel=1e-6)
    assert metrics.abs_log_ratio_p90 == pytest.approx(0.95, rel=1e-6)
    assert metrics.abs_log_ratio_p99 == pytest.approx(0.995, rel=1e-6)


def test_per_position_hand_computed() -> None:
    train = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -1.0, -1.0]])
    gen = torch.tensor([[-1.2, -0.5, -1.0], [-1.0, NAN, -1.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    result = per_position_mult_prob_error(train, gen, mask)
    expected = torch.tensor([(math.exp(0.2) + math.exp(1.0)) / 2, math.exp(0.5), 1.0])
    torch.testing.assert_close(result.error, expected)
    assert result.num_tokens.tolist() == [2, 1, 0]
    assert result.num_tokens.dtype == torch.int64


def test_bf16_inputs_are_upcast_before_the_math() -> None:
    # -0.5 and -0.25 are exact in bf16; exp(0.25) in bf16 arithmetic would be 1.2813, not 1.2840.
    train = torch.tensor([[-0.5]], dtype=torch.bfloat16)
    gen = torch.tensor([[-0.25]], dtype=torch.bfloat16)
    error = token_mult_prob_error(train, gen, torch.ones(1, 1))
    assert error.dtype == torch.float32
    assert error.item() == pytest.approx(math.exp(0.25), rel=1e-6)


def test_float64_inputs_keep_float64_precision() -> None:
    train = torch.tensor([[-1.0]], dtype=torch.float64)
    gen = train - 1e-10  # a difference float32 cannot represent next to 1.0
    error = token_mult_prob_error(train, gen, torch.ones(1, 1))
    assert error.dtype == torch.float64
    assert error.item() - 1.0 == pytest.approx(1e-10, rel=1e-5)


def test_mixed_dtypes_compute_in_float64() -> None:
    bf16, fp64 = torch.zeros(1, 2, dtype=torch.bfloat16), torch.zeros(1, 2, dtype=torch.float64)
    log_ratio, _ = masked_log_ratio(bf16, fp64, torch.ones(1, 2))
    assert log_ratio.dtype == torch.float64


@pytest.mark.parametrize("mask", [torch.zeros(2, 3, dtype=torch.bool), torch.zeros(2, 3)])
def test_all_masked_batch_gives_no_evidence_values(mask: torch.Tensor) -> None:
    train = torch.full((2, 3), NAN)
    gen = torch.full((2, 3), -1.0)
    assert token_mult_prob_error(train, gen, mask).item() == 1.0
    metrics = mismatch_metrics(train, gen, mask)
    assert (metrics.num_tokens, metrics.mult_prob_error, metrics.kl_k1, metrics.kl_k3) == (0, 1.0, 0.0, 0.0)
    assert metrics.max_abs_log_ratio == metrics.abs_log_ratio_p99 == 0.0
    per_position = per_position_mult_prob_error(train, gen, mask)
    assert per_position.error.tolist() == [1.0, 1.0, 1.0]
    assert per_position.num_tokens.tolist() == [0, 0, 0]


def test_empty_batch_is_all_masked() -> None:
    empty = torch.zeros(0, 4)
    assert token_mult_prob_error(empty, empty, empty.bool()).item() == 1.0
    assert mismatch_metrics(empty, empty, empty.bool()).num_tokens == 0


def test_results_are_detached() -> None:
    train = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    assert not token_mult_prob_error(train, torch.full((1, 2), -1.5), torch.ones(1, 2)).requires_grad
    assert not per_position_mult_prob_error(train, torch.full((1, 2), -1.5), torch.ones(1, 2)).error.requires_grad


@PROPERTY_SETTINGS
@given(logprob_batches())
def test_error_is_at_least_one_and_k3_non_negative(batch: tuple[torch.Tensor, ...]) -> None:
    train, gen, mask = batch
    assert token_mult_prob_error(train, gen, mask).item() >= 1.0
    metrics = mismatch_metrics(train, gen, mask)
    assert metrics.mult_prob_error >= 1.0
    assert metrics.kl_k3 >= 0.0
    assert 0.0 <= metrics.abs_log_ratio_p50 <= metrics.abs_log_ratio_p90 <= metrics.abs_log_ratio_p99
    assert metrics.abs_log_ratio_p99 <= metrics.max_abs_log_ratio
    assert metrics.num_tokens == int(mask.sum())


@PROPERTY_SETTINGS
@given(logprob_batches())
def test_equal_logprobs_give_exactly_one_and_zero_kl(batch: tuple[torch.Tensor, ...]) -> None:
    train, _, mask = batch
    mask[0, 0] = True  # at least one valid token
    assert token_mult_prob_error(train, train.clone(), mask).item() == 1.0
    metrics = mismatch_metrics(train, train.clone(), mask)
    assert (metrics.mult_prob_error, metrics.kl_k1, metrics.kl_k3, metrics.max_abs_log_ratio) == (1.0, 0.0, 0.0, 0.0)
    assert torch.all(per_position_mult_prob_error(train, train.clone(), mask).error == 1.0)


@PROPERTY_SETTINGS
@given(logprob_batches(), st.sampled_from([NAN, INF, -INF, 0.0, -1e30]))
def test_masked_positions_change_nothing(batch: tuple[torch.Tensor, ...], junk: float) -> None:
    train, gen, mask = batch
    junk_train = torch.where(mask, train, junk)
    junk_gen = torch.where(mask, gen, -junk)
    assert torch.equal(token_mult_prob_error(train, gen, mask), token_mult_prob_error(junk_train, junk_gen, mask))
    assert mismatch_metrics(train, gen, mask) == mismatch_metrics(junk_train, junk_gen, mask)
    clean = per_position_mult_prob_error(train, gen, mask)
    dirty = per_position_mult_prob_error(junk_train, junk_gen, mask)
    assert torch.equal(clean.error, dirty.error) and torch.equal(clean.num_tokens, dirty.num_tokens)


@PROPERTY_SETTINGS
@given(logprob_batches(dtype=torch.float64), st.randoms(use_true_random=False))
def test_batch_metrics_do_not_depend_on_row_order(batch: tuple[torch.Tensor, ...], rng) -> None:
    train, gen, mask = batch
    order = list(range(train.shape[0]))
    rng.shuffle(order)
    original = mismatch_metrics(train, gen, mask)
    permuted = mismatch_metrics(train[order], gen[order], mask[order])
    assert permuted.num_tokens == original.num_tokens
    assert permuted.mult_prob_error == pytest.approx(original.mult_prob_error, rel=1e-12)
    assert permuted.kl_k1 == pytest.approx(original.kl_k1, rel=1e-12, abs=1e-12)
    assert permuted.kl_k3 == pytest.approx(original.kl_k3, rel=1e-12, abs=1e-12)
    assert permuted.max_abs_log_ratio == original.max_abs_log_ratio
    assert permuted.abs_log_ratio_p90 == original.abs_log_ratio_p90
    torch.testing.assert_close(
        per_position_mult_prob_error(train[order], gen[order], mask[order]).error,
        per_position_mult_prob_error(train, gen, mask).error,
    )


@PROPERTY_SETTINGS
@given(logprob_batches())
def test_quantiles_match_torch_quantile(batch: tuple[torch.Tensor, ...]) -> None:
    train, gen, mask = batch
    mask[0, 0] = True
    abs_ratio = (train - gen)[mask].abs()
    expected = torch.quantile(abs_ratio, torch.tensor([0.5, 0.9, 0.99])).tolist()
    metrics = mismatch_metrics(train, gen, mask)
    observed = [metrics.abs_log_ratio_p50, metrics.abs_log_ratio_p90, metrics.abs_log_ratio_p99]
    assert observed == pytest.approx(expected, rel=1e-5, abs=1e-6)


@PROPERTY_SETTINGS
@given(logprob_batches())
def test_per_position_error_averages_back_to_the_batch_error(batch: tuple[torch.Tensor, ...]) -> None:
    train, gen, mask = batch
    per_position = per_position_mult_prob_error(train, gen, mask)
    counts = per_position.num_tokens
    if counts.sum() == 0:
        return
    token_weighted = (per_position.error * counts).sum() / counts.sum()
    assert token_weighted.item() == pytest.approx(token_mult_prob_error(train, gen, mask).item(), rel=1e-5)


# --- bad input ------------------------------------------------------------------------------

GOOD = torch.full((2, 3), -1.0)
ONES = torch.ones(2, 3)


@pytest.mark.parametrize("metric", [token_mult_prob_error, mismatch_metrics, per_position_mult_prob_error])
@pytest.mark.parametrize(
    ("train", "gen", "mask", "message"),
    [
        (GOOD, torch.full((2, 4), -1.0), torch.ones(2, 3), "shape"),
        (GOOD, GOOD, torch.ones(2, 4), "mask shape"),
        (torch.full((6,), -1.0), torch.full((6,), -1.0), torch.ones(6), r"\[B, T\]"),
        (GOOD, GOOD, torch.full((2, 3), 2.0), "only 0 and 1"),
        (GOOD, GOOD, torch.full((2, 3), 0.5), "only 0 and 1"),
        (GOOD, GOOD, torch.full((2, 3), NAN), "only 0 and 1"),
        (GOOD, GOOD, torch.full((2, 3), -1), "only 0 and 1"),
        (torch.full((2, 3), -1), GOOD, ONES, "floating dtype"),
        (GOOD, torch.zeros(2, 3, dtype=torch.int64), ONES, "floating dtype"),
        ([[-1.0]], GOOD, ONES, "torch.Tensor"),
        (GOOD, GOOD, [[1, 1, 1]], "torch.Tensor"),
        (torch.tensor([[-1.0, NAN, -1.0], [-1.0, -1.0, -1.0]]), GOOD, ONES, r"non-finite.*\[0, 1\]"),
        (GOOD, torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -INF]]), ONES, r"gen_logprobs.*non-finite"),
        (torch.tensor([[-1.0, -1.0, INF], [-1.0, -1.0, -1.0]]), GOOD, ONES, "non-finite"),
    ],
)
def test_bad_input_raises_value_error(metric, train, gen, mask, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        metric(train, gen, mask)


def test_as_bool_mask_accepts_bool_int_and_float_masks() -> None:
    expected = torch.tensor([[True, False]])
    for dtype in (torch.bool, torch.int64, torch.float32, torch.uint8):
        mask = expected.to(dtype)
        assert torch.equal(as_bool_mask(mask), expected)
    with pytest.raises(ValueError, match="complex"):
        as_bool_mask(torch.tensor([[1 + 0j]]))
