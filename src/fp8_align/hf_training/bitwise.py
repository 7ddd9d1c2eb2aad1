"""The trainer half of `FP8Config(on_policy="bitwise")` as one object: `BitwiseForward(model, cfg)`
scores packed sequences with the engine's bits through a copy of the HF model converted by
`make_bitwise` (`fp8_align.hf_training.convert`; the copy shares every Parameter with `model`,
which stays as it is), then takes the engine sampler's log-softmax of the completion positions.
The kernels, their gradients and the tensor-parallel layout are the converted model's
(`bitwise_modules`, `engine_ops`, `stacked`): on CUDA the engine's, on CPU their pure-torch
references, which no CPU engine shares (a CPU engine refuses `on_policy="bitwise"`): the CPU path
checks the plumbing.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from fp8_align.config import FP8Config
from fp8_align.hf_training.attention import KVCacheScales, host_to_device
from fp8_align.hf_training.bitwise_modules import BitwiseContext
from fp8_align.hf_training.convert import frozen_fp8_weights, make_bitwise, set_kv_scales, use_packed_layout
from fp8_align.hf_training.engine_ops import EngineKernels, completion_logprobs
from fp8_align.hf_training.inputs import check_prompt_lens, check_sequences, check_temperature
from fp8_align.hf_training.stacked import check_bitwise_model


def parameter_sharing_copy(model: nn.Module) -> nn.Module:
    """A copy of `model`'s modules that holds the same Parameter objects (gradients, optimizer
    steps and weight syncs reach both; buffers are copied)."""
    return copy.deepcopy(model, {id(p): p for p in model.parameters()})


class BitwiseForward:
    """Token log-probs of packed sequences through the engine's kernels, with gradients.

    `model`: an HF `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM` /
    `Qwen3MoeForCausalLM` in BF16 on one device, left unchanged (a Parameter-sharing copy is converted); `cfg`: the engine's FP8Config
    (`on_policy="bitwise"`; its recipe picks the FP8 layers). Other model families raise
    UnsupportedModelError. With `cfg.kv_cache_dtype == "fp8"` the forward needs the per-layer K/V
    scales the engine generated with: `kv_scales` here or `set_kv_scales`. `tensor_parallel_size`:
    the engine's (one of `TENSOR_PARALLEL_SIZES`); it must divide the attention heads, the KV heads
    and the intermediate size (ValueError otherwise); 1 for an MoE model. The trainer itself stays on one device.
    """

    def __init__(
        self, model: nn.Module, cfg: FP8Config, kv_scales: Mapping[int, Mapping[str, float]] | None = None, tensor_parallel_size: int = 1
    ) -> None:
        config = model.config.get_text_config()
        check_bitwise_model(config, cfg, "BitwiseForward")
        self.model, self.cfg, self.config = model, cfg, config
        self.converted = parameter_sharing_copy(model)
        self.context: BitwiseContext = make_bitwise(self.converted, cfg, kv_scales=kv_scales, tensor_parallel_size=tensor_parallel_size)
        self.tensor_parallel_size = tensor_parallel_size
        self.device = next(model.parameters()).device
        self.vocab_size = min(model.get_input_embeddings().num_embeddings, model.get_output_embeddings().out_features)

    @property
    def kernels(self) -> EngineKernels:
        """The forward kernels of the ops that are not fp8_align's own (BF16 linear, log-softmax, attention)."""
        return self.context.kernels

    @kernels.setter
    def kernels(self, kernels: EngineKernels) -> None:
        self.context.kernels = kernels

    @property
    def fp8_names(self) -> frozenset[str]:
        """The HF names of the linears the recipe runs in FP8."""
        return self.context.fp8_names

    @property
    def kv_scales(self) -> dict[int, KVCacheScales] | None:
        """Per decoder layer, the FP8 KV-cache scales of the rollout being scored (None: not set yet)."""
        return self.context.kv_scales

    def set_kv_scales(self, scales: Mapping[int, Mapping[str, float]]) -> None:
        """Score with the engine's FP8 KV-cache scales `scales` ({decoder layer: {"k_scale", "v_scale"
        [, "q_scale"]}}, FP32 amax / 448: what `engine_kv_scales(llm)` returns, or
        `calibrate_kv_scales(...).scales`), the ones the rollout being scored was generated with
        (`convert.set_kv_scales`: ValueError for a BF16-cache config, KVScaleError naming the layer
        or value otherwise; the scales in use do not change then)."""
        set_kv_scales(self.converted, scales)

    def frozen_weights(self) -> contextlib.AbstractContextManager[None]:
        """A block whose forwards quantize each FP8 weight once (`convert.frozen_fp8_weights`): wrap
        the micro-batches between two optimizer steps, or a log-prob pass."""
        return frozen_fp8_weights(self.converted)

    def hidden_states(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """Final normed hidden states [sum(len), hidden] (BF16) of the packed `sequences` (token-id
        lists, each non-empty, ids in the vocabulary, at most the model's positions long; checked
        on the host before any kernel runs, ValueError naming the sequence otherwise)."""
        check_sequences(sequences, self.vocab_size, self.context.rope.max_positions)
        return self._hidden_states(sequences)

    def _hidden_states(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        self.context.layer_kv_scales(0)  # an FP8-cache config without scales fails before any kernel runs
        ids = host_to_device(torch.tensor([[t for s in sequences for t in s]], dtype=torch.long), self.device)
        positions = host_to_device(torch.cat([torch.arange(len(s)) for s in sequences])[None], self.device)
        use_packed_layout(self.context, positions, [len(s) for s in sequences])
        return self.converted.model(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state[0]

    def token_logprobs(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], chunk_rows: int = 2048, temperature: float = 1.0
    ) -> list[torch.Tensor]:
        """Per sequence, FP32 [len - prompt_len] log-probs of its tokens after the prompt, each given
        its prefix, as the engine's sampler returns them (`logprobs` of the sampled tokens).
        `sequences` as `hidden_states` takes them; one `prompt_lens` entry per sequence, each in
        1..len - 1 (every sequence has at least one completion token). `temperature`: the sampling
        temperature of an engine started with `logprobs_mode="processed_logprobs"` (log-probs of the
        FP32 logits divided by an FP32 temperature tensor, as vLLM's sampler divides; no top-k/top-p);
        1.0 for vLLM's default `raw_logprobs`, which are taken before the temperature. Bad input
        raises ValueError naming the sequence and the limit before any kernel runs. lm_head and
        log-softmax run on `chunk_rows` rows at a time."""
        check_sequences(sequences, self.vocab_size, self.context.rope.max_positions)
        check_prompt_lens(sequences, prompt_lens)
        check_temperature(temperature)
        return completion_logprobs(self._hidden_states(sequences), sequences, prompt_lens, self.converted.lm_head, self.kernels, temperature, chunk_rows)
