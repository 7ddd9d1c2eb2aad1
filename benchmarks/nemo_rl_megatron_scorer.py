"""Token log-probs as NeMo RL's Megatron policy computes them, for a bitwise megatron-core GPTModel
(`fp8_align.megatron_ext.bitwise.build_bitwise_gpt`).

NeMo RL's own code, vendored unmodified at commit 7ea279a in tests/third_party/nemo_rl_dtensor
(SOURCE.md there), with `patch_stack_logprobs("nemo_rl_megatron")`: the rollout batch as its
`MegatronPolicyWorker.get_logprobs` receives it (right-padded `input_ids`, `input_lengths`), sharded
with its sequence-packing arguments (`shard_by_batch_size`, the `modified_first_fit_decreasing`
packer, `logprob_mb_tokens`) as `lm_policy._shard_for_logprob` does at one data-parallel rank, its
`get_microbatch_iterator` (THD-packed micro-batches with `cu_seqlens`, padded to
`make_sequence_length_divisible_by`), its `LogprobsPostProcessor` with `TrainingSamplingParams(T)`,
on CUDA through its `megatron_forward_backward` (megatron-core's own pipeline schedule, forward
only), then the worker's padding of each micro-batch to the batch's length, concatenation and
re-ordering.

Not NeMo RL's own: the worker around that body (a Ray actor that builds the model with
Megatron-Bridge and wraps it in Megatron's `Float16Module`; the bitwise GPTModel is passed as it is),
and the stand-ins of `benchmarks/nemo_rl_path.py`. On CPU megatron-core's schedule allocates on CUDA,
so there each micro-batch runs NeMo RL's `forward_with_post_processing_fn` directly, which is what the
schedule's forward step calls at pipeline parallel size 1.
"""

from __future__ import annotations

from typing import Any

import torch

import benchmarks.nemo_rl_path  # noqa: F401  (the vendored tree on the path, stand-ins)
from nemo_rl.algorithms.logits_sampling_utils import TrainingSamplingParams  # noqa: E402
from nemo_rl.distributed.batched_data_dict import BatchedDataDict  # noqa: E402
from nemo_rl.models.megatron.data import get_microbatch_iterator  # noqa: E402
from nemo_rl.models.megatron.train import LogprobsPostProcessor, forward_with_post_processing_fn, megatron_forward_backward  # noqa: E402

from fp8_align.hf_training import patch_stack_logprobs  # noqa: E402

#: NeMo RL's `policy.logprob_batch_size` with sequence packing (micro-batches are token budgets then).
LOGPROB_BATCH_SIZE = 1


def policy_config(max_tokens_per_microbatch: int, sequence_length_multiple: int) -> dict[str, Any]:
    """The keys of NeMo RL's policy config that its Megatron log-prob unit reads, as its Megatron GRPO
    configs set them (sequence packing on, dynamic batching off, parallel sizes 1, no chunking)."""
    return {
        "dynamic_batching": {"enabled": False},
        "sequence_packing": {"enabled": True, "logprob_mb_tokens": max_tokens_per_microbatch, "algorithm": "modified_first_fit_decreasing"},
        "megatron_cfg": {"tensor_model_parallel_size": 1, "sequence_parallel": False, "pipeline_model_parallel_size": 1,
                         "context_parallel_size": 1, "defer_fp32_logits": False},
        "make_sequence_length_divisible_by": sequence_length_multiple,
        "logprob_batch_size": LOGPROB_BATCH_SIZE,
        "logprob_chunk_size": None,
    }  # fmt: skip


class NemoRLMegatronScorer:
    """`token_logprobs(sequences, prompt_lens, temperature)` of `gpt` through NeMo RL's Megatron log-prob
    unit (module docstring); `pad_id` fills the right padding, `max_tokens_per_microbatch` is its
    `logprob_mb_tokens`, `sequence_length_multiple` its `make_sequence_length_divisible_by`."""

    def __init__(self, gpt: torch.nn.Module, pad_id: int, max_tokens_per_microbatch: int, sequence_length_multiple: int = 1) -> None:
        patch_stack_logprobs("nemo_rl_megatron")
        self.gpt, self.pad_id = gpt, pad_id
        self.cfg = policy_config(max_tokens_per_microbatch, sequence_length_multiple)

    def token_logprobs(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[torch.Tensor]:
        """Per sequence, its completion tokens' FP32 log-probs as NeMo RL's worker returns them."""
        cfg, sampling = self.cfg, TrainingSamplingParams(temperature=temperature)
        lengths = [len(s) for s in sequences]
        ids = torch.full((len(sequences), max(lengths)), self.pad_id, dtype=torch.long)
        for row, seq in enumerate(sequences):
            ids[row, : len(seq)] = torch.tensor(seq)
        data = BatchedDataDict({"input_ids": ids, "input_lengths": torch.tensor(lengths)})
        packing = {"algorithm": cfg["sequence_packing"]["algorithm"], "input_key": "input_ids", "input_lengths_key": "input_lengths",
                   "sequence_length_pad_multiple": cfg["make_sequence_length_divisible_by"],
                   "max_tokens_per_microbatch": cfg["sequence_packing"]["logprob_mb_tokens"]}  # fmt: skip
        shards, unsorted = data.shard_by_batch_size(1, batch_size=None, sequence_packing_args=packing)
        with torch.no_grad():
            iterator, count, mbs, seq_length, padded = get_microbatch_iterator(shards[0], cfg, cfg["logprob_batch_size"], straggler_timer=None)
            post = LogprobsPostProcessor(cfg=cfg, sampling_params=sampling)
            if torch.cuda.is_available():
                outputs = megatron_forward_backward(model=self.gpt, data_iterator=iterator, seq_length=padded, mbs=mbs, num_microbatches=count,
                                                    post_processing_fn=post, forward_only=True, sampling_params=sampling)  # fmt: skip
            else:
                outputs = []
                for _ in range(count):
                    output, reduce = forward_with_post_processing_fn(iterator, self.gpt, post, sampling_params=sampling)
                    outputs.append(reduce(output)[1])
            padded_logprobs = [torch.nn.functional.pad(o["logprobs"], (0, seq_length - o["logprobs"].shape[1])) for o in outputs]
        result = BatchedDataDict({"logprobs": torch.cat(padded_logprobs).cpu()})
        result.reorder_data(unsorted)
        return [row[p : len(s)] for row, s, p in zip(result["logprobs"], sequences, prompt_lens)]
