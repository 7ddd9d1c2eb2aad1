"""Hypothesis strategies and settings shared by the metrics and importance-sampling tests."""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st

NAN, INF = float("nan"), float("inf")
PROPERTY_SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def logprob_batches(draw: st.DrawFn, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """(train, gen, mask): [B, T] log-probs in [-20, 0] and a bool mask, B in 1..4, T in 1..6."""
    rows, cols = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    logprob = st.floats(-20.0, 0.0, allow_nan=False, width=32)
    values = st.lists(logprob, min_size=rows * cols, max_size=rows * cols)
    train = torch.tensor(draw(values), dtype=dtype).reshape(rows, cols)
    gen = torch.tensor(draw(values), dtype=dtype).reshape(rows, cols)
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=rows * cols, max_size=rows * cols))).reshape(rows, cols)
    return train, gen, mask
