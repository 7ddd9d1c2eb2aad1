"""A megatron-core trainer as a stack's actor for `stack_bitwise.py --stack megatron`: the bitwise
GPTModel (`fp8_align.megatron_ext.bitwise.build_bitwise_gpt`) inside megatron-core's own
`DistributedDataParallel` (gradients reduced into its FP32 main-grad buffers) and its
`get_megatron_optimizer` (Adam with BF16 parameters and FP32 master weights, gradient clipping);
log-probs through `token_logprobs` (one THD-packed forward per call), a clipped policy-gradient
loss per micro-batch, the weights synced into the engine as HF tensors (`hf_state_dict_from_megatron`
into fp8_align's `refit_weights`, which re-quantizes the FP8 layers in place).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fp8_align.config import FP8Config
from fp8_align.megatron_ext.bitwise import build_bitwise_gpt, token_logprobs
from fp8_align.megatron_ext.hf_bridge import hf_state_dict_from_megatron

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
