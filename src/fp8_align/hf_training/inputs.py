"""Host-side checks of what `BitwiseForward` is asked to score, before any kernel runs: on CUDA an
out-of-range token id or position is a device-side assert that ruins the process, and a length
mismatch between arguments would silently drop sequences."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def check_sequences(sequences: Sequence[Sequence[int]], vocab_size: int, max_positions: int) -> None:
    """ValueError naming the first bad sequence unless `sequences` is a non-empty list of non-empty
    token-id lists, every id an integer in [0, vocab_size), every sequence at most `max_positions`
    tokens long (the model's position table)."""
    if len(sequences) == 0:
        raise ValueError("no sequences given")
    for i, seq in enumerate(sequences):
        if len(seq) == 0:
            raise ValueError(f"sequence {i} is empty")
        if len(seq) > max_positions:
            raise ValueError(f"sequence {i} has {len(seq)} tokens; the model has {max_positions} positions (max_position_embeddings)")
    try:
        ids = torch.tensor([t for seq in sequences for t in seq])
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        raise ValueError(f"token ids must be integers: {exc}") from exc
    if ids.dtype != torch.long:
        raise ValueError(f"token ids must be integers, got {ids.dtype} values")
    bad = ((ids < 0) | (ids >= vocab_size)).nonzero()
    if bad.numel():
        flat = int(bad[0, 0])
        ends = torch.tensor([len(seq) for seq in sequences]).cumsum(0)
        seq = int(torch.searchsorted(ends, flat, right=True))
        position = flat - (int(ends[seq - 1]) if seq else 0)
        raise ValueError(f"sequence {seq}, position {position}: token id {int(ids[flat])} is outside the vocabulary [0, {vocab_size})")


def check_prompt_lens(sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> None:
    """ValueError naming the first bad entry unless there is one prompt length per sequence and
    each is an integer in 1..len(sequence) - 1 (a prompt of one token or more and at least one
    completion token to score)."""
    if len(prompt_lens) != len(sequences):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt_lens: one prompt length per sequence")
    for i, (seq, prompt) in enumerate(zip(sequences, prompt_lens)):
        if isinstance(prompt, bool) or int(prompt) != prompt:
            raise ValueError(f"sequence {i}: prompt_len {prompt!r} is not an integer")
        if not 0 < prompt < len(seq):
            raise ValueError(
                f"sequence {i}: prompt_len {prompt} is outside 1..{len(seq) - 1} (the sequence has {len(seq)} tokens; "
                "a prompt of at least one token and at least one completion token to score)"
            )


#: vLLM's sampler treats a request with a temperature below this as greedy (`_SAMPLING_EPS`,
#: vllm/v1/sample/sampler.py, 0.22 and 0.32), and its processed log-probs are then undivided.
GREEDY_TEMPERATURE = 1e-5


def check_temperature(temperature: float) -> None:
    """ValueError unless `temperature` is a finite number of at least GREEDY_TEMPERATURE."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature):
        raise ValueError(f"temperature {temperature!r} is not a finite number")
    if temperature < GREEDY_TEMPERATURE:
        raise ValueError(
            f"temperature {temperature!r}: vLLM samples greedily below {GREEDY_TEMPERATURE} and its processed log-probs "
            "are then those of the undivided logits: pass temperature=1.0"
        )

