"""Token log-probs and policy steps as TRL 1.16.0's GRPOTrainer computes them, for its policy
converted by `make_bitwise`.

`TrlGRPOScorer(model, cfg, tokenizer, temperature)` with a bitwise `cfg` converts `model`, patches TRL's
`add_fused_lm_head` (`patch_stack_logprobs("trl")`; `patch_logprobs=False` keeps TRL's own head, to
show what the patch changes); with the fast mode's `cfg` or None it leaves the model and TRL's head
as they are (TRL's own trainer, against an fp8_align fast engine or TRL's own BF16 one). Then it
builds TRL's own `GRPOTrainer` around the model: without vLLM (the batches come from the caller, as the engine's rollouts would), or with
`colocate_engine` (GRPOConfig fields over this file's, e.g. `vllm_gpu_memory_utilization` and
`per_device_train_batch_size`, which sets the engine's `max_num_seqs`) in TRL's colocate mode, where TRL builds its own
engine through `patch_trl_engine(cfg)` (TRL's unpatched BF16 engine for `cfg` None; `engine`) and
syncs it with its own `sync_weights` (`sync`), with `vllm_importance_sampling_correction` off (what a
bitwise engine makes exactly 1; for the other engines the caller measures the mismatch it corrects).
Then:
- `token_logprobs(sequences, prompt_lens)`: the batch as TRL's `_generate_and_score_completions`
  hands it on (prompts left-padded, completions right-padded, their masks) through the trainer's
  `_get_per_token_logps_and_entropies`: its labels, its autocast, the fused-head forward.
- `policy_step(...)`: the trainer's `compute_loss` (TRL's GRPO loss, its default `dapo` form) per
  micro-batch with the engine's log-probs as `old_per_token_logps`, backward, gradient clipping,
  the optimizer step.

What is not TRL's own here: the batch dictionary (TRL builds it from vLLM's outputs in
`_generate_and_score_completions`) and the loop over micro-batches with its optimizer step (TRL's
`Trainer.train`, which would also generate). Used by tests/trl_checks.py.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pyarrow as pa
import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from benchmarks.rollout_batch import clip_and_step, left_right_padded

from fp8_align import FP8Config
from fp8_align.hf_training import make_bitwise, patch_stack_logprobs
from fp8_align.trl_engine import patch_trl_engine

#: TRL's `max_grad_norm` (transformers' TrainingArguments default).
MAX_GRAD_NORM = 1.0
#: The pad id of the batches built here; masked, so never scored.
PAD_ID = 0


def no_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """A reward function for the trainer's construction; the caller brings the advantages."""
    return [0.0] * len(completions)


class TrlGRPOScorer:
    """TRL 1.16.0's GRPOTrainer over a converted policy (module docstring)."""

    def __init__(
        self, model: torch.nn.Module, cfg: FP8Config | None, tokenizer: Any, temperature: float, patch_logprobs: bool = True,
        colocate_engine: dict[str, Any] | None = None,
    ) -> None:  # fmt: skip
        if cfg is not None and cfg.on_policy == "bitwise":
            make_bitwise(model, cfg)
            if patch_logprobs:
                patch_stack_logprobs("trl")
        if colocate_engine is not None and cfg is not None:
            patch_trl_engine(cfg)
        cpu = next(model.parameters()).device.type == "cpu"
        # TRL's trainer needs an output directory and writes nothing there (save_strategy "no");
        # it is removed with this scorer
        self._output_dir = tempfile.TemporaryDirectory(prefix="fp8_align_trl_")
        settings = {
            "output_dir": self._output_dir.name, "temperature": temperature, "per_device_train_batch_size": 2,
            "num_generations": 2, "max_grad_norm": MAX_GRAD_NORM, "bf16": True, "use_cpu": cpu, "report_to": "none", "save_strategy": "no",
            "use_vllm": colocate_engine is not None,
            # off: the bitwise engine's log-probs are the trainer's, so TRL's correction would be exp(0) = 1 on every token
            # (docs/on_policy.md, "TRL"); on, its compute_loss reads a ratio its rollout builds, which the caller's batches lack
            **({"vllm_mode": "colocate", "vllm_importance_sampling_correction": False, **colocate_engine} if colocate_engine is not None else {}),
        }  # fmt: skip
        args = GRPOConfig(**settings)
        # a fingerprint given: datasets 5.2 cannot hash a pyarrow 26 table with dill 0.4 to make one
        prompts = Dataset(pa.table({"prompt": ["unused: the caller brings the rollouts"] * 2}), fingerprint="fp8_align_trl_scorer")
        self.trainer = GRPOTrainer(model=model, reward_funcs=no_reward, args=args, train_dataset=prompts, processing_class=tokenizer)
        self.trainer.current_gradient_accumulation_steps = args.gradient_accumulation_steps  # as Trainer's loop sets it
        self.model, self.temperature = self.trainer.model, temperature
        self.device = next(self.model.parameters()).device

    @property
    def engine(self) -> Any:
        """The `vllm.LLM` TRL built in colocate mode (`colocate_engine` given)."""
        return self.trainer.vllm_generation.llm

    def sync(self) -> None:
        """TRL's own weight sync of the trainer's parameters into its colocate engine."""
        self.trainer.vllm_generation.sync_weights()

    def _batch(self, sequences: list[list[int]], prompt_lens: list[int]) -> dict[str, torch.Tensor]:
        padded = left_right_padded(sequences, prompt_lens, self.device, PAD_ID)
        return {"prompt_ids": padded["prompt_ids"], "prompt_mask": padded["prompt_mask"],
                "completion_ids": padded["response_ids"], "completion_mask": padded["response_mask"]}  # fmt: skip

    def _check(self, temperature: float) -> None:
        if temperature != self.temperature:
            raise ValueError(f"this trainer was built for temperature {self.temperature} (TRL fixes it at construction); asked for {temperature}")

    def token_logprobs(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float) -> list[torch.Tensor]:
        """Per sequence, FP32 [len - prompt_len] log-probs of its completion tokens as TRL's
        `_get_per_token_logps_and_entropies` returns them (no gradient). Raises ValueError for a
        temperature other than the trainer's."""
        self._check(temperature)
        batch = self._batch(sequences, prompt_lens)
        with torch.no_grad():
            logps, _, _ = self.trainer._get_per_token_logps_and_entropies(
                self.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1),
                torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1), batch["completion_ids"].shape[1],
            )  # fmt: skip
        return [row[: len(seq) - p] for row, seq, p in zip(logps, sequences, prompt_lens, strict=True)]

    def policy_step(
        self, sequences: list[list[int]], prompt_lens: list[int], temperature: float, old_logprobs: list[torch.Tensor],
        advantages: list[float], optimizer: torch.optim.Optimizer, micro_batch_size: int = 2,
    ) -> dict[str, float]:  # fmt: skip
        """One GRPO update over the batch: TRL's `compute_loss` per micro-batch (`num_items_in_batch`:
        the whole batch's completion tokens), backward, `clip_grad_norm_` to `MAX_GRAD_NORM`, the
        optimizer step. Returns {"loss": summed loss, "grad_norm": norm before clipping}. Raises
        ValueError when the trainer corrects for the engine with importance sampling (TRL builds that
        ratio in its rollout, which this batch does not come from)."""
        self._check(temperature)
        if self.trainer.use_vllm and self.trainer.vllm_importance_sampling_correction:
            raise ValueError("vllm_importance_sampling_correction is on: TRL's compute_loss needs the ratio its own rollout builds; "
                             "build the scorer with it off (the bitwise engine's log-probs are the trainer's)")
        tokens = torch.tensor(float(sum(len(seq) - p for seq, p in zip(sequences, prompt_lens, strict=True))), device=self.device)
        optimizer.zero_grad()
        total = 0.0
        for start in range(0, len(sequences), micro_batch_size):
            part = slice(start, start + micro_batch_size)
            inputs = self._batch(sequences[part], prompt_lens[part])
            old = torch.zeros(inputs["completion_ids"].shape, dtype=torch.float32, device=self.device)
            for row, logprobs in enumerate(old_logprobs[part]):
                old[row, : len(logprobs)] = logprobs.to(self.device)
            inputs.update(old_per_token_logps=old, num_items_in_batch=tokens,
                          advantages=torch.tensor(advantages[part], dtype=torch.float32, device=self.device))  # fmt: skip
            loss = self.trainer.compute_loss(self.model, inputs)
            loss.backward()
            total += loss.item()
        return {"loss": total, "grad_norm": clip_and_step(self.model.parameters(), optimizer, MAX_GRAD_NORM)}
