"""The contract of `frozen_fp8_weights` checked on one model, shared by the bitwise trainer's test
(tests/test_bitwise_model.py) and the aligned trainer's (tests/test_hf_training.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from fp8_align.hf_training import frozen_fp8_weights

#: One forward + backward: (outputs, {parameter name: gradient}, weight quantizations it ran).
Run = Callable[[], tuple[torch.Tensor, dict[str, torch.Tensor], int]]


def assert_frozen_block_contract(model: nn.Module, run: Run, per_forward: int, changed_weight: torch.Tensor) -> None:
    """`run()` on `model` (which quantizes `per_forward` weights outside a block): inside
    `frozen_fp8_weights(model)` its first run quantizes them all and its second none, both with the
    outputs and gradients of a run outside; a nested block raises ValueError; `changed_weight`
    changed in place inside the block makes the next run raise RuntimeError; after the block the
    changed weight is quantized again and used."""
    plain_out, plain_grads, count = run()
    assert count == per_forward
    with frozen_fp8_weights(model):
        for expected in (per_forward, 0):
            out, grads, count = run()
            assert count == expected
            assert torch.equal(out, plain_out)
            assert grads.keys() == plain_grads.keys() and all(torch.equal(grads[name], plain_grads[name]) for name in grads)
        with pytest.raises(ValueError, match="already inside"):
            with frozen_fp8_weights(model):
                pass
        with torch.no_grad():
            changed_weight.mul_(2)
        with pytest.raises(RuntimeError, match="changed in place inside frozen_fp8_weights"):
            run()
    changed_out, _, count = run()
    assert count == per_forward and not torch.equal(changed_out, plain_out)
