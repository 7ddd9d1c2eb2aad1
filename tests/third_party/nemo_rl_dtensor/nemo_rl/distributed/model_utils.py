# Copyright (c) 2025, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed.nn.functional
from torch.distributed.tensor import DTensor, distribute_tensor

from nemo_rl.algorithms.logits_sampling_utils import (
    TrainingSamplingParams,
    apply_top_k_top_p,
    need_top_k_or_top_p_filtering,
)

if TYPE_CHECKING:
    # megatron-core (optional "mcore" extra) is imported lazily below so this
    # module imports without mcore installed.
    from megatron.core.models.gpt import GPTModel


def _compute_distributed_log_softmax_with_grad(
    vocab_parallel_logits: torch.Tensor, group: torch.distributed.ProcessGroup
) -> torch.Tensor:
    """Differentiable stable distributed log_softmax across tensor parallel workers.

    Args:
        vocab_parallel_logits (torch.Tensor): Logits with shape
            [batch_size, seq_length, vocab_size // TP], where TP is the tensor
            parallel size.
        group (torch.distributed.ProcessGroup): Process group for the all-reduces.

    Returns:
        torch.Tensor: Log probabilities, same shape as the input, normalized across
            the full vocabulary dimension. Differentiable (gradients flow through
            the all-reduces).
    """
    logits_max = torch.amax(vocab_parallel_logits, dim=-1, keepdim=True).detach()
    torch.distributed.all_reduce(
        logits_max,
        op=torch.distributed.ReduceOp.MAX,
        group=group,
    )

    # Subtract the maximum value.
    vocab_parallel_logits = vocab_parallel_logits - logits_max

    sum_exp_logits = vocab_parallel_logits.exp().sum(-1, keepdim=True).float()

    sum_exp_logits = torch.distributed.nn.functional.all_reduce(
        sum_exp_logits,
        op=torch.distributed.ReduceOp.SUM,
        group=group,
    )

    return vocab_parallel_logits - sum_exp_logits.log().to(vocab_parallel_logits.dtype)


@torch.no_grad()
def _compute_distributed_log_softmax(
    vocab_parallel_logits: torch.Tensor, group: torch.distributed.ProcessGroup
) -> torch.Tensor:
    """Non-differentiable variant of :func:`_compute_distributed_log_softmax_with_grad`.

    Same math and shape contract, wrapped in ``torch.no_grad()`` for the
    inference / logprob paths that don't need gradients.
    """
    return _compute_distributed_log_softmax_with_grad(vocab_parallel_logits, group)


@torch.no_grad()
def _compute_distributed_softmax(
    vocab_parallel_logits: torch.Tensor, group: torch.distributed.ProcessGroup
) -> torch.Tensor:
    """Compute a stable distributed softmax across tensor parallel workers.

    Taken from: https://github.com/NVIDIA/NeMo-Aligner/blob/9faab404f21994a7eb1d6ed5890b76152b941636/nemo_aligner/utils/distributed.py#L239

    Args:
        vocab_parallel_logits (torch.Tensor): Logits tensor with shape [batch_size, seq_length, vocab_size//TP]
            where TP is the tensor parallel size.
        group (torch.distributed.ProcessGroup): Process group for the all-reduce operations.

    Returns:
        torch.Tensor: Softmax output with the same shape as input, normalized across the full vocabulary.
    """
    logits_max = torch.amax(vocab_parallel_logits, dim=-1, keepdim=True)
    torch.distributed.all_reduce(
        logits_max,
        op=torch.distributed.ReduceOp.MAX,
        group=group,
    )

    vocab_parallel_logits = vocab_parallel_logits - logits_max

    exp_logits = vocab_parallel_logits.exp_()

    sum_exp_logits = exp_logits.sum(-1, keepdim=True)
    torch.distributed.all_reduce(
        sum_exp_logits,
        op=torch.distributed.ReduceOp.SUM,
        group=group,
    )
    exp_logits.div_(sum_exp_logits)

    return exp_logits


class DistributedLogprob(torch.autograd.Function):
    """Custom autograd function for computing log probabilities in a distributed setting.

    Taken from https://github.com/NVIDIA/NeMo-Aligner/blob/9faab404f21994a7eb1d6ed5890b76152b941636/nemo_aligner/utils/distributed.py#L286
    """

    @staticmethod
    def forward(  # pyrefly: ignore[bad-override]  Always ignore torch.autograd.Function.forward's type since it's always more specific than the base class
        ctx: Any,
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
        group: torch.distributed.ProcessGroup,
        inference_only: bool = False,
    ) -> torch.Tensor:
        # Create a mask of valid vocab ids (1 means it needs to be masked).
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = target - vocab_start_index
        masked_target[target_mask] = 0

        vocab_parallel_logits = vocab_parallel_logits.to(dtype=torch.float32)

        full_log_probs = _compute_distributed_log_softmax(
            vocab_parallel_logits, group=group
        )

        log_probs = torch.gather(
            full_log_probs, -1, masked_target.unsqueeze(-1)
        ).squeeze(-1)
        log_probs[target_mask] = 0.0

        torch.distributed.all_reduce(
            log_probs,
            op=torch.distributed.ReduceOp.SUM,
            group=group,
        )

        if not inference_only:
            # only save for backward when we have inference only=False. The
            # softmax is materialized here rather than next to the log_softmax
            # so the inference path does not pay for a [B, S, V_local] tensor
            # it never reads (same placement as ChunkedDistributedLogprob).
            ctx.save_for_backward(full_log_probs.exp(), target_mask, masked_target)

        return log_probs

    @staticmethod
    def backward(
        ctx: Any,
        *grad_outputs: torch.Tensor,
    ) -> tuple[torch.Tensor, None, None, None, None, None, None]:
        grad_output = grad_outputs[0]
        softmax, target_mask, masked_target = ctx.saved_tensors

        if softmax.ndim == 3:
            B, S, V = softmax.shape

            # skip `torch.nn.functional.one_hot`
            row = (
                torch.arange(B, device=softmax.device)
                .view(-1, 1)
                .expand(-1, S)
                .reshape(-1)
            )
            col = torch.arange(S, device=softmax.device).expand(B, -1).reshape(-1)
            flat_idx = (row * S + col) * V

            flat_chosen = flat_idx.masked_select(
                ~target_mask.reshape(-1)
            ) + masked_target.masked_select(~target_mask)

            # `neg` is zero-copy
            grad_input = softmax.neg()
            grad_input = grad_input.mul_(grad_output.unsqueeze(-1))

            grad_output_selected = grad_output.masked_select(~target_mask)
            grad_input.view(-1).scatter_add_(0, flat_chosen, grad_output_selected)
        else:
            V = softmax.size(-1)
            is_chosen = (~target_mask).unsqueeze(-1) * torch.nn.functional.one_hot(
                masked_target, num_classes=V
            )
            grad_input = is_chosen.float().sub_(softmax)
            grad_input.mul_(grad_output.unsqueeze(-1))

        # if you add an argument to the forward method, then you must add a corresponding None here
        return grad_input, None, None, None, None, None, None


class DistributedCrossEntropy(torch.autograd.Function):
    """Compute soft-target cross entropy across TP-sharded vocab.

    This returns H(p_target, q_student), which matches forward KL up to the
    target entropy constant. Backward propagates only through student logits.
    """

    @staticmethod
    def forward(  # pyrefly: ignore[bad-override]
        ctx: Any,
        student_logits: torch.Tensor,
        target_logits: torch.Tensor,
        group: torch.distributed.ProcessGroup,
        inference_only: bool = False,
    ) -> torch.Tensor:
        if student_logits.shape != target_logits.shape:
            raise ValueError(
                "student_logits and target_logits must have the same shape, "
                f"got {student_logits.shape} and {target_logits.shape}."
            )

        target_probs = _compute_distributed_softmax(
            target_logits.to(dtype=torch.float32),
            group=group,
        )
        student_log_probs = _compute_distributed_log_softmax(
            student_logits.to(dtype=torch.float32), group=group
        )
        # Reuse the log-softmax buffers to avoid extra full-vocab allocations.
        local_cross_entropy = torch.einsum(
            "...v,...v->...", target_probs, student_log_probs
        ).neg_()
        torch.distributed.all_reduce(
            local_cross_entropy,
            op=torch.distributed.ReduceOp.SUM,
            group=group,
        )

        if not inference_only:
            student_probs = student_log_probs.exp_()
            ctx.save_for_backward(target_probs, student_probs)

        return local_cross_entropy.contiguous()

    @staticmethod
    def backward(
        ctx: Any,
        *grad_outputs: torch.Tensor,
    ) -> tuple[torch.Tensor, None, None, None]:
        grad_output = grad_outputs[0]
        target_probs, student_probs = ctx.saved_tensors

        # d(H(p, q))/d(z_v) = q_v - p_v
        grad_student = (student_probs - target_probs) * grad_output.unsqueeze(-1)
        return grad_student, None, None, None


class ChunkedDistributedLogprob(torch.autograd.Function):
    """Custom autograd function for computing log probabilities in a distributed setting.

    The log probabilities computation is chunked in the sequence dimension
    to mitigate GPU OOM (especially during backward pass).
    In addition, logits casting from float16 or bfloat16 -> float32 is performed
    inside the chunk loop to avoid materializing a whole float32 logits tensor.

    Adapted from https://github.com/NVIDIA/NeMo-Aligner/blob/9faab404f21994a7eb1d6ed5890b76152b941636/nemo_aligner/utils/distributed.py#L286
    """

    @staticmethod
    def forward(  # pyrefly: ignore[bad-override]  Always ignore torch.autograd.Function.forward's type since it's always more specific than the base class
        ctx: Any,
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
        chunk_size: int,
        tp_group: torch.distributed.ProcessGroup,
        inference_only: bool = False,
    ) -> torch.Tensor:
        # Create a mask of valid vocab ids (1 means it needs to be masked).
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = target - vocab_start_index
        masked_target[target_mask] = 0

        seq_size = int(vocab_parallel_logits.shape[1])
        num_chunks = (seq_size + chunk_size - 1) // chunk_size
        all_log_probs = []

        for chunk_idx in range(num_chunks):
            chunk_start = chunk_idx * chunk_size
            chunk_end = min(seq_size, (chunk_idx + 1) * chunk_size)

            logits = vocab_parallel_logits[:, chunk_start:chunk_end, :]
            logits = logits.to(dtype=torch.float32)

            log_probs = _compute_distributed_log_softmax(
                logits,
                group=tp_group,
            )

            log_probs = torch.gather(
                log_probs, -1, masked_target[:, chunk_start:chunk_end].unsqueeze(-1)
            ).squeeze(-1)
            log_probs[target_mask[:, chunk_start:chunk_end]] = 0.0

            torch.distributed.all_reduce(
                log_probs,
                op=torch.distributed.ReduceOp.SUM,
                group=tp_group,
            )

            all_log_probs.append(log_probs)

        log_probs = torch.cat(all_log_probs, dim=1)

        if not inference_only:
            # only save for backward when we have inference only=False
            ctx.save_for_backward(vocab_parallel_logits, target_mask, masked_target)
            ctx.chunk_size = chunk_size
            ctx.tp_group = tp_group

        return log_probs

    @staticmethod
    def backward(
        ctx: Any,
        *grad_outputs: torch.Tensor,
    ) -> tuple[torch.Tensor, None, None, None, None, None, None]:
        grad_output = grad_outputs[0]
        vocab_parallel_logits, target_mask, masked_target = ctx.saved_tensors
        chunk_size = ctx.chunk_size
        tp_group = ctx.tp_group

        partition_vocab_size = int(vocab_parallel_logits.shape[-1])
        seq_size = int(vocab_parallel_logits.shape[1])
        num_chunks = (seq_size + chunk_size - 1) // chunk_size

        grad_input: torch.Tensor = torch.zeros_like(vocab_parallel_logits)

        for chunk_idx in range(num_chunks):
            chunk_start = chunk_idx * chunk_size
            chunk_end = min(seq_size, (chunk_idx + 1) * chunk_size)

            logits = vocab_parallel_logits[:, chunk_start:chunk_end, :]
            logits = logits.to(dtype=torch.float32)

            softmax_output = _compute_distributed_log_softmax(
                logits,
                group=tp_group,
            )
            softmax_output = softmax_output.exp()

            # 1 if it's the chosen log prob, 0 otherwise
            is_chosen = (~(target_mask[:, chunk_start:chunk_end])).unsqueeze(
                -1
            ) * torch.nn.functional.one_hot(
                masked_target[:, chunk_start:chunk_end],
                num_classes=partition_vocab_size,
            )

            chunk_grad_fp32 = is_chosen.float().sub_(softmax_output)
            chunk_grad_fp32.mul_(
                grad_output[:, chunk_start:chunk_end].unsqueeze(dim=-1)
            )
            grad_input[:, chunk_start:chunk_end, :].copy_(chunk_grad_fp32)

            # Explicitly free before next iteration allocates
            del softmax_output, is_chosen, logits, chunk_grad_fp32

        # if you add an argument to the forward method, then you must add a corresponding None here
        return grad_input, None, None, None, None, None, None


class DistributedLogprobWithSampling(torch.autograd.Function):
    """Custom autograd function for computing log probabilities with top-k/top-p sampling.

    This function materializes the full vocabulary by converting from vocab-parallel to
    batch-sequence-parallel layout, applies filtering, and computes log probabilities.
    """

    @staticmethod
    def forward(  # pyrefly: ignore[bad-override]  Always ignore torch.autograd.Function.forward's type since it's always more specific than the base class
        ctx: Any,
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        tp_group: torch.distributed.ProcessGroup,
        top_k: int | None,
        top_p: float,
        inference_only: bool = False,
    ) -> torch.Tensor:
        """Forward pass for sampling-based logprob computation.

        Args:
            vocab_parallel_logits: [B, S, V_local] logits sharded by vocab
            target: [B, S] target token ids (already shifted)
            tp_group: Tensor parallel process group
            top_k: Top-k filtering parameter (None or -1 to disable)
            top_p: Top-p filtering parameter (1.0 to disable)
            inference_only: If True, don't save tensors for backward

        Returns:
            Log probabilities [B, S]
        """
        world_size = torch.distributed.get_world_size(tp_group)
        rank = torch.distributed.get_rank(tp_group)
        B, S, V_local = vocab_parallel_logits.shape
        BS = B * S

        if BS % world_size != 0:
            raise ValueError(
                f"B*S={BS} must be divisible by tensor parallel size {world_size} when using top-p/top-k sampling. "
                "Please set policy.make_sequence_length_divisible_by to tensor parallel size."
            )
        BS_local = BS // world_size

        # Reshape to 2D for all_to_all
        reshaped_vocab_parallel_logits = vocab_parallel_logits.view(BS, V_local)

        # Flatten target: [B, S] -> [BS]
        target_flat = target.flatten()  # [BS]

        # Extract local portion
        start_idx = rank * BS_local
        end_idx = (rank + 1) * BS_local
        target_local = target_flat[start_idx:end_idx]  # [BS_local]

        # All-to-all to get batch-sequence parallel logits
        seq_parallel_logits = all_to_all_vp2sq(reshaped_vocab_parallel_logits, tp_group)

        # Apply top-k and top-p filtering locally (returns keep_mask for gradient)
        logits, keep_mask = apply_top_k_top_p(
            seq_parallel_logits, top_k=top_k, top_p=top_p
        )

        # Compute log softmax
        log_probs = torch.nn.functional.log_softmax(
            logits.to(dtype=torch.float32), dim=-1
        )

        # Gather log probs for target tokens
        token_logprobs = torch.gather(
            log_probs, -1, target_local.unsqueeze(-1)
        ).squeeze(-1)

        # All-gather across TP to get full sequence [BS]
        gathered_list = [torch.empty_like(token_logprobs) for _ in range(world_size)]
        torch.distributed.all_gather(gathered_list, token_logprobs, group=tp_group)
        token_logprobs = torch.cat(gathered_list, dim=0)  # [BS]

        # Reshape back to [B, S]
        token_logprobs = token_logprobs.view(B, S)

        if not inference_only:
            # Save softmax and mask for backward
            softmax_output = log_probs.exp()
            ctx.save_for_backward(softmax_output, target_local, keep_mask)
            ctx.tp_group = tp_group
            ctx.world_size = world_size
            ctx.rank = rank
            ctx.BS_local = BS_local
            ctx.B = B
            ctx.S = S

        return token_logprobs

    @staticmethod
    def backward(
        ctx: Any,
        *grad_outputs: torch.Tensor,
    ) -> tuple[torch.Tensor, None, None, None, None, None]:
        """Backward pass for sampling-based logprob computation."""
        grad_output = grad_outputs[0]  # [B, S]
        softmax_output, target_local, keep_mask = ctx.saved_tensors
        tp_group = ctx.tp_group
        world_size = ctx.world_size
        rank = ctx.rank
        BS_local = ctx.BS_local
        B = ctx.B
        S = ctx.S

        # Flatten and extract local portion
        grad_output_flat = grad_output.flatten()  # [BS]
        start_idx = rank * BS_local
        end_idx = (rank + 1) * BS_local
        grad_output_local = grad_output_flat[start_idx:end_idx]  # [BS_local]

        # Compute gradient
        V = softmax_output.shape[-1]
        is_chosen = torch.nn.functional.one_hot(target_local, num_classes=V)
        grad_logits_local = is_chosen.float().sub_(softmax_output)
        grad_logits_local.mul_(grad_output_local.unsqueeze(-1))

        # Apply keep_mask to gradients - filtered tokens don't get gradients
        if keep_mask is not None:
            grad_logits_local.mul_(keep_mask)

        # Convert back to vocab-parallel: [BS_local, V] -> [BS, V_local]
        grad_vocab_parallel = all_to_all_sq2vp(grad_logits_local, tp_group)
        grad_vocab_parallel = grad_vocab_parallel.view(B, S, V // world_size)

        return grad_vocab_parallel, None, None, None, None, None


class ChunkedDistributedLogprobWithSampling(torch.autograd.Function):
    """Chunked version of DistributedLogprobWithSampling for memory efficiency.

    Uses delayed rematerialization to avoid storing large intermediate tensors.
    """

    @staticmethod
    def forward(  # pyrefly: ignore[bad-override]  Always ignore torch.autograd.Function.forward's type since it's always more specific than the base class
        ctx: Any,
        vocab_parallel_logits: torch.Tensor,
        target: torch.Tensor,
        tp_group: torch.distributed.ProcessGroup,
        top_k: int | None,
        top_p: float,
        chunk_size: int,
        inference_only: bool = False,
    ) -> torch.Tensor:
        """Forward pass with chunked processing.

        Args:
            vocab_parallel_logits: [B, S, V_local] logits sharded by vocab
            target: [B, S] target token ids (already shifted)
            tp_group: Tensor parallel process group
            top_k: Top-k filtering parameter (None or -1 to disable)
            top_p: Top-p filtering parameter (1.0 to disable)
            chunk_size: Chunk size for memory efficiency (in sequence dimension)
            inference_only: If True, don't save tensors for backward

        Returns:
            Log probabilities [B, S]
        """
        world_size = torch.distributed.get_world_size(tp_group)
        rank = torch.distributed.get_rank(tp_group)
        B, S, V_local = vocab_parallel_logits.shape
        BS = B * S

        if BS % world_size != 0:
            raise ValueError(
                f"B*S={BS} must be divisible by tensor parallel size {world_size} when using top-p/top-k sampling. "
                "Please set policy.make_sequence_length_divisible_by to tensor parallel size."
            )

        # Convert chunk_size from sequence dimension to batch-sequence dimension
        effective_chunk_size = chunk_size * B
        reshaped_vocab_parallel_logits = vocab_parallel_logits.view(BS, V_local)

        # Make sure the effective chunk size is divisible by the world size
        # This ensure all the chunks (including the last one) meet the world size requirement.
        if effective_chunk_size % world_size != 0:
            raise ValueError(
                f"Effective chunk size {effective_chunk_size} = chunk_size {chunk_size} * B {B} must be divisible "
                f"by the tensor parallel size {world_size}."
            )

        # Flatten target: [B, S] -> [BS]
        target_flat = target.flatten()  # [BS]

        # Process in chunks
        num_chunks = (BS + effective_chunk_size - 1) // effective_chunk_size
        all_token_logprobs = []

        for chunk_idx in range(num_chunks):
            chunk_start = chunk_idx * effective_chunk_size
            chunk_end = min(BS, (chunk_idx + 1) * effective_chunk_size)
            current_chunk_size = chunk_end - chunk_start
            local_chunk_size = current_chunk_size // world_size

            # Slice the chunk
            vocab_parallel_logits_chunk = reshaped_vocab_parallel_logits[
                chunk_start:chunk_end, :
            ]

            # Extract target chunk for this rank
            target_chunk = target_flat[chunk_start:chunk_end]
            target_local = target_chunk[
                rank * local_chunk_size : (rank + 1) * local_chunk_size
            ]

            # All-to-all to get batch-sequence parallel logits
            seq_parallel_logits_chunk = all_to_all_vp2sq(
                vocab_parallel_logits_chunk, tp_group
            )

            # Apply top-k and top-p filtering locally
            logits_chunk, _ = apply_top_k_top_p(
                seq_parallel_logits_chunk, top_k=top_k, top_p=top_p
            )

            # Compute log softmax
            log_probs_chunk = torch.nn.functional.log_softmax(
                logits_chunk.to(dtype=torch.float32), dim=-1
            )

            # Gather log probs for target tokens in this chunk
            token_logprobs_chunk = torch.gather(
                log_probs_chunk, -1, target_local.unsqueeze(-1)
            ).squeeze(-1)

            # All-gather across TP to get full chunk [current_chunk_size]
            gathered_list = [
                torch.empty_like(token_logprobs_chunk) for _ in range(world_size)
            ]
            torch.distributed.all_gather(
                gathered_list, token_logprobs_chunk, group=tp_group
            )
            token_logprobs_chunk = torch.cat(gathered_list, dim=0)

            all_token_logprobs.append(token_logprobs_chunk)

        # Concatenate all chunks and reshape
        token_logprobs = torch.cat(all_token_logprobs, dim=0)  # [BS]
        token_logprobs = token_logprobs.view(B, S)

        if not inference_only:
            ctx.save_for_backward(vocab_parallel_logits)
            ctx.target = target
            ctx.tp_group = tp_group
            ctx.top_k = top_k
            ctx.top_p = top_p
            ctx.chunk_size = chunk_size

        return token_logprobs

    @staticmethod
    def backward(
        ctx: Any,
        *grad_outputs: torch.Tensor,
    ) -> tuple[torch.Tensor, None, None, None, None, None, None]:
        """Backward pass with chunked rematerialization."""
        grad_output = grad_outputs[0]  # [B, S]
        (vocab_parallel_logits,) = ctx.saved_tensors
        target = ctx.target
        tp_group = ctx.tp_group
        top_k = ctx.top_k
        top_p = ctx.top_p
        chunk_size = ctx.chunk_size

        world_size = torch.distributed.get_world_size(tp_group)
        rank = torch.distributed.get_rank(tp_group)
        B, S, V_local = vocab_parallel_logits.shape
        BS = B * S

        effective_chunk_size = chunk_size * B
        reshaped_vocab_parallel_logits = vocab_parallel_logits.view(BS, V_local)
        target_flat = target.flatten()

        num_chunks = (BS + effective_chunk_size - 1) // effective_chunk_size
        grad_output_flat = grad_output.flatten()

        all_grad_chunks = []

        for chunk_idx in range(num_chunks):
            chunk_start = chunk_idx * effective_chunk_size
            chunk_end = min(BS, (chunk_idx + 1) * effective_chunk_size)
            current_chunk_size = chunk_end - chunk_start
            local_chunk_size = current_chunk_size // world_size

            # Rematerialize forward pass for this chunk
            vocab_parallel_logits_chunk = reshaped_vocab_parallel_logits[
                chunk_start:chunk_end, :
            ]

            target_chunk = target_flat[chunk_start:chunk_end]
            target_local = target_chunk[
                rank * local_chunk_size : (rank + 1) * local_chunk_size
            ]

            # Rematerialize all-to-all
            seq_parallel_logits_chunk = all_to_all_vp2sq(
                vocab_parallel_logits_chunk, tp_group
            )

            # Rematerialize filtering
            logits_chunk, keep_mask = apply_top_k_top_p(
                seq_parallel_logits_chunk, top_k=top_k, top_p=top_p
            )

            # Rematerialize softmax
            log_probs_chunk = torch.nn.functional.log_softmax(
                logits_chunk.to(dtype=torch.float32), dim=-1
            )
            softmax_chunk = log_probs_chunk.exp()

            # Extract local portion of grad_output
            grad_chunk = grad_output_flat[chunk_start:chunk_end]
            grad_local = grad_chunk[
                rank * local_chunk_size : (rank + 1) * local_chunk_size
            ]

            # Compute gradient: (one_hot - softmax) * grad_output
            V = softmax_chunk.shape[-1]
            is_chosen = torch.nn.functional.one_hot(target_local, num_classes=V)
            grad_logits_local = is_chosen.float().sub_(softmax_chunk)
            grad_logits_local.mul_(grad_local.unsqueeze(-1))

            # Apply keep_mask
            if keep_mask is not None:
                grad_logits_local.mul_(keep_mask)

            # Convert back to vocab-parallel
            grad_vocab_parallel_chunk = all_to_all_sq2vp(grad_logits_local, tp_group)
            all_grad_chunks.append(grad_vocab_parallel_chunk)

        grad_vocab_parallel = torch.cat(all_grad_chunks, dim=0)
        grad_vocab_parallel = grad_vocab_parallel.view(B, S, V_local)

        return grad_vocab_parallel, None, None, None, None, None, None


class ChunkedDistributedGatherLogprob(torch.autograd.Function):
    """Compute distributed log-softmax once and gather logprobs at given global indices.

    Forward computes per-chunk distributed log-softmax across TP, gathers selected
    log probabilities at the provided global indices (shape [B, S, K]), and returns
    a tensor of shape [B, S, K].

    Backward recomputes per-chunk softmax from logits and applies the gradient rule:
      dL/dz = -softmax * sum_k(dL/dy_k) + scatter_add(dL/dy_k) over selected indices.
    """

    @staticmethod
    def forward(  # pyrefly: ignore[bad-override]
        ctx: Any,
        vocab_parallel_logits: torch.Tensor,  # [B, S, V_local]
        global_indices: torch.Tensor,  # [B, S, K]
        vocab_start_index: int,
        vocab_end_index: int,
        chunk_size: int,
        tp_group: torch.distributed.ProcessGroup,
        inference_only: bool = False,
    ) -> torch.Tensor:
        B, S, V_local = vocab_parallel_logits.shape
        num_chunks = (int(S) + chunk_size - 1) // chunk_size
        out_chunks: list[torch.Tensor] = []

        for chunk_idx in range(num_chunks):
            s0 = chunk_idx * chunk_size
            s1 = min(int(S), (chunk_idx + 1) * chunk_size)

            logits = vocab_parallel_logits[:, s0:s1, :].to(dtype=torch.float32)
            # distributed log softmax along full vocab
            log_probs = _compute_distributed_log_softmax(logits, group=tp_group)

            gi = global_indices[:, s0:s1, :]
            in_range = (gi >= int(vocab_start_index)) & (gi < int(vocab_end_index))
            li = (gi - int(vocab_start_index)).clamp(min=0, max=V_local - 1)

            local_vals = torch.gather(log_probs, dim=-1, index=li)
            local_vals = local_vals * in_range.to(dtype=local_vals.dtype)

            torch.distributed.all_reduce(
                local_vals, op=torch.distributed.ReduceOp.SUM, group=tp_group
            )

            out_chunks.append(local_vals)

        out = torch.cat(out_chunks, dim=1) if len(out_chunks) > 1 else out_chunks[0]

        if not inference_only:
            ctx.save_for_backward(vocab_parallel_logits, global_indices)
            ctx.chunk_size = int(chunk_size)
            ctx.tp_group = tp_group
            ctx.vocab_start_index = int(vocab_start_index)
            ctx.vocab_end_index = int(vocab_end_index)

        return out.contiguous()

    @staticmethod
    def backward(
        ctx: Any, *grad_outputs: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None, None, None, None]:
        grad_output = grad_outputs[0]  # [B, S, K]
        vocab_parallel_logits, global_indices = ctx.saved_tensors
        chunk_size: int = ctx.chunk_size
        tp_group = ctx.tp_group
        vocab_start_index = ctx.vocab_start_index
        vocab_end_index = ctx.vocab_end_index

        B, S, V_local = vocab_parallel_logits.shape
        num_chunks = (int(S) + chunk_size - 1) // chunk_size

        grad_input: torch.Tensor = torch.zeros_like(
            vocab_parallel_logits, dtype=torch.float32
        )

        for chunk_idx in range(num_chunks):
            s0 = chunk_idx * chunk_size
            s1 = min(int(S), (chunk_idx + 1) * chunk_size)

            logits = vocab_parallel_logits[:, s0:s1, :].to(dtype=torch.float32)
            log_probs = _compute_distributed_log_softmax(logits, group=tp_group)
            softmax_output = log_probs.exp()

            gi = global_indices[:, s0:s1, :]
            in_range = (gi >= int(vocab_start_index)) & (gi < int(vocab_end_index))
            li = (gi - int(vocab_start_index)).clamp(min=0, max=V_local - 1)

            # Sum over K for the softmax term
            go_chunk = grad_output[:, s0:s1, :]  # [B, Sc, K]
            go_sum = go_chunk.sum(dim=-1, keepdim=True)  # [B, Sc, 1]

            # Inplace index into the preallocated grad_input tensor
            grad_input_chunk = grad_input[:, s0:s1, :]

            grad_input_chunk.copy_(softmax_output.neg().mul_(go_sum))  # inplace copy

            # Positive scatter term: add gradients to selected indices
            go_masked = go_chunk * in_range.to(dtype=go_chunk.dtype)
            grad_input_chunk.scatter_add_(2, li, go_masked)

            # Explicitly free before next iteration allocates
            del (
                softmax_output,
                log_probs,
                logits,
                gi,
                in_range,
                li,
                go_chunk,
                go_sum,
                go_masked,
            )

        return grad_input, None, None, None, None, None, None


def dtensor_from_parallel_logits_to_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: DTensor | torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: torch.distributed.ProcessGroup,
    inference_only: bool = False,
    seq_index: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
    sampling_params: Optional[TrainingSamplingParams] = None,
) -> torch.Tensor:
    """Get log probabilities from TP+CP sharded vocab logits.

    Args:
        vocab_parallel_logits (orch.Tensor): Logits distributed across tensor parallel workers,
            with shape [batch_size, seq_len, vocab_size/tp_size].
        target (DTensor): Target token indices with shape [batch_size, seq_len].
            NOTE: Must be the unmodified targets as this function will shift them internally.
        vocab_start_index (int): Starting vocabulary index for this worker's partition.
        vocab_end_index (int): Ending vocabulary index for this worker's partition.
        tp_group (torch.distributed.ProcessGroup): Process group for distributed communication.
        inference_only (bool, optional): If True, tensors won't be saved for backward pass. Defaults to False.
        seq_index (Optional[torch.Tensor]): Sequence index tensor with shape [seq_len].
            It is only provided for cp sharded logits. It represents how tensor is sharded across the sequence dimension.
        chunk_size (Optional[int]): Sequence dimension chunk size for computing the log probabilities.
        sampling_params (TrainingSamplingParams, optional): Sampling parameters for Top-k/Top-p filtering and temperature scaling.

    Returns:
        torch.Tensor: Log probabilities tensor with shape [batch_size, seq_len-1].
            The sequence dimension is reduced by 1 due to the target shifting.
    """
    cp_size = 1

    if (
        isinstance(target, DTensor)
        and target.device_mesh.mesh_dim_names is not None
        and "cp" in target.device_mesh.mesh_dim_names
    ):
        cp_dim_index = target.device_mesh.mesh_dim_names.index("cp")
        cp_size = target.device_mesh.shape[cp_dim_index]

    if cp_size > 1:
        assert seq_index is not None, "seq_index must be provided for cp sharded logits"
        target_shape = torch.Size(target.shape)
        cp_mesh = target.device_mesh
        cp_placements = target.placements
        _, sorted_indices = torch.sort(seq_index)
        # Recover the original order of the target
        target = target.full_tensor()[:, sorted_indices]
        target = target.roll(shifts=-1, dims=-1)[:, seq_index]

        # Reshard
        target = distribute_tensor(target, cp_mesh, cp_placements)
        target = target.to_local()
    else:
        target = target.roll(shifts=-1, dims=-1)

    if need_top_k_or_top_p_filtering(sampling_params):
        if chunk_size is not None:
            logprobs: torch.Tensor = ChunkedDistributedLogprobWithSampling.apply(  # type: ignore
                vocab_parallel_logits,
                target,
                tp_group,
                sampling_params.top_k,
                sampling_params.top_p,
                chunk_size,
                inference_only,
            ).contiguous()
        else:
            logprobs: torch.Tensor = DistributedLogprobWithSampling.apply(  # type: ignore
                vocab_parallel_logits,
                target,
                tp_group,
                sampling_params.top_k,
                sampling_params.top_p,
                inference_only,
            ).contiguous()
    else:
        if chunk_size is not None:
            logprobs: torch.Tensor = ChunkedDistributedLogprob.apply(  # type: ignore
                vocab_parallel_logits,
                target,
                vocab_start_index,
                vocab_end_index,
                chunk_size,
                tp_group,
                inference_only,
            ).contiguous()
        else:
            logprobs: torch.Tensor = DistributedLogprob.apply(  # type: ignore
                vocab_parallel_logits,
                target,
                vocab_start_index,
                vocab_end_index,
                tp_group,
                inference_only,
            ).contiguous()

    if cp_size > 1:
        # logprobs is sharded on the sequence dimension.
        # Get full sequence tensor, vocab dim has been reduced already.
        logprobs_dtensor = DTensor.from_local(logprobs, cp_mesh, cp_placements)
        logprobs = logprobs_dtensor.full_tensor()[:, sorted_indices]
        assert logprobs.shape == target_shape

    return logprobs[:, :-1]


def from_parallel_logits_to_logprobs(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: torch.distributed.ProcessGroup,
    inference_only: bool = False,
    cp_group: Optional[torch.distributed.ProcessGroup] = None,
    chunk_size: Optional[int] = None,
    sampling_params: Optional[TrainingSamplingParams] = None,
) -> torch.Tensor:
    """Get log probabilities from TP+CP sharded vocab logits.

    Args:
        vocab_parallel_logits (torch.Tensor): Logits tensor with shape [batch_size, seq_len // CP, vocab_size // TP]
            where TP is the tensor parallel size.
        target (torch.Tensor): Target token indices with shape [batch_size, seq_len].
            NOTE: Must be the unmodified targets as this function will shift them internally.
        vocab_start_index (int): Starting vocabulary index for this worker's partition.
        vocab_end_index (int): Ending vocabulary index for this worker's partition.
        tp_group (torch.distributed.ProcessGroup): Process group for distributed communication.
        inference_only (bool, optional): If True, tensors won't be saved for backward pass. Defaults to False.
        cp_group (torch.distributed.ProcessGroup, optional): Context parallelism process group. Defaults to None.
        chunk_size (int, optional): Sequence dimension chunk size for computing the log probabilities.
        sampling_params (TrainingSamplingParams, optional): Sampling parameters for Top-k/Top-p filtering and temperature scaling.

    Returns:
        torch.Tensor: Log probabilities tensor with shape [batch_size, seq_len-1].
            The sequence dimension is reduced by 1 due to the target shifting.

    Taken from: https://github.com/NVIDIA/NeMo-Aligner/blob/9faab404f21994a7eb1d6ed5890b76152b941636/nemo_aligner/utils/distributed.py#L354
    """
    target = target.roll(shifts=-1, dims=-1)
    cp_size = 1 if cp_group is None else torch.distributed.get_world_size(cp_group)
    pad_len = 0
    # if cp_size > 1:
    # Pad the targets to local size * cp_size
    pad_len = vocab_parallel_logits.shape[1] * cp_size - target.shape[1]
    if pad_len > 0:
        target = torch.nn.functional.pad(target, (0, pad_len), value=0)

    # Shard the targets by context parallelism
    cp_rank = torch.distributed.get_rank(cp_group)
    target = _get_tokens_on_this_cp_rank(target, cp_rank, cp_size, seq_dim=1)

    if need_top_k_or_top_p_filtering(sampling_params):
        if chunk_size is not None:
            logprobs: torch.Tensor = ChunkedDistributedLogprobWithSampling.apply(  # type: ignore
                vocab_parallel_logits,
                target,
                tp_group,
                sampling_params.top_k,
                sampling_params.top_p,
                chunk_size,
                inference_only,
            ).contiguous()
        else:
            logprobs: torch.Tensor = DistributedLogprobWithSampling.apply(  # type: ignore
                vocab_parallel_logits,
                target,
                tp_group,
                sampling_params.top_k,
                sampling_params.top_p,
                inference_only,
            ).contiguous()
    else:
        if chunk_size is not None:
            logprobs: torch.Tensor = ChunkedDistributedLogprob.apply(  # type: ignore
                vocab_parallel_logits,
                target,
                vocab_start_index,
                vocab_end_index,
                chunk_size,
                tp_group,
                inference_only,
            ).contiguous()
        else:
            logprobs: torch.Tensor = DistributedLogprob.apply(  # type: ignore
                vocab_parallel_logits,
                target,
                vocab_start_index,
                vocab_end_index,
                tp_group,
                inference_only,
            ).contiguous()

    if cp_size > 1:
        # we need to gather the logits by context parallelism
        logprobs = allgather_cp_sharded_tensor(
            logprobs, cp_group, seq_dim=1
        )  # , unpadded_seqlen=target.shape[1])

    if pad_len > 0:
        logprobs = logprobs[:, :-pad_len]

    return logprobs[:, :-1]


def from_parallel_logits_to_logprobs_packed_sequences(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    cu_seqlens_padded: torch.Tensor,
    unpacked_seqlen: int,
    vocab_start_index: int,
    vocab_end_index: int,
    group: torch.distributed.ProcessGroup,
    inference_only: bool = False,
    cp_group: Optional[torch.distributed.ProcessGroup] = None,
    chunk_size: Optional[int] = None,
    sampling_params: Optional[TrainingSamplingParams] = None,
    target_is_pre_rolled: bool = False,
) -> torch.Tensor:
    """Get log probabilities from TP sharded vocab logits for packed sequences.

    Args:
        vocab_parallel_logits (torch.Tensor): Packed logits tensor with shape [1, T // CP, vocab_size//TP]
            where T is the total number of tokens across all packed sequences.
        target (torch.Tensor): Packed target token indices.
            If target_is_pre_rolled=False: shape [1, T] — unmodified targets, rolled internally.
            If target_is_pre_rolled=True: shape [1, T // CP] — pre-rolled and pre-CP-sharded.
        cu_seqlens_padded (torch.Tensor): Cumulative sequence lengths tensor with shape [batch_size + 1].
            cu_seqlens_padded[i] indicates the start position of sequence i in the packed format
            (full, not CP-adjusted).
        unpacked_seqlen (int): The length of the unpacked sequence tensor.
        vocab_start_index (int): Starting vocabulary index for this worker's partition.
        vocab_end_index (int): Ending vocabulary index for this worker's partition.
        group (torch.distributed.ProcessGroup): Process group for distributed communication.
        inference_only (bool, optional): If True, tensors won't be saved for backward pass. Defaults to False.
        cp_group (torch.distributed.ProcessGroup, optional): Context parallelism process group. Defaults to None.
        chunk_size (int, optional): Sequence dimension chunk size for computing the log probabilities.
        sampling_params (TrainingSamplingParams, optional): Sampling parameters for Top-k/Top-p filtering.
        target_is_pre_rolled (bool): If True, target is already shifted and CP-sharded to match
            vocab_parallel_logits shape, skipping the internal per-sequence roll+CP-shard loop.

    Returns:
        torch.Tensor: Unpacked log probabilities tensor with shape [batch_size, unpacked_seqlen-1].
            The total length is reduced by batch_size due to target shifting (one token per sequence).
    """
    batch_size = cu_seqlens_padded.shape[0] - 1
    cp_size = 1 if cp_group is None else torch.distributed.get_world_size(cp_group)

    if not target_is_pre_rolled:
        # Roll each sequence individually and CP-shard the targets
        # Remove batch dimension to work with [T, vocab_size] and [T]
        vocab_parallel_logits = vocab_parallel_logits.squeeze(0)
        target = target.squeeze(0)
        cp_rank = 0 if cp_group is None else torch.distributed.get_rank(cp_group)

        rolled_targets = torch.zeros(
            target.shape[0] // cp_size, dtype=target.dtype, device=target.device
        )
        for i in range(batch_size):
            start_idx = cu_seqlens_padded[i].item()
            end_idx = cu_seqlens_padded[i + 1].item()

            seq_targets = target[start_idx:end_idx]
            rolled_seq_targets = seq_targets.roll(shifts=-1, dims=0)
            rolled_targets[start_idx // cp_size : end_idx // cp_size] = (
                _get_tokens_on_this_cp_rank(
                    rolled_seq_targets, cp_rank, cp_size, seq_dim=0
                )
            )

        target = rolled_targets.unsqueeze(0)
        vocab_parallel_logits = vocab_parallel_logits.unsqueeze(0)

    # Apply distributed log probability computation
    if need_top_k_or_top_p_filtering(sampling_params):
        if chunk_size is not None:
            probs: torch.Tensor = ChunkedDistributedLogprobWithSampling.apply(  # type: ignore
                vocab_parallel_logits,
                target,
                group,
                sampling_params.top_k,
                sampling_params.top_p,
                chunk_size,
                inference_only,
            ).contiguous()
        else:
            probs: torch.Tensor = DistributedLogprobWithSampling.apply(  # type: ignore
                vocab_parallel_logits,
                target,
                group,
                sampling_params.top_k,
                sampling_params.top_p,
                inference_only,
            ).contiguous()
    else:
        if chunk_size is not None:
            probs: torch.Tensor = ChunkedDistributedLogprob.apply(  # type: ignore
                vocab_parallel_logits,
                target,
                vocab_start_index,
                vocab_end_index,
                chunk_size,
                group,
                inference_only,
            ).contiguous()
        else:
            probs: torch.Tensor = DistributedLogprob.apply(  # type: ignore
                vocab_parallel_logits,
                target,
                vocab_start_index,
                vocab_end_index,
                group,
                inference_only,
            ).contiguous()

    # Remove batch dimension for filtering
    probs = probs.squeeze(0)

    # Ensure probs is 1D after squeezing
    if probs.dim() != 1:
        raise ValueError(
            f"Expected probs to be 1D after squeezing, but got shape {probs.shape}. "
            f"Original shape before squeeze: {probs.unsqueeze(0).shape}"
        )

    if cp_size > 1:
        # per-sequence cp_allgather
        final_probs = torch.zeros(probs.shape[0] * cp_size, device=probs.device)
        for i in range(batch_size):
            start_idx = cu_seqlens_padded[i].item()
            end_idx = cu_seqlens_padded[i + 1].item()
            final_probs[start_idx:end_idx] = allgather_cp_sharded_tensor(
                probs[start_idx // cp_size : end_idx // cp_size], cp_group, seq_dim=0
            )
        probs = final_probs

    out_logprobs = torch.zeros(
        (batch_size, unpacked_seqlen - 1), dtype=probs.dtype, device=probs.device
    )
    # Filter out the last token of each sequence
    for i in range(batch_size):
        start_idx = cu_seqlens_padded[i].item()
        end_idx = cu_seqlens_padded[i + 1].item()

        # Exclude the last position (which has the rolled target from position 0)
        if end_idx - start_idx > 0:
            seq_probs = probs[start_idx : end_idx - 1]
            # Ensure seq_probs is 1D
            if seq_probs.dim() > 1:
                seq_probs = seq_probs.squeeze()

            # Ensure we don't exceed the unpacked sequence length
            seq_len = min(seq_probs.shape[0], unpacked_seqlen - 1)
            if seq_len > 0:
                out_logprobs[i, :seq_len] = seq_probs[:seq_len]

    return out_logprobs


def _get_tokens_on_this_cp_rank(
    input_ids: torch.Tensor,
    cp_rank: int,
    cp_size: int,
    seq_dim: int = 1,
) -> torch.Tensor:
    """Get tokens on this context parallelism rank.

    Assumes that input_ids are already padded to a multiple of cp_size * 2 or cp_size == 1.

    Args:
        input_ids: Input token IDs [seq_length, ]
        cp_rank: Context parallelism rank
        cp_size: Context parallelism size

    Returns:
        Tokens on this context parallelism rank [1, seq_length // cp_size]
    """
    if cp_size == 1:
        return input_ids

    # load balance for causal attention
    shard_size = input_ids.shape[seq_dim] // (cp_size * 2)
    shard_inds = (cp_rank, (cp_size * 2) - cp_rank - 1)

    # Create slices for each dimension
    slices = [slice(None)] * input_ids.dim()
    ids_chunks = []

    for ind in shard_inds:
        slices[seq_dim] = slice(ind * shard_size, (ind + 1) * shard_size)
        ids_chunks.append(input_ids[tuple(slices)])

    ids = torch.cat(ids_chunks, dim=seq_dim)
    return ids


def allgather_cp_sharded_tensor(
    tensor, cp_group, seq_dim=1
):  # , unpadded_seqlen=None):
    return AllGatherCPTensor.apply(tensor, cp_group, seq_dim)  # , unpadded_seqlen)


class _AllReduceSum(torch.autograd.Function):
    """Autograd-aware SUM all-reduce primitive; forward clones + reduces, backward is identity.

    Math: ``y = Σ_r x_r`` ⇒ ``dy/dx_r = 1``. Every rank holds the same
    ``y`` after forward, so the upstream grad is identical across ranks
    — passing it back as ``grad_x_r`` lets the rank-local chain rule
    route gradients to each rank's own input shard with no cross-rank
    coupling.

    Use the functional wrappers :func:`group_all_reduce_sum_with_grad` (keeps
    the gradient) and :func:`group_all_reduce_sum` (no gradient) rather than
    calling ``.apply`` directly. A ``group`` of ``None`` (or world size <= 1,
    or an uninitialized process group) is a no-op so single-process / CPU paths
    work unchanged.
    """

    @staticmethod
    def forward(  # pyrefly: ignore[bad-override]
        ctx: Any,
        x: torch.Tensor,
        group: Optional[torch.distributed.ProcessGroup],
    ) -> torch.Tensor:
        ctx.group = group
        if (
            group is None
            or not torch.distributed.is_initialized()
            or torch.distributed.get_world_size(group) <= 1
        ):
            return x
        out = x.clone()
        torch.distributed.all_reduce(
            out, op=torch.distributed.ReduceOp.SUM, group=group
        )
        return out

    @staticmethod
    def backward(  # pyrefly: ignore[bad-override]
        ctx: Any, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor, None]:
        return grad_out, None


def group_all_reduce_sum_with_grad(
    x: torch.Tensor,
    group: Optional[torch.distributed.ProcessGroup],
) -> torch.Tensor:
    """Differentiable SUM all-reduce of ``x`` over ``group``.

    Gradients flow back through the reduce (backward is identity), so this is
    the variant for forward-path reductions whose result feeds the loss — e.g.
    CP chunk-sum aggregation and TP projection-partial combination. ``group``
    of ``None`` (or world size <= 1, or dist uninitialized) is a no-op.
    """
    return _AllReduceSum.apply(x, group)


def group_all_reduce_sum(
    x: torch.Tensor,
    group: Optional[torch.distributed.ProcessGroup],
) -> torch.Tensor:
    """Non-differentiable variant of :func:`group_all_reduce_sum_with_grad`.

    Same reduction, but no gradient flows through it — use for normalizers /
    denominators that must be treated as constants (e.g. the global
    valid-token or valid-chunk counts). Pass an explicit ``group`` (e.g.
    ``torch.distributed.group.WORLD`` to reduce over the full DP×CP×TP mesh, or
    a narrower process group); ``None`` (or world size <= 1, or dist
    uninitialized) is a no-op that returns the local value.
    """
    with torch.no_grad():
        return _AllReduceSum.apply(x, group)


class AllGatherCPTensor(torch.autograd.Function):
    def forward(
        ctx, tensor, cp_group: torch.distributed.ProcessGroup, seq_dim=1
    ):  # , unpadded_seqlen: Optional[int] = None):
        cp_size = torch.distributed.get_world_size(cp_group)
        cp_rank_chunks = []
        for _ in range(cp_size):
            cp_rank_chunks.append(torch.empty_like(tensor))

        torch.distributed.all_gather(
            tensor_list=cp_rank_chunks, tensor=tensor, group=cp_group
        )

        # undo the CP load balancing chunking
        tensor_chunks = []
        for logit_chunk in cp_rank_chunks:
            tensor_chunks.extend(torch.chunk(logit_chunk, chunks=2, dim=seq_dim))

        chunk_indices = []
        for cp_rank in range(cp_size):
            chunk_indices.append(cp_rank)
            chunk_indices.append(2 * cp_size - cp_rank - 1)

        chunks_and_indices = list(zip(tensor_chunks, chunk_indices))
        chunks_and_indices = sorted(chunks_and_indices, key=lambda tup: tup[1])
        ret_tensor = [chunk for chunk, _ in chunks_and_indices]
        ret_tensor = torch.cat(ret_tensor, dim=seq_dim)

        ctx.seq_dim = seq_dim
        ctx.cp_group = cp_group
        # ctx.unpadded_seqlen = unpadded_seqlen

        return ret_tensor

    def backward(ctx, grad_output):
        cp_size = torch.distributed.get_world_size(ctx.cp_group)
        cp_rank = torch.distributed.get_rank(ctx.cp_group)
        torch.distributed.all_reduce(grad_output, group=ctx.cp_group)

        # chunk the seqdim in 2*cp chunks, and select with a CP load balanced indexing
        seq_dim = ctx.seq_dim
        # if ctx.unpadded_seqlen is not None:
        # # Zero out grad_output along the seq_dim after unpadded_seqlen
        # slicer = [slice(None)] * grad_output.dim()
        # slicer[seq_dim] = slice(ctx.unpadded_seqlen, None)
        #     grad_output[tuple(slicer)] = 0

        grad_output = grad_output.view(
            *grad_output.shape[0:seq_dim],
            2 * cp_size,
            grad_output.shape[seq_dim] // (2 * cp_size),
            *grad_output.shape[(seq_dim + 1) :],
        )

        index = torch.tensor(
            [cp_rank, (2 * cp_size - cp_rank - 1)], device="cpu", pin_memory=True
        ).cuda(non_blocking=True)

        grad_input = grad_output.index_select(seq_dim, index)
        grad_input = grad_input.view(
            *grad_input.shape[0:seq_dim], -1, *grad_input.shape[(seq_dim + 2) :]
        )

        return grad_input, None, None  # , None


def cp_load_balanced_to_contiguous(
    x: torch.Tensor,
    *,
    cp_group: Optional[torch.distributed.ProcessGroup] = None,
    seq_dim: int = 1,
) -> torch.Tensor:
    """Re-layout a tensor from load-balanced CP order to this rank's contiguous window.

    PyTorch ``context_parallel`` shards the sequence in a load-balanced
    (``2*cp`` interleaved) order. :func:`allgather_cp_sharded_tensor` undoes the
    chunking to the full contiguous sequence; this re-slices to this CP rank's
    contiguous ``[cp_rank*L, (cp_rank+1)*L)`` window. No-op when CP world <= 1.
    Uses the grad-preserving ``DTensor.to_local()`` so the gradient is kept.
    """
    if cp_group is None or torch.distributed.get_world_size(cp_group) <= 1:
        return x
    local = x.to_local() if isinstance(x, DTensor) else x
    full = allgather_cp_sharded_tensor(local, cp_group, seq_dim=seq_dim)
    cp_size = torch.distributed.get_world_size(cp_group)
    cp_rank = torch.distributed.get_rank(cp_group)
    local_len = full.shape[seq_dim] // cp_size
    return full.narrow(seq_dim, cp_rank * local_len, local_len).contiguous()


def cp_shift_next(
    x: torch.Tensor,
    cp_group: Optional[torch.distributed.ProcessGroup] = None,
    *,
    fill: float,
) -> torch.Tensor:
    """Next-token (left-by-1) shift along seq dim 1, CP-aware for contiguous sharding.

    Returns ``out[:, t] = x[:, t + 1]`` over the *global* sequence: interior
    positions roll locally, each rank's last position takes the next CP rank's
    first row (contiguous CP sharding), and the global-last position is set to
    ``fill`` (no next token). With no / size-1 ``cp_group`` this is a plain local
    left-roll with the last position set to ``fill``.
    """
    out = torch.roll(x, shifts=-1, dims=1)
    cp_size = torch.distributed.get_world_size(cp_group) if cp_group is not None else 1
    if cp_size <= 1:
        out[:, -1] = fill
        return out
    cp_rank = torch.distributed.get_rank(cp_group)
    first = x[:, 0].contiguous()
    gathered = [torch.empty_like(first) for _ in range(cp_size)]
    torch.distributed.all_gather(gathered, first, group=cp_group)
    out[:, -1] = gathered[cp_rank + 1] if cp_rank < cp_size - 1 else fill
    return out


def vocab_parallel_log_softmax(
    logits: torch.Tensor,
    temperature: float,
    *,
    tp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> torch.Tensor:
    """TP-aware ``log_softmax(logits / temperature)`` keeping the vocab shard.

    With ``tp_group`` world > 1 the logits are vocab-sharded, so the softmax
    normalization is reduced across the TP group (kept differentiable) while the
    result stays sharded on the same vocab axis. Otherwise this is a plain local
    ``log_softmax``. DTensor inputs are unwrapped to their local shard.
    """
    if isinstance(logits, DTensor):
        logits = logits.to_local()
    scaled = logits.float() / temperature
    if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
        return _compute_distributed_log_softmax_with_grad(scaled, group=tp_group)
    return torch.log_softmax(scaled, dim=-1)


def vocab_parallel_full_log_softmax(
    logits: torch.Tensor,
    temperature: float,
    *,
    tp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> torch.Tensor:
    """TP-aware ``log_softmax`` gathered to the full vocab ``[B, T, V]``.

    Unlike :func:`vocab_parallel_log_softmax` (which keeps the result
    vocab-sharded), callers that slice arbitrary vocab indices need the full
    vocab axis. With ``tp_group`` world > 1 the sharded log-probs are all-gathered
    via Megatron's autograd-aware gather; otherwise a plain local ``log_softmax``.
    """
    if isinstance(logits, DTensor):
        logits = logits.to_local()
    scaled = logits.float() / temperature
    if tp_group is not None and torch.distributed.get_world_size(tp_group) > 1:
        # Local import keeps the optional Megatron dependency boundary intact.
        from megatron.core.tensor_parallel import (
            gather_from_tensor_model_parallel_region,
        )

        sharded_log_probs = _compute_distributed_log_softmax_with_grad(
            scaled, group=tp_group
        )
        return gather_from_tensor_model_parallel_region(
            sharded_log_probs, group=tp_group
        )
    return torch.log_softmax(scaled, dim=-1)


def vocab_parallel_gather_columns(
    logits: torch.Tensor,
    column_indices: torch.Tensor,
    *,
    tp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> torch.Tensor:
    """Gather a shared set of vocab columns from (possibly TP-sharded) logits.

    Differentiable w.r.t. ``logits``. For callers that only need a fixed
    ``[K]`` subset of vocab columns (e.g. the same-vocab top-k KD loss, whose
    subset renormalization cancels the full-vocab partition function), this
    avoids materializing the all-gathered full-vocab ``[B, T, V]`` tensor that
    :func:`vocab_parallel_full_log_softmax` produces — the working set drops to
    ``[B, T, K]``.

    Args:
        logits: ``[B, T, V]`` (``tp_group`` None or world 1) or
            ``[B, T, V_local]`` vocab-sharded logits. DTensor inputs are
            unwrapped to their local shard.
        column_indices: 1-D ``[K]`` global vocab ids, shared by every position.
        tp_group: optional tensor-parallel group. Uniform mcore vocab sharding
            is assumed (rank ``r`` owns ``[r * V_local, (r + 1) * V_local)``),
            matching :func:`vocab_parallel_full_log_softmax`.

    Returns:
        ``[B, T, K]`` fp32 logits at the requested columns (upcast matches the
        fp32 working precision of the surrounding loss paths).
    """
    if isinstance(logits, DTensor):
        logits = logits.to_local()
    if tp_group is None or torch.distributed.get_world_size(tp_group) == 1:
        return logits[..., column_indices].float()

    rank = torch.distributed.get_rank(tp_group)
    v_local = logits.shape[-1]
    vocab_start_index = rank * v_local
    batch_size, seq_len, _ = logits.shape
    expanded_indices = column_indices.view(1, 1, -1).expand(batch_size, seq_len, -1)
    return gather_logits_at_global_indices(
        logits,
        expanded_indices,
        tp_group=tp_group,
        vocab_start_index=vocab_start_index,
        vocab_end_index=vocab_start_index + v_local,
    )


def vocab_parallel_argmax(
    logits: torch.Tensor,
    *,
    tp_group: Optional[torch.distributed.ProcessGroup] = None,
) -> torch.Tensor:
    """Per-position global argmax token id over the (possibly TP-sharded) vocab.

    Returns ``[B, T]`` global token ids. With ``tp_group`` world > 1 the vocab is
    sharded, so a distributed top-1 recovers the global argmax; otherwise a plain
    local ``argmax``. No gradient.
    """
    local_logits = logits.to_local() if isinstance(logits, DTensor) else logits
    tp_world = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
    if tp_world > 1:
        tp_rank = torch.distributed.get_rank(tp_group)
        local_vocab_size = int(local_logits.shape[-1])
        _, topk_global_idx = distributed_vocab_topk(
            local_logits,
            k=1,
            tp_group=tp_group,
            vocab_start_index=tp_rank * local_vocab_size,
            vocab_end_index=(tp_rank + 1) * local_vocab_size,
        )
        return topk_global_idx.squeeze(-1)
    return local_logits.argmax(dim=-1)


def get_logprobs_from_vocab_parallel_logits(
    vocab_parallel_logits: DTensor,
    input_ids: torch.Tensor | DTensor,
    seq_index: Optional[torch.Tensor] = None,
    chunk_size: Optional[int] = None,
    sampling_params: Optional[TrainingSamplingParams] = None,
):
    """Computes log probabilities from vocabulary-parallel logits.

    This function takes logits that are sharded across the vocabulary dimension (tensor parallel)
    and computes the log probabilities for the given input IDs.

    Args:
        vocab_parallel_logits (DTensor): Logits distributed across tensor parallel workers,
            with shape [batch_size, seq_len, vocab_size/tp_size].
        input_ids (torch.Tensor | DTensor): Input token IDs for which to compute log probabilities,
            with shape [batch_size, seq_len].
        seq_index (Optional[torch.Tensor]): Sequence index for the input IDs,
            with shape [sequence_length].
        chunk_size (Optional[int]): Sequence dimension chunk size for computing log probabilities.
        sampling_params (TrainingSamplingParams, optional): Sampling parameters for Top-k/Top-p filtering and temperature scaling.

    Returns:
        torch.Tensor: Log probabilities for the given input IDs.
    """
    device_mesh = vocab_parallel_logits.device_mesh
    if seq_index is not None:
        assert (
            device_mesh.mesh_dim_names is not None
            and "cp" in device_mesh.mesh_dim_names
        ), "seq_index must be provided for cp sharded logits"

    tp_size = 1

    tp_group = device_mesh.get_group("tp")
    tp_rank = tp_group.rank()
    tp_size = tp_group.size()

    vocab_interval_per_rank = vocab_parallel_logits.shape[-1] // tp_size

    return dtensor_from_parallel_logits_to_logprobs(
        vocab_parallel_logits.to_local(),
        input_ids,
        vocab_interval_per_rank * tp_rank,
        (tp_rank + 1) * vocab_interval_per_rank,
        tp_group,
        inference_only=not torch.is_grad_enabled(),
        seq_index=seq_index,
        chunk_size=chunk_size,
        sampling_params=sampling_params,
    )


def get_next_token_logprobs_from_logits(
    input_ids: torch.Tensor,
    next_token_logits: torch.Tensor,
    seq_index: Optional[torch.Tensor] = None,
    vocab_parallel_rank: Optional[int] = None,
    vocab_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
    context_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
    sampling_params: Optional[TrainingSamplingParams] = None,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """Compute token log-probabilities from logits, handling parallel and non-parallel cases.

    This function handles three cases:
    1. Vocab parallel (Megatron-style): uses from_parallel_logits_to_logprobs
    2. DTensor: uses get_logprobs_from_vocab_parallel_logits
    3. Non-parallel: applies top-k/top-p filtering, log_softmax, and gather

    Args:
        input_ids: Input token IDs of shape [batch_size, seq_len]
        next_token_logits: Logits tensor of shape [batch_size, seq_len, vocab_size]
        seq_index: Sequence index tensor for DTensor path
        vocab_parallel_rank: Rank in the vocab parallel group (required if vocab_parallel_group is provided)
        vocab_parallel_group: Process group for vocab parallelism
        context_parallel_group: Process group for context parallelism
        sampling_params: Sampling parameters for top-k/top-p filtering
        chunk_size: Sequence-dim chunk size for the vocab-parallel path; only
            applied without top-k/top-p sampling.

    Returns:
        Token log-probabilities of shape [batch_size, seq_len - 1]
    """
    # ChunkedDistributedLogprob casts each chunk to float32 internally.
    use_chunking = (
        vocab_parallel_group is not None
        and chunk_size is not None
        and not need_top_k_or_top_p_filtering(sampling_params)
    )
    if not use_chunking:
        next_token_logits = next_token_logits.to(torch.float32)

    if vocab_parallel_group is not None:
        assert vocab_parallel_rank is not None, (
            "vocab_parallel_rank must be provided when vocab_parallel_group is provided"
        )
        logprobs = from_parallel_logits_to_logprobs(
            next_token_logits,
            input_ids,
            vocab_start_index=vocab_parallel_rank * next_token_logits.shape[-1],
            vocab_end_index=(vocab_parallel_rank + 1) * next_token_logits.shape[-1],
            tp_group=vocab_parallel_group,
            inference_only=False,
            cp_group=context_parallel_group,
            sampling_params=sampling_params,
            chunk_size=chunk_size if use_chunking else None,
        )
        # slice off to the correct length to remove potential CP padding
        logprobs = logprobs[:, : input_ids.shape[1] - 1]

    elif isinstance(next_token_logits, torch.distributed.tensor.DTensor):
        logprobs = get_logprobs_from_vocab_parallel_logits(
            next_token_logits,
            input_ids,
            seq_index=seq_index,
            sampling_params=sampling_params,
        )

    else:
        # Remove last position's logits
        next_token_logits_wo_last = next_token_logits[:, :-1]
        # Apply top-k and top-p filtering
        next_token_logits_wo_last, _ = apply_top_k_top_p(
            next_token_logits_wo_last,
            top_k=sampling_params.top_k if sampling_params is not None else None,
            top_p=sampling_params.top_p if sampling_params is not None else 1.0,
        )
        # Compute logprobs
        next_token_logprobs = torch.nn.functional.log_softmax(
            next_token_logits_wo_last, dim=-1
        )
        next_tokens = input_ids[:, 1:].cuda()  # Skip first token
        logprobs = next_token_logprobs.gather(
            dim=-1, index=next_tokens.unsqueeze(-1)
        ).squeeze(-1)

    return logprobs


@torch.no_grad()
def distributed_vocab_topk(
    vocab_parallel_logits: torch.Tensor,
    k: int,
    tp_group: torch.distributed.ProcessGroup,
    *,
    vocab_start_index: int,
    vocab_end_index: int,
    chunk_size: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute global top-k over TP-sharded vocabulary logits.

    Args:
        vocab_parallel_logits: [B, S, V_local]
        k: number of top tokens to select globally
        tp_group: tensor-parallel process group
        vocab_start_index: global vocab start for this rank (inclusive)
        vocab_end_index: global vocab end for this rank (exclusive)
        chunk_size: optional chunk along sequence dim to bound memory

    Returns:
        topk_vals: [B, S, k]
        topk_global_indices: [B, S, k] (global token ids)
    """
    assert vocab_end_index > vocab_start_index
    world_size = torch.distributed.get_world_size(tp_group)

    B, S, V_local = vocab_parallel_logits.shape
    V_total = V_local * world_size
    K_eff = int(min(k, max(1, V_total)))

    if chunk_size is None:
        chunk_size = S

    vals_chunks: list[torch.Tensor] = []
    idx_chunks: list[torch.Tensor] = []

    for s0 in range(0, S, chunk_size):
        s1 = min(S, s0 + chunk_size)
        # Upcast only the current slice to bound the fp32 working set to
        # [B, chunk_size, V_local] (chunk_size driven by logprob_chunk_size).
        logits_chunk = vocab_parallel_logits[:, s0:s1, :].to(dtype=torch.float32)
        # local top-k on this TP rank
        local_vals, local_idx_local = torch.topk(logits_chunk, min(k, V_local), dim=-1)
        local_idx_global = local_idx_local + int(vocab_start_index)

        # gather candidates from all TP ranks
        gathered_vals = [torch.empty_like(local_vals) for _ in range(world_size)]
        gathered_idx = [torch.empty_like(local_idx_global) for _ in range(world_size)]
        torch.distributed.all_gather(gathered_vals, local_vals, group=tp_group)
        torch.distributed.all_gather(gathered_idx, local_idx_global, group=tp_group)

        all_vals = torch.cat(gathered_vals, dim=-1)
        all_idx = torch.cat(gathered_idx, dim=-1)

        sel_vals, sel_pos = torch.topk(all_vals, K_eff, dim=-1)
        sel_idx = torch.gather(all_idx, dim=-1, index=sel_pos)

        vals_chunks.append(sel_vals)
        idx_chunks.append(sel_idx)

    topk_vals = (
        torch.cat(vals_chunks, dim=1) if len(vals_chunks) > 1 else vals_chunks[0]
    )
    topk_global_indices = (
        torch.cat(idx_chunks, dim=1) if len(idx_chunks) > 1 else idx_chunks[0]
    )

    return topk_vals, topk_global_indices


def gather_logits_at_global_indices(
    vocab_parallel_logits: torch.Tensor,
    global_indices: torch.Tensor,
    tp_group: Optional[torch.distributed.ProcessGroup] = None,
    cp_group: Optional[torch.distributed.ProcessGroup] = None,
    *,
    vocab_start_index: int,
    vocab_end_index: int,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """Gather student logits at given global token indices under TP+CP sharding.

    Differentiable w.r.t. vocab_parallel_logits.

    Args:
        vocab_parallel_logits: [B, S_cp, V_local] where S_cp is CP sharded sequence length
        global_indices: [B, S_full, k] where S_full is full sequence length
        tp_group: Optional tensor-parallel process group. If None, treats logits as full-vocab (no TP) and skips TP all-reduce.
        vocab_start_index: global vocab start for this rank (inclusive)
        vocab_end_index: global vocab end for this rank (exclusive)
        chunk_size: optional chunk along sequence dim to bound memory
        cp_group: Optional context-parallel process group

    Returns:
        gathered_logits: [B, S_full, k]
    """
    # CP support: get CP group and size
    cp_size = 1 if cp_group is None else torch.distributed.get_world_size(cp_group)

    # Handle CP sharding of global_indices (similar to from_parallel_logits_to_logprobs)
    pad_len = 0
    if cp_size > 1:
        # Pad the global_indices to local size * cp_size if needed
        pad_len = vocab_parallel_logits.shape[1] * cp_size - global_indices.shape[1]
        if pad_len > 0:
            global_indices = torch.nn.functional.pad(
                global_indices, (0, 0, 0, pad_len), value=0
            )

        # Shard the global_indices by context parallelism
        cp_rank = torch.distributed.get_rank(cp_group)
        global_indices = _get_tokens_on_this_cp_rank(
            global_indices, cp_rank, cp_size, seq_dim=1
        )

    B, S, V_local = vocab_parallel_logits.shape
    if chunk_size is None:
        chunk_size = S

    out_chunks: list[torch.Tensor] = []
    for s0 in range(0, S, chunk_size):
        s1 = min(S, s0 + chunk_size)
        # Upcast only the current slice to bound the fp32 working set to
        # [B, chunk_size, V_local] (chunk_size driven by logprob_chunk_size).
        logits_chunk = vocab_parallel_logits[:, s0:s1, :].to(dtype=torch.float32)
        gi = global_indices[:, s0:s1, :]

        in_range = (gi >= int(vocab_start_index)) & (gi < int(vocab_end_index))
        # Map global ids to local shard ids and clamp to valid range to avoid OOB gather
        li = (gi - int(vocab_start_index)).clamp(min=0, max=V_local - 1)

        local_vals = torch.gather(logits_chunk, dim=-1, index=li)
        local_vals = local_vals * in_range.to(dtype=local_vals.dtype)

        if tp_group is not None:
            torch.distributed.all_reduce(
                local_vals, op=torch.distributed.ReduceOp.SUM, group=tp_group
            )
        out_chunks.append(local_vals)

    gathered_logits = (
        torch.cat(out_chunks, dim=1) if len(out_chunks) > 1 else out_chunks[0]
    )

    # CP gather: gather the logits by context parallelism
    if cp_size > 1:
        gathered_logits = allgather_cp_sharded_tensor(
            gathered_logits, cp_group, seq_dim=1
        )

        # Remove padding if we added it earlier
        if pad_len > 0:
            gathered_logits = gathered_logits[:, :-pad_len, :]

    return gathered_logits


def get_distillation_topk_logprobs_from_logits(
    student_logits: torch.Tensor,
    teacher_topk_logits: torch.Tensor,
    teacher_topk_indices: torch.Tensor,
    zero_outside_topk: bool,
    calculate_entropy: bool,
    vocab_parallel_rank: Optional[int] = None,
    vocab_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
    context_parallel_group: Optional[torch.distributed.ProcessGroup] = None,
):
    """Compute top-k log probabilities from logits."""
    if teacher_topk_indices.shape[-1] <= 0:
        raise ValueError(
            f"topk must be positive, got {teacher_topk_indices.shape[-1]}. "
            "topk=0 is not supported as it would result in empty tensor operations."
        )

    # Ensure float32 for stability
    student_logits = student_logits.to(torch.float32)
    # Move teacher topk indices to the same device as student logits
    teacher_topk_indices = teacher_topk_indices.to(student_logits.device)

    # CP support: get CP group and size
    cp_group = context_parallel_group
    cp_size = 1 if cp_group is None else torch.distributed.get_world_size(cp_group)

    # Process based on the student logits type
    if vocab_parallel_group is not None:
        assert vocab_parallel_rank is not None, (
            "vocab_parallel_rank must be provided when vocab_parallel_group is provided"
        )
        student_logits = student_logits
        parallel_group = vocab_parallel_group

        V_local = int(student_logits.shape[-1])
        vocab_start_index = vocab_parallel_rank * V_local
        vocab_end_index = (vocab_parallel_rank + 1) * V_local

    elif isinstance(student_logits, torch.distributed.tensor.DTensor):
        device_mesh = student_logits.device_mesh
        tp_group = device_mesh.get_group("tp")

        student_logits = student_logits.to_local()
        parallel_group = tp_group

        tp_rank = tp_group.rank()
        V_local = int(student_logits.shape[-1])
        vocab_start_index = tp_rank * V_local
        vocab_end_index = (tp_rank + 1) * V_local

        # For DTensor, derive CP group/size from the device mesh to ensure CP-aware alignment
        if (
            device_mesh.mesh_dim_names is not None
            and "cp" in device_mesh.mesh_dim_names
        ):
            cp_group = device_mesh.get_group("cp")
            cp_size = cp_group.size()
        else:
            cp_group = None
            cp_size = 1

    else:
        student_logits = student_logits
        parallel_group = None

    # Process based on the zero_outside_topk setting
    H_all = None
    if zero_outside_topk:
        # Distributed processing
        if parallel_group is not None:
            indices_local = teacher_topk_indices
            pad_len = 0

            if cp_size > 1:
                pad_len = student_logits.shape[1] * cp_size - indices_local.shape[1]
                if pad_len > 0:
                    indices_local = torch.nn.functional.pad(
                        indices_local, (0, 0, 0, pad_len), value=0
                    )
                cp_rank = torch.distributed.get_rank(cp_group)
                indices_local = _get_tokens_on_this_cp_rank(
                    indices_local, cp_rank, cp_size, seq_dim=1
                )

            seq_len_local = int(student_logits.shape[1])
            chunk_size = max(1, min(seq_len_local, 1024))
            student_topk_logprobs = ChunkedDistributedGatherLogprob.apply(  # type: ignore
                student_logits,
                indices_local,
                vocab_start_index,
                vocab_end_index,
                chunk_size,
                parallel_group,
                False,
            )

            if calculate_entropy:
                H_all = ChunkedDistributedEntropy.apply(  # type: ignore
                    student_logits,
                    chunk_size,
                    parallel_group,
                    False,
                )

            if cp_size > 1:
                student_topk_logprobs = allgather_cp_sharded_tensor(
                    student_topk_logprobs, cp_group, seq_dim=1
                )
                if calculate_entropy:
                    H_all = allgather_cp_sharded_tensor(H_all, cp_group, seq_dim=1)
                if pad_len > 0:
                    student_topk_logprobs = student_topk_logprobs[:, :-pad_len, :]
                    if calculate_entropy:
                        H_all = H_all[:, :-pad_len]

        # Non-distributed processing
        else:
            student_logprobs = torch.nn.functional.log_softmax(student_logits, dim=-1)
            student_topk_logprobs = student_logprobs.gather(
                dim=-1, index=teacher_topk_indices
            )

            if calculate_entropy:
                H_all = (student_logprobs.exp() * student_logprobs).sum(-1)

    else:
        # Distributed processing
        if parallel_group is not None or cp_size > 1:
            if parallel_group is None:
                vocab_start_index = 0
                vocab_end_index = int(student_logits.shape[-1])

            student_topk_logits = gather_logits_at_global_indices(
                student_logits,
                teacher_topk_indices,
                tp_group=parallel_group,
                cp_group=cp_group,
                vocab_start_index=vocab_start_index,
                vocab_end_index=vocab_end_index,
            )

        # Non-distributed processing
        else:
            student_topk_logits = student_logits.gather(
                dim=-1, index=teacher_topk_indices
            )

        student_topk_logprobs = torch.nn.functional.log_softmax(
            student_topk_logits, dim=-1
        )

    # Move teacher tensors to the same device/dtype as student_topk_logits
    teacher_topk_logits = teacher_topk_logits.to(
        student_topk_logprobs.device, dtype=student_topk_logprobs.dtype
    )
    teacher_topk_logprobs = torch.nn.functional.log_softmax(teacher_topk_logits, dim=-1)

    # Single point of next-token alignment after TP/CP processing
    teacher_topk_logprobs = teacher_topk_logprobs[:, :-1, :]
    student_topk_logprobs = student_topk_logprobs[:, :-1, :]

    if calculate_entropy:
        H_all = H_all[:, :-1]

    return student_topk_logprobs, teacher_topk_logprobs, H_all


class ChunkedDistributedEntropy(torch.autograd.Function):
    """Compute H_all = sum_v p_v log p_v across TP with chunking over sequence.

    Forward returns [B, S] tensor of global entropy; backward propagates through logits.
    """

    @staticmethod
    def forward(  # pyrefly: ignore[bad-override]
        ctx: Any,
        vocab_parallel_logits: torch.Tensor,  # [B, S, V_local]
        chunk_size: int,
        tp_group: torch.distributed.ProcessGroup,
        inference_only: bool = False,
    ) -> torch.Tensor:
        B, S, _ = vocab_parallel_logits.shape
        num_chunks = (int(S) + chunk_size - 1) // chunk_size
        out_chunks: list[torch.Tensor] = []

        for chunk_idx in range(num_chunks):
            s0 = chunk_idx * chunk_size
            s1 = min(int(S), (chunk_idx + 1) * chunk_size)

            logits = vocab_parallel_logits[:, s0:s1, :].to(dtype=torch.float32)
            log_probs = _compute_distributed_log_softmax(logits, group=tp_group)
            softmax_output = log_probs.exp()
            H_local = (softmax_output * log_probs).sum(dim=-1)  # [B, Sc]
            torch.distributed.all_reduce(
                H_local, op=torch.distributed.ReduceOp.SUM, group=tp_group
            )
            out_chunks.append(H_local)

        H_all = torch.cat(out_chunks, dim=1) if len(out_chunks) > 1 else out_chunks[0]

        if not inference_only:
            ctx.save_for_backward(vocab_parallel_logits)
            ctx.chunk_size = int(chunk_size)
            ctx.tp_group = tp_group

        return H_all.contiguous()

    @staticmethod
    def backward(
        ctx: Any, *grad_outputs: torch.Tensor
    ) -> tuple[torch.Tensor, None, None, None]:
        grad_output = grad_outputs[0]  # [B, S]
        (vocab_parallel_logits,) = ctx.saved_tensors
        chunk_size: int = ctx.chunk_size
        tp_group = ctx.tp_group

        B, S, V_local = vocab_parallel_logits.shape
        num_chunks = (int(S) + chunk_size - 1) // chunk_size

        grad_input: torch.Tensor = torch.empty_like(
            vocab_parallel_logits, dtype=torch.float32
        )

        for chunk_idx in range(num_chunks):
            s0 = chunk_idx * chunk_size
            s1 = min(int(S), (chunk_idx + 1) * chunk_size)

            logits = vocab_parallel_logits[:, s0:s1, :].to(dtype=torch.float32)
            log_probs = _compute_distributed_log_softmax(logits, group=tp_group)
            softmax_output = log_probs.exp()
            H_local = (softmax_output * log_probs).sum(dim=-1)
            torch.distributed.all_reduce(
                H_local, op=torch.distributed.ReduceOp.SUM, group=tp_group
            )

            # Inplace index into the preallocated grad_input tensor
            grad_input_chunk = grad_input[:, s0:s1, :]

            # dH/dz = softmax * (log_probs - H_all)
            grad_input_chunk.copy_(
                softmax_output.mul_(log_probs - H_local.unsqueeze(-1))
            )  # inplace copy
            grad_input_chunk.mul_(grad_output[:, s0:s1].unsqueeze(-1))

            # Explicitly free before next iteration allocates
            del softmax_output, log_probs, logits, H_local

        return grad_input, None, None, None


def from_parallel_hidden_states_to_logprobs(
    tensor_parallel_hidden_states: torch.Tensor,
    output_weight_layer: torch.Tensor,
    runtime_gather_output: bool,
    target: torch.Tensor,
    vocab_start_index: int,
    vocab_end_index: int,
    tp_group: torch.distributed.ProcessGroup,
    inference_only: bool = False,
    cp_group: Optional[torch.distributed.ProcessGroup] = None,
    chunk_size: Optional[int] = None,
) -> torch.Tensor:
    """Get log probabilities from TP sharded hidden states."""
    target = target.roll(shifts=-1, dims=-1)
    assert cp_group is None or torch.distributed.get_world_size(cp_group) == 1, (
        "Context parallelism is not supported for linear CE fusion loss"
    )
    logprobs: torch.Tensor = ChunkedDistributedHiddenStatesToLogprobs.apply(  # type: ignore
        tensor_parallel_hidden_states,
        target,
        output_weight_layer,
        vocab_start_index,
        vocab_end_index,
        chunk_size,
        tp_group,
        inference_only,
    ).contiguous()

    return logprobs[:, :-1]


class ChunkedDistributedHiddenStatesToLogprobs(torch.autograd.Function):
    """Compute distributed log-softmax once and gather logprobs at given global indices."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor_parallel_hidden_states: torch.Tensor,
        target: torch.Tensor,
        output_weight_layer: torch.Tensor,
        vocab_start_index: int,
        vocab_end_index: int,
        chunk_size: int,
        tp_group: torch.distributed.ProcessGroup,
        inference_only: bool = False,
    ) -> torch.Tensor:
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = target - vocab_start_index
        masked_target[target_mask] = 0
        tp_group_size = torch.distributed.get_world_size(tp_group)
        if tp_group_size > 1:
            original_tensor_parallel_hidden_states = (
                tensor_parallel_hidden_states.clone()
            )
            all_hidden_states = [
                torch.zeros_like(tensor_parallel_hidden_states)
                for _ in range(tp_group_size)
            ]
            torch.distributed.all_gather(
                all_hidden_states, tensor_parallel_hidden_states, group=tp_group
            )
            tensor_parallel_hidden_states = torch.cat(all_hidden_states, dim=0)
        else:
            original_tensor_parallel_hidden_states = tensor_parallel_hidden_states
        seq_size = int(tensor_parallel_hidden_states.shape[0])
        num_chunks = (seq_size + chunk_size - 1) // chunk_size
        all_log_probs = []
        for chunk_idx in range(num_chunks):
            chunk_start = chunk_idx * chunk_size
            chunk_end = min(seq_size, (chunk_idx + 1) * chunk_size)
            logits = torch.matmul(
                tensor_parallel_hidden_states[chunk_start:chunk_end, :, :],
                output_weight_layer.T,
            )
            logits = logits.to(dtype=torch.float32).transpose(0, 1).contiguous()
            log_probs = _compute_distributed_log_softmax(
                logits,
                group=tp_group,
            )

            log_probs = (
                torch.gather(
                    log_probs, -1, masked_target[:, chunk_start:chunk_end].unsqueeze(-1)
                )
                .squeeze(-1)
                .detach()
            )
            log_probs[target_mask[:, chunk_start:chunk_end]] = 0.0

            all_log_probs.append(log_probs)

        log_probs = torch.cat(all_log_probs, dim=1)
        torch.distributed.all_reduce(
            log_probs,
            op=torch.distributed.ReduceOp.SUM,
            group=tp_group,
        )
        if not inference_only:
            # only save for backward when we have inference only=False
            # save tensor_parallel_hidden_states and the output_layer to the context
            ctx.save_for_backward(
                original_tensor_parallel_hidden_states.detach(),
                target_mask.detach(),
                masked_target.detach(),
                output_weight_layer.detach(),
            )
            ctx.chunk_size = chunk_size
            ctx.tp_group = tp_group

        return log_probs

    @staticmethod
    def backward(
        ctx: Any, *grad_outputs: torch.Tensor
    ) -> tuple[torch.Tensor, None, torch.Tensor, None, None, None, None, None]:
        grad_output = grad_outputs[0]
        # the tensor_parallel_hidden_states is already all gathered in the forward pass
        (
            tensor_parallel_hidden_states,
            target_mask,
            masked_target,
            output_weight_layer,
        ) = ctx.saved_tensors
        tp_group = ctx.tp_group
        tp_group_size = torch.distributed.get_world_size(tp_group)
        if tp_group_size > 1:
            all_hidden_states = [
                torch.zeros_like(tensor_parallel_hidden_states)
                for _ in range(tp_group_size)
            ]
            torch.distributed.all_gather(
                all_hidden_states, tensor_parallel_hidden_states, group=tp_group
            )
            tensor_parallel_hidden_states = torch.cat(all_hidden_states, dim=0)
        chunk_size = ctx.chunk_size
        tp_group = ctx.tp_group
        # this is the vocab size for this partition when the output_layer is a ColumnParallelLinear
        partition_vocab_size = output_weight_layer.size(0)
        seq_size = int(tensor_parallel_hidden_states.shape[0])
        num_chunks = (seq_size + chunk_size - 1) // chunk_size
        all_grad_input_hidden_states = []
        all_grad_input_output_layer = []
        grad_input_output_layer = torch.zeros_like(output_weight_layer)
        for chunk_idx in range(num_chunks):
            chunk_start = chunk_idx * chunk_size
            chunk_end = min(seq_size, (chunk_idx + 1) * chunk_size)
            # recalculate the logits using the output_layer
            logits = torch.matmul(
                tensor_parallel_hidden_states[chunk_start:chunk_end, :, :],
                output_weight_layer.T,
            )
            logits = logits.to(dtype=torch.float32).transpose(0, 1).contiguous()
            softmax_output = _compute_distributed_log_softmax(
                logits,
                group=tp_group,
            )
            softmax_output = softmax_output.exp().detach()
            is_chosen = (~(target_mask[:, chunk_start:chunk_end])).unsqueeze(
                -1
            ) * torch.nn.functional.one_hot(
                masked_target[:, chunk_start:chunk_end],
                num_classes=partition_vocab_size,
            )
            grad_input = is_chosen.float().sub_(softmax_output)
            used_grad_output = grad_output[:, chunk_start:chunk_end]
            grad_input.mul_(used_grad_output.unsqueeze(dim=-1))
            grad_input_hidden_states = torch.matmul(
                grad_input, output_weight_layer.to(dtype=torch.float32)
            )  # [chunk_start:chunk_end, :, :]
            grad_input_output_layer_local = torch.einsum(
                "bsd, bsv -> dv",
                tensor_parallel_hidden_states[chunk_start:chunk_end, :, :]
                .transpose(0, 1)
                .contiguous()
                .to(dtype=torch.float32),
                grad_input.to(dtype=torch.float32),
            )
            all_grad_input_hidden_states.append(grad_input_hidden_states)
            grad_input_output_layer.add_(
                grad_input_output_layer_local.transpose(0, 1).contiguous()
            )

        grad_input_hidden_states = (
            torch.cat(all_grad_input_hidden_states, dim=1).transpose(0, 1).contiguous()
        )
        weight_grad = grad_input_output_layer
        local_seq_size = seq_size // tp_group_size

        sharded_grad_hidden_states = torch.empty_like(
            grad_input_hidden_states[:local_seq_size]
        )
        grad_input_hidden_states_list = list(
            torch.chunk(grad_input_hidden_states, chunks=tp_group_size, dim=0)
        )
        torch.distributed.reduce_scatter(
            sharded_grad_hidden_states,
            grad_input_hidden_states_list,
            op=torch.distributed.ReduceOp.SUM,
            group=tp_group,
        )

        return (
            sharded_grad_hidden_states,
            None,
            weight_grad,
            None,
            None,
            None,
            None,
            None,
        )


def patch_gpt_model_forward_for_linear_ce_fusion(*, chunk_size: int) -> None:
    from megatron.core.models.gpt import GPTModel

    if getattr(GPTModel, "_linear_ce_fusion_forward_patched", False):
        GPTModel._linear_ce_fusion_chunk_size = chunk_size
        return
    GPTModel._original_forward_for_linear_ce_fusion = GPTModel.forward
    GPTModel._linear_ce_fusion_chunk_size = chunk_size
    GPTModel.forward = _gpt_forward_with_linear_ce_fusion
    GPTModel._linear_ce_fusion_forward_patched = True


def _gpt_forward_with_linear_ce_fusion(
    self: "GPTModel",
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    decoder_input: torch.Tensor = None,
    labels: torch.Tensor = None,
    inference_context: Any = None,
    packed_seq_params: Any = None,
    extra_block_kwargs: Optional[dict] = None,
    runtime_gather_output: Optional[bool] = None,
    *,
    inference_params: Optional[Any] = None,
    loss_mask: Optional[torch.Tensor] = None,
    padding_mask: Optional[torch.Tensor] = None,
    is_spec_decode: Optional[bool] = None,
    return_logprobs_for_linear_ce_fusion: bool = False,
) -> torch.Tensor:
    from megatron.core.parallel_state import (
        get_tensor_model_parallel_group,
        get_tensor_model_parallel_rank,
    )
    from megatron.core.utils import deprecate_inference_params, get_pg_size

    if not return_logprobs_for_linear_ce_fusion:
        passthrough_kwargs: dict[str, Any] = {}
        # is_spec_decode was added to GPTModel.forward in newer Megatron-LM. Only
        # forward it when a caller (e.g. mcore inference) actually set it, so we
        # stay compatible with older signatures that don't accept the kwarg.
        if is_spec_decode is not None:
            passthrough_kwargs["is_spec_decode"] = is_spec_decode
        return self._original_forward_for_linear_ce_fusion(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            decoder_input=decoder_input,
            labels=labels,
            inference_context=inference_context,
            packed_seq_params=packed_seq_params,
            extra_block_kwargs=extra_block_kwargs,
            runtime_gather_output=runtime_gather_output,
            inference_params=inference_params,
            loss_mask=loss_mask,
            padding_mask=padding_mask,
            **passthrough_kwargs,
        )
    """
    original forward function signature:
    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        attention_mask: Tensor,
        decoder_input: Tensor = None,
        labels: Tensor = None,
        inference_context: BaseInferenceContext = None,
        packed_seq_params: PackedSeqParams = None,
        extra_block_kwargs: dict = None,
        runtime_gather_output: Optional[bool] = None,
        *,
        inference_params: Optional[BaseInferenceContext] = None,
        loss_mask: Optional[Tensor] = None,
        padding_mask: Optional[Tensor] = None,
    ) -> Tensor:
    """
    if labels is None:
        raise ValueError("labels must be provided when linear CE fusion is enabled")

    inference_context = deprecate_inference_params(inference_context, inference_params)

    preproc_output = self._preprocess(
        input_ids=input_ids,
        position_ids=position_ids,
        decoder_input=decoder_input,
        inference_context=inference_context,
        packed_seq_params=packed_seq_params,
        padding_mask=padding_mask,
    )
    (
        decoder_input,
        rotary_pos_emb,
        rotary_pos_cos,
        rotary_pos_sin,
        sequence_len_offset,
        padding_mask,
    ) = preproc_output[:6]
    rotary_pos_cos_sin = preproc_output[6] if len(preproc_output) == 7 else None

    hidden_states = self.decoder(
        hidden_states=decoder_input,
        attention_mask=attention_mask,
        inference_context=inference_context,
        rotary_pos_emb=rotary_pos_emb,
        rotary_pos_cos=rotary_pos_cos,
        rotary_pos_sin=rotary_pos_sin,
        rotary_pos_cos_sin=rotary_pos_cos_sin,
        packed_seq_params=packed_seq_params,
        sequence_len_offset=sequence_len_offset,
        padding_mask=padding_mask,
        **(extra_block_kwargs or {}),
    )

    # Non post-process pipeline stages do not own the output layer.
    if not self.post_process or not hasattr(self, "output_layer"):
        return hidden_states

    tp_rank = get_tensor_model_parallel_rank()
    tp_size = get_pg_size(get_tensor_model_parallel_group())
    # calculate the logprobs for the last token and then return the logprobs
    vocab_start_index = tp_rank * (self.vocab_size // tp_size)
    vocab_end_index = min((tp_rank + 1) * (self.vocab_size // tp_size), self.vocab_size)
    # For models with tied embeddings (e.g. Qwen3), self.output_layer.weight is None —
    # the real weight lives on the embedding and must be fetched via
    # shared_embedding_or_output_weight().
    output_weight_layer = (
        self.shared_embedding_or_output_weight()
        if self.share_embeddings_and_output_weights
        else self.output_layer.weight
    )
    logprobs = from_parallel_hidden_states_to_logprobs(
        hidden_states,  # .transpose(0, 1).contiguous(),
        output_weight_layer,
        runtime_gather_output,
        labels,
        vocab_start_index=vocab_start_index,
        vocab_end_index=vocab_end_index,
        inference_only=inference_context is not None and not self.training,
        tp_group=get_tensor_model_parallel_group(),
        cp_group=self.cp_group,
        chunk_size=self._linear_ce_fusion_chunk_size,
    )
    return logprobs


def all_to_all_vp2sq(
    vocab_parallel_logits: torch.Tensor,
    tp_group: torch.distributed.ProcessGroup,
) -> torch.Tensor:
    """Convert vocab-parallel logits to batch-sequence-parallel logits via all-to-all.

    Note: This partitions the flattened B*S dimension, not just S. The input vocab_parallel_logits
    need to be 2D tensor.

    Transforms [BS, V_local] -> [BS_local, V] where:
    - V_local = V / tp_size (vocab is sharded)
    - BS_local = BS / tp_size (batch-sequence will be sharded)
    - Requires BS to be divisible by tp_size

    Args:
        vocab_parallel_logits: [BS, V_local] tensor with vocab dimension sharded
        tp_group: Tensor parallel process group

    Returns:
        Batch-sequence-parallel logits [BS_local, V] with batch-sequence dimension sharded
    """
    if vocab_parallel_logits.ndim != 2:
        raise ValueError(
            "For all_to_all_vp2sq, vocab_parallel_logits must be a 2D tensor, "
            f"got {vocab_parallel_logits.ndim}D tensor with shape {vocab_parallel_logits.shape}"
        )

    world_size = torch.distributed.get_world_size(tp_group)
    BS, V_local = vocab_parallel_logits.shape

    if BS % world_size != 0:
        raise ValueError(
            f"BS={BS} must be divisible by tensor parallel size {world_size}. "
            f"Set policy.make_sequence_length_divisible_by to ensure divisibility."
        )

    BS_local = BS // world_size

    # Flatten and perform all-to-all: exchanges B*S chunks for vocab slices
    input_flat = vocab_parallel_logits.flatten()
    output_flat = torch.empty_like(input_flat)
    torch.distributed.all_to_all_single(output_flat, input_flat, group=tp_group)

    # Rearrange output: merge vocab slices from all ranks into full vocabulary
    # Equivalent to: "(w bs v) -> bs (w v)", w=world_size, bs=BS_local, v=V_local
    output_tensor = output_flat.view(world_size, BS_local, V_local)
    output_tensor = output_tensor.permute(1, 0, 2)
    output_tensor = output_tensor.reshape(BS_local, world_size * V_local)

    return output_tensor


def all_to_all_sq2vp(
    seq_parallel_logits: torch.Tensor,
    tp_group: torch.distributed.ProcessGroup,
) -> torch.Tensor:
    """Convert batch-sequence-parallel logits to vocab-parallel logits via all-to-all.

    Inverse operation of all_to_all_vp2sq.

    Transforms [BS_local, V] -> [BS, V_local] where:
    - BS_local = BS / tp_size (batch-sequence is sharded)
    - V_local = V / tp_size (vocab will be sharded)

    Args:
        seq_parallel_logits: [BS_local, V] tensor with batch-sequence dimension sharded
        tp_group: Tensor parallel process group

    Returns:
        Vocab-parallel logits [BS, V_local] with vocab dimension sharded
    """
    if seq_parallel_logits.ndim != 2:
        raise ValueError(
            "For all_to_all_sq2vp, seq_parallel_logits must be a 2D tensor, "
            f"got {seq_parallel_logits.ndim}D tensor with shape {seq_parallel_logits.shape}"
        )

    world_size = torch.distributed.get_world_size(tp_group)
    BS_local, V = seq_parallel_logits.shape

    if V % world_size != 0:
        raise ValueError(
            f"Vocabulary size {V} must be divisible by tensor parallel size {world_size}"
        )

    V_local = V // world_size

    # Rearrange input: split vocab into chunks for sending to different ranks
    # Equivalent to: "bs (w v) -> (w bs v)", w=world_size, bs=BS_local, v=V_local
    input_reshaped = seq_parallel_logits.view(BS_local, world_size, V_local)
    input_permuted = input_reshaped.permute(1, 0, 2).contiguous()
    input_flat = input_permuted.flatten()

    # Perform all-to-all: exchanges vocab slices for B*S chunks
    output_flat = torch.empty_like(input_flat)
    torch.distributed.all_to_all_single(output_flat, input_flat, group=tp_group)

    # Reshape output: merge B*S slices from all ranks into full batch-sequence dimension
    output_tensor = output_flat.reshape(world_size * BS_local, V_local)

    return output_tensor
