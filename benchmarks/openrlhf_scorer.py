"""Token log-probs and policy steps as OpenRLHF 0.11.2's actor computes them, for its model
converted by `make_bitwise`.

`OpenRLHFActorScorer(path, cfg, kv_scales)` builds OpenRLHF's own `Actor` from the checkpoint
(`packing_samples=True`, `attn_implementation="sdpa"`, which `make_bitwise` replaces like any other;
OpenRLHF's default flash-attention-2 needs flash-attn's kernels), converts `actor.model` and patches
OpenRLHF's `log_probs_from_logits` (`patch_stack_logprobs("openrlhf")`). Then:
- `token_logprobs(sequences, prompt_lens)`: the batch as OpenRLHF's experience maker hands it
  over (prompts left-padded, responses right-padded, attention and action masks) through
  `Actor.forward`: its unpadding into one packed row, the converted model, its log-probs, its
  re-padding. Temperature 1 only (docs/on_policy.md says why).
- `policy_step(...)`: OpenRLHF's PPO update on that batch: `Actor.forward` per micro-batch and its
  `PolicyLoss` (clip 0.2, token-level loss over the whole batch's tokens), backward, gradient
  clipping, the optimizer step.

OpenRLHF's `models/actor.py` imports deepspeed, peft and flash-attn's padding helpers: on the CPU
venv from `.cache/openrlhf_site` and `.cache/verl_site` (scripts/setup_cpu_env.sh). Used by
benchmarks/stack_bitwise.py (`--stack openrlhf`) and tests/test_stack_logprobs.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from openrlhf.models.actor import Actor
from openrlhf.models.loss import PolicyLoss

from benchmarks.rollout_batch import clip_and_step, left_right_padded

from fp8_align import FP8Config
from fp8_align.hf_training import make_bitwise, patch_stack_logprobs

#: OpenRLHF's pad token in the rollout batch here; the Actor unpads before the model.
PAD_ID = 0
#: `--max_norm` of OpenRLHF's trainer (its default).
MAX_GRAD_NORM = 1.0


def actor_batch(sequences: list[list[int]], prompt_lens: list[int], device: torch.device) -> dict[str, torch.Tensor]:
    """`sequences` (prompt + completion token ids) as OpenRLHF hands them to its Actor: prompts
    left-padded, responses right-padded (`PAD_ID`); `attention_mask` [B, S] over both, `action_mask`
    [B, R] over the responses."""
    padded = left_right_padded(sequences, prompt_lens, device, PAD_ID)
    return {
        "sequences": torch.cat([padded["prompt_ids"], padded["response_ids"]], dim=1),
        "attention_mask": torch.cat([padded["prompt_mask"], padded["response_mask"]], dim=1),
        "action_mask": padded["response_mask"],
    }


class OpenRLHFActorScorer:
    """OpenRLHF 0.11.2's Actor over a converted model (module docstring)."""

    def __init__(self, path: Path, cfg: FP8Config, kv_scales: Any = None, device: str = "cpu") -> None:
        self.actor = Actor(str(path), attn_implementation="sdpa", param_dtype="bf16", packing_samples=True).to(device)
        self.model = self.actor.model
        make_bitwise(self.model, cfg, kv_scales=kv_scales)
        patch_stack_logprobs("openrlhf")
        self.device = torch.device(device)

    def _action_logprobs(self, sequences: list[list[int]], prompt_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        batch = actor_batch(sequences, prompt_lens, self.device)
        out = self.actor(batch["sequences"], action_mask=batch["action_mask"], attention_mask=batch["attention_mask"])
        return out, batch["action_mask"]

    def token_logprobs(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[torch.Tensor]:
        """Per sequence, FP32 [len - prompt_len] log-probs of its completion tokens, as OpenRLHF's
        actor returns them (no gradient). Raises ValueError for a temperature other than 1."""
        if temperature != 1.0:
            raise ValueError(f"OpenRLHF's actor is bitwise at temperature 1 only; got {temperature}")
        with torch.no_grad():
            out, _ = self._action_logprobs(sequences, prompt_lens)
        return [row[: len(seq) - p] for row, seq, p in zip(out, sequences, prompt_lens, strict=True)]

    def policy_step(
        self, sequences: list[list[int]], prompt_lens: list[int], temperature: float, old_logprobs: list[torch.Tensor],
        advantages: list[float], optimizer: torch.optim.Optimizer, micro_batch_size: int = 8,
    ) -> dict[str, float]:  # fmt: skip
        """One PPO update over the batch, as OpenRLHF's `training_step` takes it per micro-batch:
        `PolicyLoss` with `batch_num_tokens` of the whole batch, backward, `clip_grad_norm_` to
        `MAX_GRAD_NORM`, the optimizer step. Returns {"loss": summed loss, "grad_norm": norm before
        clipping}."""
        if temperature != 1.0:
            raise ValueError(f"OpenRLHF's actor is bitwise at temperature 1 only; got {temperature}")
        loss_fn = PolicyLoss()
        batch_tokens = sum(len(seq) - p for seq, p in zip(sequences, prompt_lens, strict=True))
        optimizer.zero_grad()
        total = 0.0
        for start in range(0, len(sequences), micro_batch_size):
            part = slice(start, start + micro_batch_size)
            log_probs, action_mask = self._action_logprobs(sequences[part], prompt_lens[part])
            old = torch.zeros_like(log_probs)
            for row, lp in enumerate(old_logprobs[part]):
                old[row, : len(lp)] = lp.to(old.device)
            adv = torch.tensor(advantages[part], dtype=torch.float32, device=log_probs.device)[:, None] * action_mask
            loss = loss_fn(log_probs, old, adv, action_mask=action_mask, dp_size=1, batch_num_tokens=batch_tokens)[0]
            loss.backward()
            total += loss.item()
        grad_norm = clip_and_step(self.model.parameters(), optimizer, MAX_GRAD_NORM)
        return {"loss": total, "grad_norm": grad_norm}
