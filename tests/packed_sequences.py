"""The bitwise trainer tests' sequences and how a stack feeds them to an HF model: packed into one
row with positions restarting at 0 (verl's remove-padding, OpenRLHF's packing), and the completion
tokens' log-probs picked from the model's logits."""

from __future__ import annotations

import torch

#: Three token-id sequences of 12, 33 and 5 tokens (vocabulary 1000) and their prompt lengths.
SEQUENCES = [[int(t) for t in torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n))] for n in (12, 33, 5)]
PROMPT_LENS = [3, 10, 2]


def packed_inputs(sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """`input_ids` [1, sum(len)] of the sequences side by side and `position_ids` restarting at 0."""
    return {
        "input_ids": torch.tensor([[t for s in sequences for t in s]]),
        "position_ids": torch.cat([torch.arange(len(s)) for s in sequences])[None],
    }


def packed_rows(sequences: list[list[int]]) -> list[list[int]]:
    """Per sequence, the rows of its tokens in the packed row."""
    starts = torch.tensor([0] + [len(s) for s in sequences]).cumsum(0).tolist()
    return [list(range(a, b)) for a, b in zip(starts, starts[1:])]


def completion_logprobs_from_logits(logits: torch.Tensor, sequences: list[list[int]], prompt_lens: list[int], rows: list[list[int]]) -> torch.Tensor:
    """The completion tokens' log-probs (`torch.log_softmax`) from `logits` [N, V] (FP32) whose rows
    `rows[i]` are sequence i's tokens, in order."""
    logprobs = torch.log_softmax(logits, dim=-1)
    return torch.cat([logprobs[row[p - 1 : len(s) - 1], s[p:]] for s, p, row in zip(sequences, prompt_lens, rows)])
