"""The generation side of the GRPO benchmark: one vLLM engine, fed the trainer's weights as stacks do.

Weight sync is the stacks' own path: inside every worker, `model.load_weights(weights=[(hf_name,
bf16_tensor), ...])`, the call verl's `_update_weights` and OpenRLHF's `WorkerWrap` end in. The
tensors travel as CUDA IPC handles on a GPU (as both stacks send them) and as a safetensors file
on CPU (CPU tensors cannot be shared by handle; collective_rpc arguments are serialized without
their data). On an fp8_align engine that call re-quantizes the FP8 layers in place.

The worker-side functions live in this importable module because vLLM pickles them by name.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fp8_align.config import FP8Config
from fp8_align.quant import quantize_weight_blockwise
from fp8_align.vllm_plugin import engine_kwargs
from fp8_align.vllm_plugin.inspection import portable_fp8_codes
from fp8_align.vllm_plugin.layer_state import is_fp8_align_layer
from fp8_align.vllm_plugin.refit.transport import open_cuda_tensors, share_cuda_tensors


@dataclass(frozen=True)
class Rollout:
    """One sampled completion: token ids and the engine's log-prob of each (nats), and its text."""

    prompt_index: int
    token_ids: list[int]
    logprobs: list[float]
    text: str


def start_engine(checkpoint: Path, fp8: FP8Config | None, seed: int, llm_kwargs: dict[str, Any]) -> Any:
    """`vllm.LLM` on the BF16 checkpoint: stock BF16 when `fp8` is None, else
    `quantization="fp8_align"` with `fp8` (its kv_cache_dtype included), `llm_kwargs` merged in by
    `engine_kwargs` (a bitwise engine refuses at start any of them its mode cannot run)."""
    from vllm import LLM

    kwargs = engine_kwargs(fp8, **llm_kwargs) if fp8 is not None else llm_kwargs
    return LLM(model=str(checkpoint), dtype="bfloat16", seed=seed, **kwargs)


def sample(
    llm: Any, prompts: Sequence[Sequence[int]], group_size: int, max_tokens: int, temperature: float, seed: int,
    ignore_eos: bool = False, use_tqdm: bool = False,
) -> list[Rollout]:
    """`group_size` completions per prompt (groups contiguous, prompt order kept), each request
    seeded with seed + its prompt index; the sampled token's log-prob comes with each token.
    `ignore_eos`: every completion exactly `max_tokens` long. `use_tqdm`: vLLM's progress bar."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [
        SamplingParams(n=group_size, temperature=temperature, max_tokens=max_tokens, logprobs=0, seed=seed + index, ignore_eos=ignore_eos)
        for index in range(len(prompts))
    ]
    results = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=use_tqdm)
    rollouts = []
    for index, result in enumerate(results):
        if len(result.outputs) != group_size:
            raise RuntimeError(f"prompt {index}: engine returned {len(result.outputs)} samples, asked for {group_size}")
        for completion in result.outputs:
            token_ids = list(completion.token_ids)
            if not token_ids:
                raise RuntimeError(f"prompt {index}: the engine returned an empty completion")
            logprobs = [step[token].logprob for token, step in zip(token_ids, completion.logprobs)]
            rollouts.append(Rollout(index, token_ids, logprobs, completion.text))
    return rollouts


def push_weights(llm: Any, weights: dict[str, torch.Tensor]) -> float:
    """Send `weights` (HF name -> BF16 tensor) into every worker through `model.load_weights`,
    then clear the prefix cache (its KV was computed with the old weights). Returns seconds."""
    start = time.perf_counter()
    on_gpu = all(t.is_cuda for t in weights.values())
    if on_gpu:
        llm.collective_rpc(load_weights_from_cuda_ipc, args=(share_cuda_tensors(weights),))
        torch.cuda.synchronize()
    else:
        with tempfile.TemporaryDirectory(prefix="grpo_sync_") as tmp:
            path = str(Path(tmp) / "weights.safetensors")
            save_file({name: t.detach().contiguous().cpu() for name, t in weights.items()}, path)
            llm.collective_rpc(load_weights_from_file, args=(path,))
    llm.reset_prefix_cache()
    return time.perf_counter() - start


def load_weights_from_cuda_ipc(worker: Any, handles: bytes) -> None:
    """Worker side: open the trainer's CUDA tensors and load them in one `model.load_weights` call."""
    tensors = open_cuda_tensors(handles)
    worker.model_runner.model.load_weights(weights=list(tensors.items()))
    torch.cuda.synchronize()


def load_weights_from_file(worker: Any, path: str) -> None:
    """Worker side: one `model.load_weights` call with every tensor of a safetensors file."""
    worker.model_runner.model.load_weights(weights=list(load_file(path).items()))


def engine_module_weight(worker: Any, module_name: str) -> dict[str, Any]:
    """Worker side: what the engine holds for one (unmerged) linear: FP8 codes (portable) and
    scales, or the BF16 weight."""
    module = worker.model_runner.model.get_submodule(module_name)
    if is_fp8_align_layer(module, "linear"):
        return {**portable_fp8_codes(module.weight), "weight_scale_inv": module.weight_scale_inv.detach().cpu()}
    return {"weight": module.weight.detach().cpu()}


def check_engine_weights(llm: Any, module_name: str, trainer_weight: torch.Tensor, fp8: FP8Config | None) -> None:
    """Raise RuntimeError unless every worker's copy of `module_name` is bit-identical to what the
    trainer's BF16 `trainer_weight` [N, K] must become there: the same tensor (BF16 engine) or
    `quantize_weight_blockwise` of it (fp8_align engine; weight-scale rule from `fp8`)."""
    expected_bf16 = trainer_weight.detach().cpu()
    for rank, held in enumerate(llm.collective_rpc(engine_module_weight, args=(module_name,))):
        if "weight_dtype" in held:
            if fp8 is None:
                raise RuntimeError(f"rank {rank}: {module_name} is FP8 on an engine started without fp8_align")
            codes, scales = quantize_weight_blockwise(expected_bf16, pow2_scale=fp8.use_weight_pow2_scale)
            got = held["weight"].view(getattr(torch, held["weight_dtype"]))
            same = torch.equal(got.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(held["weight_scale_inv"], scales)
        else:
            same = torch.equal(held["weight"], expected_bf16)
        if not same:
            raise RuntimeError(f"rank {rank}: the engine's {module_name} is not what the trainer sent")
