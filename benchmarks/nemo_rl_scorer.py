"""Token log-probs and policy steps as NeMo RL's DTensor policy computes them, for its model
converted by `make_bitwise`.

NeMo RL's own code, vendored unmodified at commit 7ea279a in tests/third_party/nemo_rl_dtensor
(SOURCE.md there), with `patch_stack_logprobs("nemo_rl")`:
- `token_logprobs(sequences, prompt_lens, temperature)`: the rollout batch as NeMo RL's policy
  hands it to its `DTensorPolicyWorkerV2.get_logprobs` (right-padded `input_ids`, `input_lengths`),
  sharded with its sequence-packing arguments (`BatchedDataDict.shard_by_batch_size`, the
  `modified_first_fit_decreasing` packer, `logprob_mb_tokens`), its packed micro-batches
  (`make_microbatch_iterator_for_packable_sequences`, `make_processed_microbatch_iterator`), per
  micro-batch `forward_with_post_processing_fn` with its `LogprobsPostProcessor` and
  `TrainingSamplingParams(temperature=T)`, and its re-ordering of the results.
- `policy_step(...)`: its worker's `train` body on that batch: the packed micro-batches of
  `train_mb_tokens`, `automodel_forward_backward` with its `LossPostProcessor` around its
  `ClippedPGLossFn` (its GRPO defaults: clip 0.2, KL k3 at 0.01 against the step's reference),
  gradient clipping, the optimizer step.

Not NeMo RL's own, because it cannot run in this process: the worker (a Ray actor that builds the
model with NeMo Automodel under FSDP2 on a device mesh); its `get_logprobs` and `train` bodies are
followed call for call at data, tensor and context parallel size 1. Its `get_microbatch_iterator`
and `process_global_batch` all-reduce counts over the data-parallel group, which at one rank adds
no micro-batch and changes no count: the iterator below is the one they wrap, and the two counts are
computed as they compute them. Only the tokenizer's `eos_token_id` is read (the packing pad value).
NeMo RL's experiment logger `nemo_rl.utils.logger`, which nothing here calls, is stood in for
(`benchmarks/nemo_rl_path.py`).

NeMo RL 0.6.0 at that commit refuses transformers >= 5.12: this module runs with the pins of its
DTensor policy first on the path (`.cache/nemo_rl_site`, scripts/setup_cpu_env.sh), in a process of
its own (tests/test_nemo_rl_logprobs.py, benchmarks/stack_bitwise.py `--stack nemo_rl`).
"""

from __future__ import annotations

import types
from typing import Any

import torch

import benchmarks.nemo_rl_path  # noqa: F401  (the vendored tree on the path, the logger's stand-in)
from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams  # noqa: E402
from nemo_rl.algorithms.loss.loss_functions import ClippedPGLossConfig, ClippedPGLossFn  # noqa: E402
from nemo_rl.distributed.batched_data_dict import BatchedDataDict  # noqa: E402
from nemo_rl.models.automodel.data import make_processed_microbatch_iterator  # noqa: E402
from nemo_rl.models.automodel.train import (  # noqa: E402
    LogprobsPostProcessor,
    LossPostProcessor,
    automodel_forward_backward,
    forward_with_post_processing_fn,
)

from benchmarks.rollout_batch import clip_and_step  # noqa: E402

from fp8_align.hf_training import patch_stack_logprobs  # noqa: E402

#: NeMo RL's `policy.max_grad_norm` in examples/configs/grpo_math_1B.yaml.
MAX_GRAD_NORM = 1.0


def policy_config(max_total_sequence_length: int, micro_batch_size: int) -> dict[str, Any]:
    """The keys of NeMo RL's policy config that its log-prob and train units read, as
    examples/configs/grpo_math_1B.yaml sets them (sequence packing on, dynamic batching off), with
    its token budgets `max_total_sequence_length * micro_batch_size`."""
    tokens = max_total_sequence_length * micro_batch_size
    return {
        "dynamic_batching": {"enabled": False},
        "sequence_packing": {"enabled": True, "train_mb_tokens": tokens, "logprob_mb_tokens": tokens, "algorithm": "modified_first_fit_decreasing"},
        "dtensor_cfg": {"sequence_parallel": False},
        "make_sequence_length_divisible_by": 1,
        "logprob_chunk_size": None,
    }


class NemoRLPolicyScorer:
    """NeMo RL's DTensor-policy log-prob and train units over a converted model (module docstring)."""

    def __init__(self, model: torch.nn.Module, eos_token_id: int, max_total_sequence_length: int = 1024, micro_batch_size: int = 8) -> None:
        self.model = model
        self.micro_batch_size = micro_batch_size
        self.cfg = policy_config(max_total_sequence_length, micro_batch_size)
        self.tokenizer = types.SimpleNamespace(eos_token_id=eos_token_id)
        self.device = next(model.parameters()).device
        patch_stack_logprobs("nemo_rl")

    def batch(self, sequences: list[list[int]], extra: dict[str, torch.Tensor] | None = None) -> BatchedDataDict[Any]:
        """`sequences` as NeMo RL's policy receives them: `input_ids` [B, S] right-padded (with the
        EOS id), `input_lengths` [B], and `extra`'s tensors."""
        lengths = [len(s) for s in sequences]
        input_ids = torch.full((len(sequences), max(lengths)), self.tokenizer.eos_token_id, dtype=torch.long)
        for row, seq in enumerate(sequences):
            input_ids[row, : len(seq)] = torch.tensor(seq)
        return BatchedDataDict({"input_ids": input_ids, "input_lengths": torch.tensor(lengths), **(extra or {})})

    def packed(self, data: BatchedDataDict[Any], budget_key: str) -> tuple[BatchedDataDict[Any], list[int]]:
        """`data` sharded for one rank with NeMo RL's sequence-packing arguments and the token budget
        `cfg["sequence_packing"][budget_key]`, on the model's device; and the order that undoes the
        packer's sorting."""
        packing = {
            "algorithm": self.cfg["sequence_packing"]["algorithm"], "input_key": "input_ids", "input_lengths_key": "input_lengths",
            "sequence_length_pad_multiple": self.cfg["make_sequence_length_divisible_by"],
            "max_tokens_per_microbatch": self.cfg["sequence_packing"][budget_key],
        }  # fmt: skip
        shards, unsorted = data.shard_by_batch_size(1, batch_size=None, sequence_packing_args=packing)
        shard = shards[0]
        shard.to(self.device)
        return shard, unsorted

    def _micro_batches(self, shard: BatchedDataDict[Any]) -> Any:
        return make_processed_microbatch_iterator(shard.make_microbatch_iterator_for_packable_sequences(), self.tokenizer, self.cfg, 1)

    def token_logprobs(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[torch.Tensor]:
        """Per sequence, FP32 [len - prompt_len] log-probs of its completion tokens at `temperature`,
        as NeMo RL's DTensor policy returns them (no gradient)."""
        sampling = TrainingSamplingParams(temperature=temperature)
        post = LogprobsPostProcessor(self.cfg, None, None, None, cp_size=1, enable_seq_packing=True, sampling_params=sampling)
        shard, unsorted = self.packed(self.batch(sequences), "logprob_mb_tokens")
        width = shard["input_ids"].shape[1]
        self.model.eval()
        parts = []
        with torch.no_grad():
            for micro_batch in self._micro_batches(shard):
                logprobs, _, _ = forward_with_post_processing_fn(self.model, post, micro_batch, sampling_params=sampling)
                parts.append(torch.nn.functional.pad(logprobs, (0, width - logprobs.shape[1])))
        result = BatchedDataDict({"logprobs": torch.cat(parts).cpu()})
        result.reorder_data(unsorted)
        return [row[p : len(seq)] for row, seq, p in zip(result["logprobs"], sequences, prompt_lens, strict=True)]

    def policy_step(
        self, sequences: list[list[int]], prompt_lens: list[int], temperature: float, old_logprobs: list[torch.Tensor],
        advantages: list[float], optimizer: torch.optim.Optimizer, micro_batch_size: int = 8,
    ) -> dict[str, float]:  # fmt: skip
        """One GRPO update over the batch as NeMo RL's DTensor policy trains (module docstring), with
        `old_logprobs` as its previous, generation and reference log-probs and `advantages` per
        sequence. NeMo RL packs micro-batches by a token budget set at construction: a
        `micro_batch_size` other than that construction's raises ValueError. Returns
        {"loss": summed loss, "grad_norm": norm before clipping}."""
        if micro_batch_size != self.micro_batch_size:
            raise ValueError(f"micro_batch_size {micro_batch_size}: this scorer packs by the budget of {self.micro_batch_size} sequences")
        width = max(len(s) for s in sequences)
        token_mask = torch.zeros(len(sequences), width)
        prev = torch.zeros(len(sequences), width)
        for row, (seq, p, lp) in enumerate(zip(sequences, prompt_lens, old_logprobs, strict=True)):
            token_mask[row, p : len(seq)] = 1.0
            prev[row, p : len(seq)] = lp.float().cpu()
        extra = {
            "advantages": torch.tensor(advantages, dtype=torch.float32)[:, None] * token_mask, "prev_logprobs": prev,
            "generation_logprobs": prev.clone(), "reference_policy_logprobs": prev.clone(), "token_mask": token_mask,
            "sample_mask": torch.ones(len(sequences)),
        }  # fmt: skip
        data = self.batch(sequences, extra)
        global_valid_seqs = data["sample_mask"].sum().to(self.device)
        global_valid_toks = (data["token_mask"][:, 1:] * data["sample_mask"].unsqueeze(-1)).sum().to(self.device)
        sampling = TrainingSamplingParams(temperature=temperature)
        loss_fn = ClippedPGLossFn(ClippedPGLossConfig())
        post = LossPostProcessor(loss_fn, self.cfg, None, None, None, cp_size=1, dp_size=1, enable_seq_packing=True, sampling_params=sampling)
        shard, _ = self.packed(data, "train_mb_tokens")
        self.model.train()
        optimizer.zero_grad()
        results = automodel_forward_backward(
            self.model, self._micro_batches(shard), post, global_valid_seqs=global_valid_seqs, global_valid_toks=global_valid_toks,
            sampling_params=sampling,
        )  # fmt: skip
        grad_norm = clip_and_step(self.model.parameters(), optimizer, MAX_GRAD_NORM)
        self.model.eval()
        return {"loss": sum(float(loss.detach()) for loss, _ in results), "grad_norm": grad_norm}
