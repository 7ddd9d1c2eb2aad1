"""The independent CPU reference of `make_bitwise`'s plumbing: the bitwise trainer as it was before
the module swap (`BitwiseForward` up to session 28, proven against the engine on GPUs in sessions
12-28), an explicit loop over a decoder's ops on the model's Parameters: the same op functions
(`engine_ops`, `stacked`), called in the engine's order without transformers' modeling code. Tests
hold the converted model's forward and gradients to it bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

import fp8_align.bitwise.ops  # noqa: F401  (registers torch.ops.fp8_align.bitwise_*)
from fp8_align.bitwise.reference import RopeSpec, rope_table
from fp8_align.config import FP8Config
from fp8_align.hf_emulation import recipe_fp8_modules
from fp8_align.hf_training.attention import KVCacheScales, PackedBatch, attention_reference, host_to_device, kv_scales_on_device
from fp8_align.hf_training.engine_ops import (
    completion_logprobs, engine_kernels, engine_op, engine_rope, fp8_gemm_for, fused_add_rms_norm_gradient_fn, inverse_rope_table,
    reference_kernels, rms_norm_gradient_fn, silu_and_mul_gradient_fn,
)  # fmt: skip
from fp8_align.hf_training.inputs import check_prompt_lens, check_sequences, check_temperature
from fp8_align.hf_training.linear import STACKED_PROJECTIONS
from fp8_align.hf_training.stacked import (
    ROW_PARALLEL, Fp8Weights, StackedLinear, all_reduce_sum, check_bitwise_model, check_tensor_parallel_size, quantize_stacked,
    stacked_product, vocab_parallel_embedding, vocab_parallel_logits,
)  # fmt: skip


class ExplicitBitwiseForward:
    """`BitwiseForward`'s contract (hidden states, token log-probs of packed sequences), computed op by op."""

    def __init__(
        self, model: nn.Module, cfg: FP8Config, kv_scales: Mapping[int, Mapping[str, float]] | None = None, tensor_parallel_size: int = 1
    ) -> None:
        config = model.config.get_text_config()
        check_bitwise_model(config, cfg, "ExplicitBitwiseForward")
        check_tensor_parallel_size(config, tensor_parallel_size)
        self.model, self.cfg, self.config = model, cfg, config
        self.tensor_parallel_size = tensor_parallel_size
        self.head_size = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.rope = RopeSpec.from_hf_config(config)
        self.device = next(model.parameters()).device
        self.kernels = engine_kernels() if self.device.type == "cuda" else reference_kernels()
        self.table = rope_table(self.rope, self.device)
        self.inverse_table = inverse_rope_table(self.table)
        self.fp8_names = {name for name, _ in (recipe_fp8_modules(model, cfg, config.num_hidden_layers) if cfg.precision == "fp8" else [])}
        self.stacked = {
            f"model.layers.{index}.{part}.{names[0]}": self._stacked_linear(f"model.layers.{index}.{part}", names)
            for index in range(len(model.model.layers))
            for part, names in (("self_attn", STACKED_PROJECTIONS[0]), ("self_attn", ("o_proj",)), ("mlp", STACKED_PROJECTIONS[1]), ("mlp", ("down_proj",)))
        }  # fmt: skip
        #: The scale rounding in the layer state of every FP8 product, built once (`cfg.rounding` builds one per call).
        self.rounding = cfg.rounding
        self.fp8_gemm = fp8_gemm_for(cfg, self.device, [model.get_submodule(name).weight for name in sorted(self.fp8_names)])
        self.vocab_size = min(model.get_input_embeddings().num_embeddings, model.get_output_embeddings().out_features)
        #: Per decoder layer, the FP8 KV-cache scales of the rollout being scored (None: not set yet).
        self.kv_scales: dict[int, KVCacheScales] | None = None
        if kv_scales is not None:
            self.set_kv_scales(kv_scales)

    def set_kv_scales(self, scales: Mapping[int, Mapping[str, float]]) -> None:
        """The engine's FP8 KV-cache scales (`kv_scales_on_device`)."""
        self.kv_scales = kv_scales_on_device(self.cfg.kv_cache_dtype, scales, self.config.num_hidden_layers, self.device, "reference")

    def _layer_kv_scales(self, index: int) -> KVCacheScales | None:
        """Layer `index`'s FP8 KV-cache scales (set before scoring), or None for a BF16 cache."""
        if self.cfg.kv_cache_dtype != "fp8":
            return None
        assert self.kv_scales is not None, "the reference scores an FP8 cache with the scales it was given"
        return self.kv_scales[index]

    def _stacked_linear(self, prefix: str, names: Sequence[str]) -> StackedLinear:
        fp8 = {f"{prefix}.{name}" in self.fp8_names for name in names}
        if len(fp8) > 1:
            raise ValueError(f"{prefix}: {list(names)} are one layer in vLLM; the recipe quantizes only some of them")
        modules = tuple(self.model.get_submodule(f"{prefix}.{name}") for name in names)
        return StackedLinear(modules, tuple(m.out_features for m in modules), fp8.pop(), row_parallel=names[0] in ROW_PARALLEL)

    def _fp8_weights(self) -> dict[str, Fp8Weights]:
        """Per FP8 stacked layer, per engine rank: the codes and scales of the rank's slice of the
        current weights (`quantize_stacked`, one grouped launch for the whole model)."""
        keys = [key for key, layer in self.stacked.items() if layer.fp8]
        return dict(zip(keys, quantize_stacked([self.stacked[key] for key in keys], self.tensor_parallel_size, self.rounding, self.device)))

    # ------------------------------------------------------------------ ops
    def _stacked(self, key: str, x: torch.Tensor, fp8_weights: dict[str, Fp8Weights], rank: int = 0) -> torch.Tensor:
        """Engine rank `rank`'s outputs of the stacked layer `key` on its input x [T, K_rank] (`stacked_product`)."""
        return stacked_product(
            self.stacked[key], x, rank, self.tensor_parallel_size, fp8_weights.get(key), self.rounding, self.fp8_gemm, self.kernels,
            self.cfg.bitwise_linear_backward == "fp8",
        )  # fmt: skip

    def _norm(self, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None = None) -> Any:
        eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", self.config.rms_norm_eps)))
        if residual is None:
            return engine_op(functools.partial(torch.ops.fp8_align.bitwise_rms_norm, eps=eps), functools.partial(rms_norm_gradient_fn, eps=eps), x, norm.weight)
        return engine_op(
            functools.partial(torch.ops.fp8_align.bitwise_fused_add_rms_norm, eps=eps),
            functools.partial(fused_add_rms_norm_gradient_fn, eps=eps), x, residual, norm.weight,
        )  # fmt: skip

    def _rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return engine_rope(positions, q, k, self.table, self.inverse_table, self.head_size, self.rope.rotary_dim)

    def _attention(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """Layer `index`'s attention: forward through the engine's kernel (over its FP8 cache when
        the config has one), backward the BF16 gradient at the unquantized K/V (straight through)."""
        return engine_op(
            functools.partial(self.kernels.attention, batch=batch, head_size=self.head_size, kv_scales=self._layer_kv_scales(index)),
            functools.partial(attention_reference, batch=batch, head_size=self.head_size, compute_dtype=q.dtype), q, k, v,
        )  # fmt: skip

    def _layer(
        self, index: int, layer: nn.Module, h: torch.Tensor, residual: torch.Tensor | None, batch: PackedBatch,
        fp8_weights: dict[str, Fp8Weights],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        prefix, ranks = f"model.layers.{index}", range(self.tensor_parallel_size)
        if residual is None:
            residual, x = h, self._norm(h, layer.input_layernorm)
        else:
            x, residual = self._norm(h, layer.input_layernorm, residual)
        attn = layer.self_attn
        q_size, kv_size = (attn.q_proj.out_features // len(ranks), attn.k_proj.out_features // len(ranks))
        partials = []
        for rank in ranks:  # each rank: its heads' q|k|v, norms, RoPE, attention and o_proj partial sum
            q, k, v = self._stacked(f"{prefix}.self_attn.q_proj", x, fp8_weights, rank).split([q_size, kv_size, kv_size], dim=-1)
            if hasattr(attn, "q_norm"):  # Qwen3: RMSNorm of every head before RoPE
                q = self._norm(q.reshape(q.shape[0], -1, self.head_size), attn.q_norm).reshape(q.shape)
                k = self._norm(k.reshape(k.shape[0], -1, self.head_size), attn.k_norm).reshape(k.shape)
            q, k = self._rope(batch.position, q, k)
            partials.append(self._stacked(f"{prefix}.self_attn.o_proj", self._attention(index, q, k, v, batch), fp8_weights, rank))
        x, residual = self._norm(all_reduce_sum(partials), layer.post_attention_layernorm, residual)
        partials = []
        for rank in ranks:  # each rank: its columns of gate|up, SiLU-and-mul and down_proj partial sum
            gate_up = self._stacked(f"{prefix}.mlp.gate_proj", x, fp8_weights, rank)
            act = engine_op(torch.ops.fp8_align.bitwise_silu_and_mul, silu_and_mul_gradient_fn, gate_up)
            partials.append(self._stacked(f"{prefix}.mlp.down_proj", act, fp8_weights, rank))
        return all_reduce_sum(partials), residual

    # ------------------------------------------------------------------ public
    def hidden_states(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """Final normed hidden states [sum(len), hidden] (BF16) of the packed `sequences` (token-id
        lists, each non-empty, ids in the vocabulary, at most the model's positions long; checked
        on the host before any kernel runs, ValueError naming the sequence otherwise)."""
        check_sequences(sequences, self.vocab_size, self.rope.max_positions)
        return self._hidden_states(sequences)

    def _hidden_states(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        self._layer_kv_scales(0)  # an FP8-cache config without scales fails before any kernel runs
        batch = PackedBatch.from_lengths([len(s) for s in sequences], self.device)
        ids = host_to_device(torch.tensor([t for s in sequences for t in s], dtype=torch.long), self.device)
        inner = self.model.model
        fp8_weights = self._fp8_weights()
        h = vocab_parallel_embedding(ids, self.model.model.embed_tokens.weight, self.tensor_parallel_size)
        residual = None
        for index, layer in enumerate(inner.layers):
            h, residual = self._layer(index, layer, h, residual, batch, fp8_weights)
        return self._norm(h, inner.norm, residual)[0]

    def token_logprobs(
        self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], chunk_rows: int = 2048, temperature: float = 1.0
    ) -> list[torch.Tensor]:
        """`BitwiseForward.token_logprobs`' contract, from this forward's hidden states and lm_head products."""
        check_sequences(sequences, self.vocab_size, self.rope.max_positions)
        check_prompt_lens(sequences, prompt_lens)
        check_temperature(temperature)
        logits = functools.partial(vocab_parallel_logits, weight=self.model.lm_head.weight, tensor_parallel_size=self.tensor_parallel_size, kernels=self.kernels)
        return completion_logprobs(self._hidden_states(sequences), sequences, prompt_lens, logits, self.kernels, temperature, chunk_rows)
