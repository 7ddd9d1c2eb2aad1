"""What the stacks' actors share in benchmarks/verl_scorer.py and benchmarks/openrlhf_scorer.py: the
rollout batch as both trainers receive it (prompts left-padded, responses right-padded) and the
end of a policy step (gradient clipping, then the optimizer step)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def left_right_padded(sequences: list[list[int]], prompt_lens: list[int], device: torch.device, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """`sequences` (prompt + completion token ids) split at `prompt_lens`: `prompt_ids` [B, P]
    left-padded and `response_ids` [B, R] right-padded with `pad_id`, and their 0/1 masks
    `prompt_mask` [B, P], `response_mask` [B, R] (int64, on `device`)."""
    prompts = [seq[:p] for seq, p in zip(sequences, prompt_lens, strict=True)]
    responses = [seq[p:] for seq, p in zip(sequences, prompt_lens, strict=True)]
    width_p, width_r = max(map(len, prompts)), max(map(len, responses))
    rows = {
        "prompt_ids": [[pad_id] * (width_p - len(p)) + p for p in prompts],
        "response_ids": [r + [pad_id] * (width_r - len(r)) for r in responses],
        "prompt_mask": [[0] * (width_p - len(p)) + [1] * len(p) for p in prompts],
        "response_mask": [[1] * len(r) + [0] * (width_r - len(r)) for r in responses],
    }
    return {name: torch.tensor(value, device=device) for name, value in rows.items()}


def clip_and_step(parameters: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer, max_norm: float) -> float:
    """`clip_grad_norm_` to `max_norm`, the optimizer step, gradients zeroed; returns the norm before
    clipping. Raises FloatingPointError for a non-finite norm, before the step."""
    grad_norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm=max_norm)
    if not torch.isfinite(grad_norm):
        raise FloatingPointError(f"non-finite gradient norm {grad_norm.item()}")
    optimizer.step()
    optimizer.zero_grad()
    return grad_norm.item()
