"""The verifiable-reward task: two-operand addition, answered in a chat turn, reward = exact match.

Problems are every pair (a, b) with low <= a, b <= high; a fixed, seeded share of the pairs is
held out for validation and never trained on. The answer is the last integer in the completion
(as GSM8K-style graders read the final number); reward 1.0 if it equals a + b exactly, else 0.0.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

PROMPT_TEMPLATE = "What is {a} + {b}? Answer with the number only."
_INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Problem:
    """One addition problem: operands and the expected answer as text."""

    a: int
    b: int

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    @property
    def question(self) -> str:
        return PROMPT_TEMPLATE.format(a=self.a, b=self.b)


def split_problems(low: int, high: int, validation_fraction: float, seed: int) -> tuple[list[Problem], list[Problem]]:
    """(train, validation): all pairs in [low, high]^2, shuffled with `seed`, the first
    round(validation_fraction * count) pairs held out. Raises ValueError for an empty range or a
    fraction outside (0, 1)."""
    if high < low:
        raise ValueError(f"operand range [{low}, {high}] is empty")
    if not 0.0 < validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}")
    problems = [Problem(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    random.Random(seed).shuffle(problems)
    held_out = max(1, round(validation_fraction * len(problems)))
    if held_out >= len(problems):
        raise ValueError(f"{len(problems)} problems leave nothing to train on at validation_fraction={validation_fraction}")
    return problems[held_out:], problems[:held_out]


def final_integer(text: str) -> str | None:
    """The last integer written in `text` (an optional minus sign and digits), or None."""
    found = _INTEGER.findall(text)
    return found[-1] if found else None


def exact_match_reward(completion: str, problem: Problem) -> float:
    """1.0 if the completion's last integer is exactly the answer (no leading zeros), else 0.0."""
    return 1.0 if final_integer(completion) == problem.answer else 0.0


def prompt_token_ids(tokenizer: Any, problems: list[Problem]) -> list[list[int]]:
    """Chat-template token ids of each problem's user turn, generation prompt appended."""
    return [
        list(tokenizer.apply_chat_template([{"role": "user", "content": p.question}], tokenize=True, add_generation_prompt=True, return_dict=False))
        for p in problems
    ]


def step_batch(train: list[Problem], num_prompts: int, seed: int, step: int) -> list[Problem]:
    """The `num_prompts` training problems of `step`: a sample without replacement drawn by a
    generator seeded with (seed, step), so every arm of a run trains on the same problems."""
    if num_prompts > len(train):
        raise ValueError(f"{num_prompts} prompts per step but only {len(train)} training problems")
    return random.Random(f"{seed}:{step}").sample(train, num_prompts)
