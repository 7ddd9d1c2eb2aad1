"""`build_bitwise_gpt(hf_model, cfg)`: a megatron-core GPTModel whose forward is a bitwise vLLM
engine's (`FP8Config(on_policy="bitwise")`), built as `hf_bridge` builds models: the HF
checkpoint's weights under megatron-core's names, megatron-core's GPTModel, TransformerBlock,
TransformerLayer, SelfAttention and MLP, with the bitwise spec's modules (`modules`) in the slots.

The spec (`bitwise_layer_specs`): one layer spec per decoder layer (the recipe's first/last BF16
layers differ), norms and SwiGLU through the engine's kernels, the fused linears as the engine's
stacked layers (FP8 where the recipe runs them so), core attention with the engine's RoPE
(`position_embedding_type="none"`: megatron-core applies none) and attention kernel, the final
norm, and the output layer swapped after the build for the engine's FP32 logits; Qwen3-MoE's sparse
layers get `EngineMoE` in the MLP slot (router, block-FP8 experts and their sum together: the engine's
bits, which megatron-core's `MoELayer` does not give, docs/megatron.md). Megatron runs its
own embedding, residual adds, backward and optimizer around them; THD packing and sbhd batches.
Megatron tensor parallel size 1 or 2 (each Megatron rank computes the engine rank of its index,
against an engine of that tensor parallel size; no sequence parallelism), context and pipeline
parallel size 1.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.custom_layers.batch_invariant_kernels import is_batch_invariant_mode_enabled
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch import nn

from fp8_align.bitwise import TENSOR_PARALLEL_SIZES
from fp8_align.config import FP8Config
from fp8_align.hf_training.attention import host_to_device, kv_scales_on_device
from fp8_align.hf_training.bitwise_modules import BitwiseContext
from fp8_align.hf_training.convert import bitwise_context, check_sparse_moe, is_sparse_moe, recipe_fp8
from fp8_align.hf_training.engine_ops import completion_logprobs
from fp8_align.hf_training.inputs import check_prompt_lens, check_sequences, check_temperature
from fp8_align.hf_training.linear import STACKED_PROJECTIONS
from fp8_align.hf_training.stacked import VOCAB_PADDING, UnsupportedModelError, check_tensor_parallel_size
from fp8_align.megatron_ext.bitwise.modules import (
    EngineCoreAttention, EngineFc1Linear, EngineMoE, EngineNorm, EngineOutputLayer, EngineQKVLinear, EngineRowLinear, EngineSiluAndMul,
)  # fmt: skip
from fp8_align.megatron_ext.hf_bridge import copy_hf_weights, has_qk_norm, init_single_process_parallel_state, megatron_config_kwargs

#: HF model types `build_bitwise_gpt` maps (Qwen3-MoE's sparse layers as `EngineMoE`).
MODEL_TYPES = ("llama", "qwen3", "qwen3_moe")
#: The attribute of a bitwise GPTModel that holds its `BitwiseContext`.
CONTEXT_ATTRIBUTE = "fp8_align_bitwise"
#: TransformerConfig fields the bitwise spec sets; `build_bitwise_gpt` refuses overrides of them.
BITWISE_CONFIG: dict[str, Any] = {
    "use_te_activation_func": True,  # the activation slot gets fc1's whole [gate | up] output
    "bias_activation_fusion": False,
    "bias_dropout_fusion": False,
    "apply_rope_fusion": False,
    "gradient_accumulation_fusion": False,  # Megatron's DDP then adds param.grad into main_grad
    "context_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "sequence_parallel": False,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "batch_invariant_mode": False,
    "fp8": None,  # the spec's linears run the engine's block FP8 themselves (no TransformerEngine)
    "mtp_num_layers": None,
}


def bitwise_layer_specs(
    context: BitwiseContext, num_layers: int, qk_layernorm: bool, moe_layers: Mapping[int, Mapping[str, Any]] | None = None
) -> TransformerBlockSubmodules:
    """The decoder block spec: per layer megatron-core's local GPT layer with every slot the
    bitwise module of the engine (its linears FP8 where `context`'s recipe runs that HF layer so),
    and the engine's RMSNorm as final norm. `moe_layers`: {layer index: `EngineMoE`'s `num_experts`,
    `top_k`, `renormalize`, `ffn_hidden_size`} of the sparse layers, whose MLP slot is an `EngineMoE`."""
    moe_layers = moe_layers or {}
    specs = []
    for index in range(num_layers):
        prefix = f"model.layers.{index}"
        qkv_fp8 = recipe_fp8(context, f"{prefix}.self_attn", STACKED_PROJECTIONS[0])
        proj_fp8 = recipe_fp8(context, f"{prefix}.self_attn", ("o_proj",))
        layer = get_gpt_layer_local_submodules(normalization="RMSNorm", qk_layernorm=qk_layernorm)
        layer.input_layernorm = layer.pre_mlp_layernorm = EngineNorm
        attention = layer.self_attention.submodules
        attention.linear_qkv = ModuleSpec(module=EngineQKVLinear, params={"context": context, "fp8": qkv_fp8})
        attention.core_attention = ModuleSpec(module=EngineCoreAttention, params={"context": context})
        attention.linear_proj = ModuleSpec(module=EngineRowLinear, params={"context": context, "fp8": proj_fp8})
        if qk_layernorm:
            attention.q_layernorm = attention.k_layernorm = EngineNorm
        if index in moe_layers:
            layer.mlp = functools.partial(EngineMoE, context=context, **moe_layers[index])
        else:
            fc1_fp8 = recipe_fp8(context, f"{prefix}.mlp", STACKED_PROJECTIONS[1])
            fc2_fp8 = recipe_fp8(context, f"{prefix}.mlp", ("down_proj",))
            layer.mlp = functools.partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(
                linear_fc1=ModuleSpec(module=EngineFc1Linear, params={"context": context, "fp8": fc1_fp8}),
                linear_fc2=ModuleSpec(module=EngineRowLinear, params={"context": context, "fp8": fc2_fp8}),
                activation_func=EngineSiluAndMul,
            ))  # fmt: skip
        specs.append(ModuleSpec(module=TransformerLayer, submodules=layer))
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=EngineNorm)


def _moe_layers(hf_model: nn.Module, context: BitwiseContext) -> dict[int, dict[str, Any]]:
    """`bitwise_layer_specs`' `moe_layers` of `hf_model`: its sparse MoE blocks (`check_sparse_moe`:
    UnsupportedModelError for experts the bitwise MoE path does not run)."""
    found = {}
    for index, layer in enumerate(hf_model.model.layers):
        if is_sparse_moe(layer.mlp):
            check_sparse_moe(layer.mlp, context, f"model.layers.{index}.mlp")
            gate, experts = layer.mlp.gate, layer.mlp.experts
            found[index] = {"num_experts": int(gate.weight.shape[0]), "top_k": int(gate.top_k),
                            "renormalize": bool(gate.norm_topk_prob), "ffn_hidden_size": int(experts.down_proj.shape[-1])}  # fmt: skip
    return found


def _check_megatron_state(caller: str) -> int:
    """This process's Megatron tensor parallel size; UnsupportedModelError unless it is one the
    engine runs bitwise (`TENSOR_PARALLEL_SIZES`), pipeline and context parallelism are off, and
    megatron-core's global batch-invariant mode is off (its aten overrides would change the
    backward's GEMMs)."""
    tensor = parallel_state.get_tensor_model_parallel_world_size()
    sizes = {"pipeline": parallel_state.get_pipeline_model_parallel_world_size(), "context": parallel_state.get_context_parallel_world_size()}
    if tensor not in TENSOR_PARALLEL_SIZES or any(size != 1 for size in sizes.values()):
        raise UnsupportedModelError(
            f"{caller}: the bitwise spec runs Megatron tensor parallel size {' or '.join(map(str, TENSOR_PARALLEL_SIZES))} "
            f"(a bitwise engine's), pipeline and context parallel size 1; this process has tensor {tensor}, {sizes}"
        )
    if is_batch_invariant_mode_enabled():
        raise UnsupportedModelError(
            f"{caller}: megatron-core's batch-invariant mode is on; it overrides aten's matmul and log-softmax globally, "
            "which changes the bitwise spec's backward and is not the engine's kernels (disable it)"
        )
    return tensor


def build_bitwise_gpt(
    hf_model: nn.Module, cfg: FP8Config, kv_scales: Mapping[int, Mapping[str, float]] | None = None, **config_overrides: Any
) -> GPTModel:
    """A megatron-core GPTModel holding `hf_model`'s weights (an HF Llama, Qwen3 or Qwen3-MoE causal LM
    in BF16 on one device; the GPTModel on the same device, in train mode) whose forward is the bitwise
    engine's of `cfg` (`on_policy="bitwise"`, its recipe picks the FP8 layers; module docstring):
    `model(input_ids, position_ids, attention_mask, packed_seq_params=...)` returns FP32 logits
    [b, s, V]; `token_logprobs` the engine sampler's log-probs. `kv_scales`: the engine's FP8 KV-cache
    scales (`cfg.kv_cache_dtype == "fp8"`; or `set_kv_scales` later). `config_overrides`: more
    TransformerConfig fields (recompute settings, say). Initializes megatron-core's model-parallel
    state for one process when it is not yet. Under Megatron tensor parallel size 2 (initialized by
    the caller) each rank builds its share, the vocabulary padded to a multiple of 64 as the engine
    pads it, and computes what the engine rank of its index computes (an engine at
    `tensor_parallel_size=2`; a Qwen3-MoE model: size 1 only, ValueError otherwise). Raises
    UnsupportedModelError for other models, MoE experts the bitwise MoE path does not run, another Megatron
    parallel size or megatron-core's batch-invariant mode, ValueError for a non-bitwise config, heads
    the tensor parallel size does not divide, or an override of a field the spec sets
    (`BITWISE_CONFIG`, and `tensor_model_parallel_size` other than the process's)."""
    hf_config = hf_model.config
    if hf_config.model_type not in MODEL_TYPES:
        raise UnsupportedModelError(f"build_bitwise_gpt maps {', '.join(MODEL_TYPES)} models; this model is {hf_config.model_type!r}")
    clashes = {k: v for k, v in config_overrides.items() if k in BITWISE_CONFIG and v != BITWISE_CONFIG[k]}
    if clashes:
        raise ValueError(f"build_bitwise_gpt sets {sorted(clashes)} itself ({ {k: BITWISE_CONFIG[k] for k in clashes} }); got {clashes}")
    context = bitwise_context(hf_model, cfg)
    init_single_process_parallel_state()
    tp = _check_megatron_state("build_bitwise_gpt")
    check_tensor_parallel_size(hf_config, tp)
    if config_overrides.get("tensor_model_parallel_size", tp) != tp:
        raise ValueError(
            f"build_bitwise_gpt: tensor_model_parallel_size={config_overrides['tensor_model_parallel_size']}; "
            f"this process's Megatron tensor parallel size is {tp}"
        )
    config = TransformerConfig(**{**megatron_config_kwargs(hf_config, None, allow_moe=True), **BITWISE_CONFIG, **config_overrides, "tensor_model_parallel_size": tp})
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    vocab = int(hf_config.vocab_size)
    padded_vocab = vocab if tp == 1 else -(-vocab // VOCAB_PADDING) * VOCAB_PADDING
    model = GPTModel(
        config, bitwise_layer_specs(context, config.num_layers, has_qk_norm(hf_config), _moe_layers(hf_model, context)), vocab_size=padded_vocab,
        max_sequence_length=int(hf_config.max_position_embeddings), position_embedding_type="none",
        share_embeddings_and_output_weights=tied, pre_process=True, post_process=True,
    )  # fmt: skip
    output = EngineOutputLayer(
        config.hidden_size, padded_vocab, config=config, init_method=config.init_method, bias=False, skip_bias_add=False,
        gather_output=True, skip_weight_param_allocation=True, context=context, vocab_size=vocab,
    )  # fmt: skip
    output.weight = model.output_layer.weight
    model.output_layer = output
    rank = parallel_state.get_tensor_model_parallel_rank()
    copy_hf_weights(model, hf_model, fused_norms=False, tensor_parallel=None if tp == 1 else (rank, tp, padded_vocab))
    model.to(next(hf_model.parameters()).device)
    setattr(model, CONTEXT_ATTRIBUTE, context)
    if kv_scales is not None:
        set_kv_scales(model, kv_scales)
    return model


def bitwise_context_of(model: nn.Module) -> BitwiseContext:
    """The `BitwiseContext` of a GPTModel built by `build_bitwise_gpt`; ValueError for any other model."""
    context = getattr(model, CONTEXT_ATTRIBUTE, None)
    if not isinstance(context, BitwiseContext):
        raise ValueError("not a bitwise GPTModel (build it with fp8_align.megatron_ext.bitwise.build_bitwise_gpt)")
    return context


def set_kv_scales(model: nn.Module, scales: Mapping[int, Mapping[str, float]]) -> None:
    """Score with the engine's FP8 KV-cache scales `scales` ({decoder layer: {"k_scale", "v_scale"
    [, "q_scale"]}}, FP32 amax / 448, as `engine_kv_scales(llm)` returns them). Raises ValueError for
    another model or a BF16-cache config, KVScaleError naming the layer or value otherwise."""
    context = bitwise_context_of(model)
    device = next(model.parameters()).device
    context.kv_scales = kv_scales_on_device(context.cfg.kv_cache_dtype, scales, context.num_layers, device, "bitwise GPTModel")


def packed_seq_params(lengths: Sequence[int], device: torch.device | str) -> PackedSeqParams:
    """megatron-core's THD parameters of sequences of `lengths` tokens packed in that order
    (cu_seqlens int32 on `device`, no padding)."""
    bounds = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu = host_to_device(bounds, device)
    longest = max(lengths)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest)


def token_logprobs(
    model: nn.Module, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], temperature: float = 1.0, chunk_rows: int = 2048
) -> list[torch.Tensor]:
    """Per sequence, FP32 [len - prompt_len] log-probs of its tokens after the prompt, as the bitwise
    engine's sampler returns them (`BitwiseForward.token_logprobs`' contract: token-id lists, prompt
    lengths in 1..len - 1, `temperature` of a `processed_logprobs` engine or 1.0), through the bitwise
    GPTModel `model`: one THD-packed forward, the output layer and log-softmax on the completion
    positions only (`chunk_rows` at a time), with gradients. Bad input raises ValueError before any
    kernel runs."""
    context = bitwise_context_of(model)
    embedding = model.embedding.word_embeddings
    check_sequences(sequences, model.output_layer.vocab_size, context.rope.max_positions)
    check_prompt_lens(sequences, prompt_lens)
    check_temperature(temperature)
    _check_megatron_state("token_logprobs")
    context.layer_kv_scales(0)  # an FP8-cache config without scales fails before any kernel runs
    device = embedding.weight.device
    ids = host_to_device(torch.tensor([[t for s in sequences for t in s]], dtype=torch.long), device)

    def logprobs(hidden_states: torch.Tensor, output_layer: nn.Module, output_weight: torch.Tensor | None, **_: Any) -> list[torch.Tensor]:
        return completion_logprobs(hidden_states[:, 0], sequences, prompt_lens, lambda h: output_layer(h, weight=output_weight)[0],
                                   context.kernels, temperature, chunk_rows)  # fmt: skip

    # No position ids: the model has no position embedding (core attention applies the engine's RoPE).
    return model(ids, None, None, packed_seq_params=packed_seq_params([len(s) for s in sequences], device), output_processor=logprobs)
