"""Tests for fp8_align.is_correction: IS weight variants, the weighted loss, gradients and input errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fp8_align.is_correction import (
    importance_weighted_loss,
    masked_importance_weights,
    sequence_masked_importance_weights,
    sequence_truncated_importance_weights,
    truncated_importance_weights,
)
from tests.strategies import INF, NAN, PROPERTY_SETTINGS, logprob_batches


def logprobs_with_ratios(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, gen) = (log(ratio), 0) in float64, so that train - gen is exactly log(ratio), bounds included."""
    log_ratios = torch.tensor(ratios, dtype=torch.float64).log()
    return log_ratios, torch.zeros_like(log_ratios)


# --- hand-computed weights ------------------------------------------------------------------


def test_truncated_weights_hand_computed() -> None:
    train, gen = logprobs_with_ratios([[3.0, 0.5, 1.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    result = truncated_importance_weights(train, gen, mask, cap=2.0)
    torch.testing.assert_close(result.weights, torch.tensor([[2.0, 0.5, 1.0, 0.0]], dtype=torch.float64))
    assert (result.level, result.num_units, result.fraction_dropped) == ("token", 3, 0.0)
    assert result.fraction_clipped == pytest.approx(1 / 3)
    assert not result.dropped.any()


def test_truncated_weights_with_floor_clamp_both_sides() -> None:
    train, gen = logprobs_with_ratios([[3.0, 0.25, 1.0, 0.6]])
    result = truncated_importance_weights(train, gen, torch.ones(1, 4), cap=2.0, floor=0.5)
    torch.testing.assert_close(result.weights, torch.tensor([[2.0, 0.5, 1.0, 0.6]], dtype=torch.float64))
    assert result.fraction_clipped == pytest.approx(2 / 4)


def test_truncation_happens_in_log_space_without_overflow() -> None:
    train = torch.tensor([[0.0]])
    gen = torch.tensor([[-200.0]])  # exp(200) overflows float32
    assert truncated_importance_weights(train, gen, torch.ones(1, 1), cap=2.0).weights.item() == 2.0


def test_masked_weights_hand_computed() -> None:
    train, gen = logprobs_with_ratios([[3.0, 0.25, 1.5, 9.0], [0.5, 2.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    result = masked_importance_weights(train, gen, mask, lo=0.5, hi=2.0)
    expected = torch.tensor([[0.0, 0.0, 1.5, 0.0], [0.5, 2.0, 1.0, 1.0]], dtype=torch.float64)
    torch.testing.assert_close(result.weights, expected)  # the bounds themselves are kept
    assert result.dropped.tolist() == [[True, True, False, False], [False, False, False, False]]
    assert result.fraction_dropped == pytest.approx(2 / 7)
    assert (result.fraction_clipped, result.num_units) == (0.0, 7)


def test_sequence_truncated_weights_hand_computed() -> None:
    # Row 0: ratios 4 and 1 -> geometric mean 2 -> truncated to 1.5. Row 1: ratio 0.25 (one valid token).
    train, gen = logprobs_with_ratios([[4.0, 1.0], [0.25, 100.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    result = sequence_truncated_importance_weights(train, gen, mask, cap=1.5)
    torch.testing.assert_close(result.weights, torch.tensor([[1.5, 1.5], [0.25, 0.0]], dtype=torch.float64))
    assert (result.level, result.num_units, result.fraction_clipped) == ("sequence", 2, 0.5)


def test_sequence_truncated_weights_sum_aggregation_is_the_product() -> None:
    train, gen = logprobs_with_ratios([[1.2, 1.5, 0.5], [3.0, 1.0, 1.0]])
    result = sequence_truncated_importance_weights(train, gen, torch.ones(2, 3), cap=2.0, aggregation="sum")
    expected = torch.tensor([[0.9] * 3, [2.0] * 3], dtype=torch.float64)  # 1.2 * 1.5 * 0.5 = 0.9; 3 -> cap
    torch.testing.assert_close(result.weights, expected)
    assert result.fraction_clipped == 0.5


def test_sequence_masked_weights_keep_token_ratios_of_kept_sequences() -> None:
    # Row 0: geometric mean sqrt(1.2 * 0.9) ~ 1.039 (kept). Row 1: sqrt(2 * 1.5) ~ 1.73 (dropped).
    train, gen = logprobs_with_ratios([[1.2, 0.9], [2.0, 1.5], [1.0, 1.0]])
    mask = torch.tensor([[1, 1], [1, 1], [0, 0]])
    result = sequence_masked_importance_weights(train, gen, mask, lo=0.8, hi=1.25)
    expected = torch.tensor([[1.2, 0.9], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(result.weights, expected)
    assert result.dropped.tolist() == [[False, False], [True, True], [False, False]]
    assert (result.num_units, result.fraction_dropped) == (2, 0.5)  # the empty row is not a unit


def test_bf16_weights_are_computed_in_float32() -> None:
    train = torch.tensor([[-0.5]], dtype=torch.bfloat16)
    gen = torch.tensor([[-0.75]], dtype=torch.bfloat16)
    weights = truncated_importance_weights(train, gen, torch.ones(1, 1)).weights
    assert weights.dtype == torch.float32
    assert weights.item() == pytest.approx(math.exp(0.25), rel=1e-6)


def test_all_masked_batch_gives_zero_weights_and_zero_fractions() -> None:
    train = torch.full((2, 3), NAN)
    gen = torch.full((2, 3), -1.0)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for result in (
        truncated_importance_weights(train, gen, mask),
        masked_importance_weights(train, gen, mask, lo=0.5, hi=2.0),
        sequence_truncated_importance_weights(train, gen, mask),
        sequence_masked_importance_weights(train, gen, mask, lo=0.5, hi=2.0),
    ):
        assert torch.equal(result.weights, torch.zeros(2, 3))
        assert (result.num_units, result.fraction_clipped, result.fraction_dropped) == (0, 0.0, 0.0)


# --- properties ----------------------------------------------------------------------------

caps = st.floats(0.05, 50.0)
bounds = st.tuples(st.floats(0.0, 2.0), st.floats(0.01, 50.0)).filter(lambda pair: pair[0] < pair[1])


@PROPERTY_SETTINGS
@given(logprob_batches(), caps, st.floats(0.0, 1.0))
def test_truncated_weights_lie_in_floor_cap_and_vanish_when_masked(batch, cap: float, floor_share: float) -> None:
    train, gen, mask = batch
    floor = floor_share * cap * 0.99
    for result in (
        truncated_importance_weights(train, gen, mask, cap=cap, floor=floor),
        sequence_truncated_importance_weights(train, gen, mask, cap=cap),
    ):
        assert torch.all(result.weights[~mask] == 0.0)
        assert torch.all(result.weights >= 0.0) and torch.all(result.weights <= cap)
        assert not result.weights.requires_grad
    token_weights = truncated_importance_weights(train, gen, mask, cap=cap, floor=floor).weights
    assert torch.all(token_weights[mask] >= floor)


@PROPERTY_SETTINGS
@given(logprob_batches(), bounds)
def test_masked_weights_are_zero_or_within_bounds(batch, lo_hi: tuple[float, float]) -> None:
    train, gen, mask = batch
    lo, hi = lo_hi
    result = masked_importance_weights(train, gen, mask, lo=lo, hi=hi)
    kept = mask & ~result.dropped
    assert torch.all(result.weights[~kept] == 0.0)
    assert torch.all((result.weights[kept] >= lo) & (result.weights[kept] <= hi))
    assert not (result.dropped & ~mask).any()
    assert result.fraction_dropped == pytest.approx(int(result.dropped.sum()) / max(int(mask.sum()), 1))


@PROPERTY_SETTINGS
@given(logprob_batches(), st.floats(1.0, 50.0))
def test_equal_logprobs_give_weight_exactly_one(batch, cap: float) -> None:
    train, _, mask = batch
    for result in (
        truncated_importance_weights(train, train.clone(), mask, cap=cap),
        masked_importance_weights(train, train.clone(), mask, lo=1.0 / cap, hi=cap + 1.0),
        sequence_truncated_importance_weights(train, train.clone(), mask, cap=cap),
        sequence_masked_importance_weights(train, train.clone(), mask, lo=1.0 / cap, hi=cap + 1.0),
    ):
        assert torch.equal(result.weights, mask.float())
        assert result.fraction_clipped == result.fraction_dropped == 0.0


@PROPERTY_SETTINGS
@given(logprob_batches(), st.sampled_from(["mean", "sum"]), caps)
def test_sequence_weights_are_constant_within_a_sequence(batch, aggregation: str, cap: float) -> None:
    train, gen, mask = batch
    weights = sequence_truncated_importance_weights(train, gen, mask, cap=cap, aggregation=aggregation).weights
    for row_weights, row_mask in zip(weights, mask):
        valid_weights = row_weights[row_mask]
        assert torch.all(valid_weights == valid_weights[:1])


@PROPERTY_SETTINGS
@given(logprob_batches(), st.sampled_from([NAN, INF, -INF, 0.0]))
def test_masked_positions_change_no_weight(batch, junk: float) -> None:
    train, gen, mask = batch
    junk_train, junk_gen = torch.where(mask, train, junk), torch.where(mask, gen, junk)
    variants = (
        lambda t, g: truncated_importance_weights(t, g, mask, cap=2.0),
        lambda t, g: masked_importance_weights(t, g, mask, lo=0.5, hi=2.0),
        lambda t, g: sequence_truncated_importance_weights(t, g, mask, cap=2.0),
        lambda t, g: sequence_masked_importance_weights(t, g, mask, lo=0.5, hi=2.0),
    )
    for variant in variants:
        clean, dirty = variant(train, gen), variant(junk_train, junk_gen)
        assert torch.equal(clean.weights, dirty.weights) and torch.equal(clean.dropped, dirty.dropped)
        assert (clean.fraction_clipped, clean.fraction_dropped) == (dirty.fraction_clipped, dirty.fraction_dropped)


# --- loss helper ---------------------------------------------------------------------------


def test_token_mean_loss_hand_computed() -> None:
    loss = torch.tensor([[1.0, 2.0, NAN], [3.0, 4.0, 5.0]])
    weights = torch.tensor([[0.5, 1.0, 0.0], [2.0, 0.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # (0.5 + 2 + 6 + 0 + 5) / 5 valid tokens
    assert importance_weighted_loss(loss, weights, mask).item() == pytest.approx(13.5 / 5)


def test_seq_mean_token_mean_loss_hand_computed() -> None:
    loss = torch.tensor([[1.0, 2.0, NAN], [3.0, 4.0, 5.0], [7.0, 7.0, 7.0]])
    weights = torch.tensor([[0.5, 1.0, 0.0], [2.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    # row 0: (0.5 + 2) / 2 = 1.25; row 1: (6 + 0 + 5) / 3 = 11/3; row 2 has no valid token: left out.
    expected = (1.25 + 11 / 3) / 2
    assert importance_weighted_loss(loss, weights, mask, "seq-mean-token-mean").item() == pytest.approx(expected)


@pytest.mark.parametrize("reduction", ["token-mean", "seq-mean-token-mean"])
def test_all_masked_loss_is_zero_with_zero_gradient(reduction: str) -> None:
    loss = torch.tensor([[1.0, NAN]], requires_grad=True)
    result = importance_weighted_loss(loss, torch.ones(1, 2), torch.zeros(1, 2), reduction)
    result.backward()
    assert result.item() == 0.0
    assert torch.equal(loss.grad, torch.zeros(1, 2))


@pytest.mark.parametrize("reduction", ["token-mean", "seq-mean-token-mean"])
def test_normalizer_makes_micro_batch_losses_add_up(reduction: str) -> None:
    generator = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=generator)
    weights = torch.rand(6, 5, generator=generator)
    mask = torch.rand(6, 5, generator=generator) > 0.3
    mask[:, 0] = True
    full = importance_weighted_loss(loss, weights, mask, reduction)
    total = int(mask.sum()) if reduction == "token-mean" else mask.shape[0]
    halves = sum(
        importance_weighted_loss(loss[rows], weights[rows], mask[rows], reduction, normalizer=total)
        for rows in (slice(0, 2), slice(2, 6))
    )
    torch.testing.assert_close(halves, full)


@pytest.mark.parametrize("reduction", ["token-mean", "seq-mean-token-mean"])
def test_gradient_reaches_current_logprobs_only(reduction: str) -> None:
    train = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.2, -3.0]], requires_grad=True)
    gen = torch.tensor([[-1.2, -1.0, -0.5], [-1.0, -0.3, -2.0]], requires_grad=True)
    current = train.detach().clone().requires_grad_(True)
    advantages = torch.tensor([[1.0], [-2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    importance = truncated_importance_weights(train, gen, mask, cap=2.0)
    assert not importance.weights.requires_grad
    per_token_loss = -advantages * torch.exp(current - train.detach())
    importance_weighted_loss(per_token_loss, importance.weights, mask, reduction).backward()
    assert train.grad is None and gen.grad is None
    # d/d current of -A * w * exp(current - train) / N, at current == train: -A * w / N per valid token.
    if reduction == "token-mean":
        expected = -advantages * importance.weights.float() / 5
    else:
        expected = -advantages * importance.weights.float() / torch.tensor([[2.0], [3.0]]) / 2
    torch.testing.assert_close(current.grad, torch.where(mask.bool(), expected, 0.0))


def test_weights_that_require_grad_are_detached_by_the_loss() -> None:
    weights = torch.tensor([[0.5, 2.0]], requires_grad=True)
    loss = torch.tensor([[1.0, 3.0]], requires_grad=True)
    importance_weighted_loss(loss, weights, torch.ones(1, 2)).backward()
    assert weights.grad is None
    torch.testing.assert_close(loss.grad, torch.tensor([[0.25, 1.0]]))


def test_bf16_loss_is_reduced_in_float32() -> None:
    loss = torch.tensor([[1.0, 3.0]], dtype=torch.bfloat16)
    result = importance_weighted_loss(loss, torch.tensor([[1.0, 1.0]]), torch.ones(1, 2))
    assert result.dtype == torch.float32 and result.item() == 2.0


# --- bad input ------------------------------------------------------------------------------

TRAIN, GEN, MASK = torch.full((2, 3), -1.0), torch.full((2, 3), -1.2), torch.ones(2, 3)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: truncated_importance_weights(TRAIN, GEN, MASK, cap=0.0), "cap must be > 0"),
        (lambda: truncated_importance_weights(TRAIN, GEN, MASK, cap=-1.0), "cap must be > 0"),
        (lambda: truncated_importance_weights(TRAIN, GEN, MASK, cap=NAN), "NaN"),
        (lambda: truncated_importance_weights(TRAIN, GEN, MASK, cap=2.0, floor=2.0), "floor must be < cap"),
        (lambda: truncated_importance_weights(TRAIN, GEN, MASK, cap=2.0, floor=-0.1), "floor must be >= 0"),
        (lambda: sequence_truncated_importance_weights(TRAIN, GEN, MASK, cap=0.0), "cap must be > 0"),
        (lambda: sequence_truncated_importance_weights(TRAIN, GEN, MASK, aggregation="max"), "aggregation"),
        (lambda: masked_importance_weights(TRAIN, GEN, MASK, lo=2.0, hi=2.0), "lo must be < hi"),
        (lambda: masked_importance_weights(TRAIN, GEN, MASK, lo=3.0, hi=2.0), "lo must be < hi"),
        (lambda: masked_importance_weights(TRAIN, GEN, MASK, lo=-1.0, hi=2.0), "lo must be >= 0"),
        (lambda: sequence_masked_importance_weights(TRAIN, GEN, MASK, lo=1.0, hi=0.5), "lo must be < hi"),
        (lambda: sequence_masked_importance_weights(TRAIN, GEN, MASK, lo=0.5, hi=2, aggregation="x"), "aggregation"),
        (lambda: truncated_importance_weights(TRAIN, GEN.long(), MASK), "floating dtype"),
        (lambda: truncated_importance_weights(TRAIN, GEN[:, :2], MASK), "shape"),
        (lambda: masked_importance_weights(TRAIN, GEN, MASK * 3, lo=0.5, hi=2.0), "only 0 and 1"),
        (lambda: sequence_truncated_importance_weights(TRAIN.masked_fill(MASK.bool(), NAN), GEN, MASK), "non-finite"),
        (lambda: importance_weighted_loss(TRAIN, GEN, MASK, "seq-mean"), "reduction"),
        (lambda: importance_weighted_loss(TRAIN, GEN[:, :2], MASK), "weights shape"),
        (lambda: importance_weighted_loss(TRAIN, GEN.long(), MASK), "floating dtype"),
        (lambda: importance_weighted_loss(TRAIN, -GEN, MASK.long() + 1), "only 0 and 1"),
        (lambda: importance_weighted_loss(TRAIN, GEN, MASK), "weights must be >= 0"),
        (lambda: importance_weighted_loss(TRAIN, torch.full((2, 3), INF), MASK), "weights has .* non-finite"),
        (lambda: importance_weighted_loss(TRAIN.masked_fill(MASK.bool(), NAN), -GEN, MASK), "per_token_loss"),
        (lambda: importance_weighted_loss(TRAIN, -GEN, MASK, normalizer=0), "normalizer"),
        (lambda: importance_weighted_loss(TRAIN, -GEN, MASK, normalizer=NAN), "normalizer"),
    ],
)
def test_bad_arguments_raise_value_error(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.gpu
def test_cuda_results_match_cpu() -> None:
    generator = torch.Generator().manual_seed(7)
    train = -3.0 * torch.rand(4, 9, generator=generator)
    gen = train + 0.3 * torch.randn(4, 9, generator=generator)
    mask = torch.rand(4, 9, generator=generator) > 0.2
    per_token_loss = torch.randn(4, 9, generator=generator)
    results = {}
    for device in ("cpu", "cuda"):
        args = [t.to(device) for t in (train, gen, mask)]
        importance = sequence_masked_importance_weights(*args, lo=0.9, hi=1.1)
        loss = importance_weighted_loss(per_token_loss.to(device), importance.weights, args[2], "seq-mean-token-mean")
        truncated = truncated_importance_weights(*args, cap=1.5)
        results[device] = (importance.weights.cpu(), truncated.weights.cpu(), loss.cpu(), truncated.fraction_clipped)
    for cpu_value, cuda_value in zip(results["cpu"], results["cuda"]):
        torch.testing.assert_close(cuda_value, cpu_value)
