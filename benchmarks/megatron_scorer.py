"""megatron-core trainers for the benchmarks. `MegatronBitwiseActor`, a stack's actor for
`stack_bitwise.py --stack megatron`: the bitwise GPTModel (`fp8_align.megatron_ext.bitwise.build_bitwise_gpt`)
inside megatron-core's own `DistributedDataParallel` (gradients reduced into its FP32 main-grad
buffers) and its `get_megatron_optimizer` (Adam with BF16 parameters and FP32 master weights,
gradient clipping); log-probs through `token_logprobs` (one THD-packed forward per call), a clipped
policy-gradient loss per micro-batch, the weights synced into the engine as HF tensors
(`hf_state_dict_from_megatron` into fp8_align's `refit_weights`, which re-quantizes the FP8 layers
in place). `MegatronTensorParallelScorer`, the scorer of `on_policy_bitwise.py --scorer megatron
--tensor-parallel-size 2`: the bitwise GPTModel at Megatron tensor parallel size 2, one process per rank.
"""

from __future__ import annotations

import socket
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from megatron.core import parallel_state

from fp8_align.config import FP8Config
from fp8_align.megatron_ext.bitwise import build_bitwise_gpt, token_logprobs
from fp8_align.megatron_ext.hf_bridge import hf_state_dict_from_megatron

#: Seconds a Megatron rank may take to build its model or to answer one scoring request.
RANK_TIMEOUT_S = 900

#: PPO's ratio clip of the policy-step loss.
CLIP = 0.2


class MegatronBitwiseActor:
    """`token_logprobs` / `policy_step` / `hf_state` of a bitwise GPTModel under Megatron's DDP and optimizer."""

    def __init__(self, path: Path, cfg: FP8Config, kv_scales: Any, device: str, lr: float) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
        self.hf_config = hf.config
        gpt = build_bitwise_gpt(hf, cfg, kv_scales=kv_scales)
        del hf
        self.gpt = gpt
        self.model = DistributedDataParallel(
            config=gpt.config, ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False), module=gpt
        )  # fmt: skip
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, bf16=True, params_dtype=torch.bfloat16, clip_grad=1.0,
                            use_distributed_optimizer=False),
            [self.model],
        )  # fmt: skip

    def token_logprobs(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float) -> list[torch.Tensor]:
        """The bitwise GPTModel's completion log-probs (no gradient)."""
        with torch.no_grad():
            return token_logprobs(self.gpt, sequences, prompt_lens, temperature=temperature)

    def policy_step(
        self, sequences: list[list[int]], prompt_lens: list[int], temperature: float, old_logprobs: list[torch.Tensor],
        advantages: list[float], optimizer: Any = None, micro_batch_size: int = 8,
    ) -> dict[str, float]:  # fmt: skip
        """One policy update: per micro-batch the clipped policy-gradient loss (token mean over the
        batch) backward through Megatron's DDP, then Megatron's optimizer step. Returns the loss and
        the gradient norm; raises FloatingPointError when the optimizer skips the step. `optimizer`
        is the stacks' argument: this actor steps Megatron's own, so it must be None (ValueError)."""
        if optimizer is not None:
            raise ValueError("MegatronBitwiseActor steps megatron-core's own optimizer; pass optimizer=None")
        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        total_tokens = sum(len(s) - p for s, p in zip(sequences, prompt_lens))
        loss_sum = 0.0
        for start in range(0, len(sequences), micro_batch_size):
            part = slice(start, start + micro_batch_size)
            new = token_logprobs(self.gpt, sequences[part], prompt_lens[part], temperature=temperature)
            losses = []
            for logp, old, advantage in zip(new, old_logprobs[part], advantages[part]):
                ratio = torch.exp(logp - old.to(logp.device))
                losses.append(-torch.minimum(ratio * advantage, ratio.clamp(1 - CLIP, 1 + CLIP) * advantage).sum())
            loss = torch.stack(losses).sum() / total_tokens
            loss.backward()
            loss_sum += loss.item()
        self.model.finish_grad_sync()
        success, grad_norm, _ = self.optimizer.step()
        if not success:
            raise FloatingPointError(f"Megatron's optimizer skipped the step (grad norm {grad_norm})")
        return {"loss": loss_sum, "grad_norm": float(grad_norm)}

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The current weights under HF names, for the engine's sync."""
        return hf_state_dict_from_megatron(dict(self.gpt.named_parameters()), self.hf_config, fused_norms=False)


def _serve_rank(
    rank: int, size: int, port: int, path: str, cfg: FP8Config, kv_scales: Any, device_type: str, requests: Any, replies: Any
) -> None:  # fmt: skip
    """Megatron rank `rank` of `size`: its share of the bitwise GPTModel of the checkpoint at `path`
    (GPU `rank` and NCCL on CUDA, gloo on CPU); then, per request (sequences, prompt lengths,
    temperature), its completion log-probs on the host; None ends it. Replies (rank, payload): None
    when built, the log-probs, or the traceback of a failure."""
    from transformers import AutoModelForCausalLM

    try:
        cuda = device_type == "cuda"
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
        parallel_state.initialize_model_parallel(size, 1)
        if cuda:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(0)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device)
        gpt = build_bitwise_gpt(hf, cfg, kv_scales=kv_scales)
        del hf
        replies.put((rank, None))
        while (request := requests.get()) is not None:
            sequences, prompt_lens, temperature = request
            with torch.no_grad():
                replies.put((rank, [t.cpu() for t in token_logprobs(gpt, sequences, prompt_lens, temperature=temperature)]))
    except Exception:  # the parent raises it with this rank's traceback
        replies.put((rank, traceback.format_exc()))
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


class MegatronTensorParallelScorer:
    """`token_logprobs` (BitwiseForward's call) of the bitwise GPTModel at Megatron tensor parallel
    size `size`, against an engine of that size: one spawned process per rank building its share
    from the checkpoint at `path` (`device_type` "cuda": rank r on GPU r). Every rank computes the
    whole log-probs (the output layer's logits are all-gathered); they must agree, and rank 0's
    are returned (FP32 [len - prompt_len] per sequence, on the host). RuntimeError with the rank's
    traceback when one fails; `close()` ends the ranks."""

    def __init__(self, path: Path, cfg: FP8Config, kv_scales: Any, device_type: str, size: int = 2) -> None:
        context = mp.get_context("spawn")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self.requests = [context.Queue() for _ in range(size)]
        self.replies = context.Queue()
        self.ranks = [
            context.Process(target=_serve_rank, args=(rank, size, port, str(path), cfg, kv_scales, device_type, self.requests[rank], self.replies),
                            daemon=True)
            for rank in range(size)
        ]  # fmt: skip
        for process in self.ranks:
            process.start()
        self._collect()

    def _collect(self) -> list[Any]:
        """Every rank's next reply, in rank order."""
        replies: dict[int, Any] = {}
        while len(replies) < len(self.ranks):
            rank, payload = self.replies.get(timeout=RANK_TIMEOUT_S)
            if isinstance(payload, str):
                self.close()
                raise RuntimeError(f"Megatron rank {rank} failed:\n{payload}")
            replies[rank] = payload
        return [replies[rank] for rank in range(len(self.ranks))]

    def token_logprobs(self, sequences: list[list[int]], prompt_lens: list[int], temperature: float = 1.0) -> list[torch.Tensor]:
        for queue in self.requests:
            queue.put((sequences, prompt_lens, temperature))
        first, *others = self._collect()
        for rank, other in enumerate(others, start=1):
            if len(other) != len(first) or not all(torch.equal(a, b) for a, b in zip(first, other)):
                raise RuntimeError(f"Megatron rank {rank}'s log-probs differ from rank 0's")
        return first

    def close(self) -> None:
        """End the rank processes."""
        for queue in self.requests:
            queue.put(None)
        for process in self.ranks:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()
