"""What the CPU tests of the stacks' own policy steps share (tests/test_stack_logprobs.py for verl
and OpenRLHF, tests/nemo_rl_dtensor_checks.py for NeMo RL): three of the stack's updates on a
converted model, and after each the engine side (`BitwiseForward` over a model holding the synced
weights, copied by `load_state_dict` in place of the stack's CUDA-IPC sync, which
benchmarks/stack_bitwise.py runs on the GPU) equal to the stack's log-probs bit for bit."""

from __future__ import annotations

from typing import Any

import torch

from fp8_align import FP8Config
from fp8_align.hf_training import BitwiseForward
from tests.packed_sequences import PROMPT_LENS, SEQUENCES

STEPS = 3


def assert_policy_steps_keep_the_engines_bits(scorer: Any, base: torch.nn.Module, trained: torch.nn.Module, cfg: FP8Config,
                                              temperature: float, micro_batch_size: int) -> None:  # fmt: skip
    """`scorer` (a stack's unit over `trained`, the converted copy of `base`: `token_logprobs`,
    `policy_step`) on `SEQUENCES`: before each of `STEPS` AdamW updates (advantages +-1) and after
    the last, its log-probs equal `BitwiseForward(base)` with `base` holding `trained`'s weights;
    every update has a finite loss and a positive gradient norm, and every matrix moved (the RMSNorm
    gains sit at 1.0, where a BF16 step is 2**-7 > the learning rate)."""
    optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-3)
    advantages = [1.0 if i % 2 else -1.0 for i in range(len(SEQUENCES))]
    start = {name: p.detach().clone() for name, p in trained.named_parameters() if p.dim() == 2}
    for step in range(STEPS + 1):
        with torch.no_grad():
            engine = BitwiseForward(base, cfg).token_logprobs(SEQUENCES, PROMPT_LENS, temperature=temperature)
        for mine, theirs in zip(scorer.token_logprobs(SEQUENCES, PROMPT_LENS, temperature), engine, strict=True):
            assert torch.equal(mine, theirs), f"off the engine's bits after {step} updates"
        if step == STEPS:
            break
        stats = scorer.policy_step(SEQUENCES, PROMPT_LENS, temperature, engine, advantages, optimizer, micro_batch_size=micro_batch_size)
        assert stats["grad_norm"] > 0 and torch.isfinite(torch.tensor(stats["loss"]))
        base.load_state_dict(trained.state_dict())
    still = [name for name, p in trained.named_parameters() if name in start and torch.equal(start[name], p)]
    assert not still, f"unchanged after {STEPS} updates: {still}"
