"""`make_bitwise(model, cfg)`: an HF Llama/Qwen2/Qwen3/Qwen3-MoE model whose own `forward` runs a
bitwise vLLM engine's kernels, so the log-probs a stack computes from its logits are the engine's bits.

The conversion swaps modules in place (`bitwise_modules`): every RMSNorm, the projections (q|k|v
and gate|up stacked as the engine stacks them, FP8 where the recipe quantizes them), the MLP's
SiLU-and-mul, Qwen3-MoE's sparse blocks (`BitwiseSparseMoE`: the engine's router and block-FP8
experts), lm_head (FP32 logits of the engine's BF16 products) and, at tensor parallel size 2,
the embedding; the rotary embedding becomes the identity and attention runs through transformers'
attention interface as `bitwise_attention` (registered under `ATTENTION_IMPLEMENTATION`, with
FlashAttention's mask convention): the engine's RoPE and its attention kernel over a paged copy of
K/V (FP8 with the engine's scales where the config has an FP8 cache). Parameters, their names and
the model's modeling code stay as they are. The forward takes what stacks pass around it: padded
batches with `attention_mask`, sequences packed into one row with `position_ids` restarting at 0
(verl's remove-padding, OpenRLHF's packing), micro-batches, gradient checkpointing; each sequence's
positions must be 0..n-1, as the engine numbers them. Backward: the standard BF16 gradient.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fp8_align.bitwise.reference import RopeSpec, rope_table
from fp8_align.config import FP8Config
from fp8_align.hf_emulation import is_fused_experts, recipe_fp8_modules
from fp8_align.hf_training.attention import PackedBatch, kv_scales_on_device
from fp8_align.hf_training.bitwise_modules import (
    BitwiseContext, BitwiseMLP, BitwiseSparseMoE, EngineLMHead, EngineProjection, EngineRMSNorm, IdentityRotary, ProjectionGroup,
    VocabParallelEmbedding, engine_attention,
)  # fmt: skip
from fp8_align.hf_training.engine_ops import fp8_gemm_for, inverse_rope_table, kernels_for, without_autocast
from fp8_align.hf_training.linear import STACKED_PROJECTIONS, Fp8TrainingLinear
from fp8_align.hf_training.stacked import FrozenFp8Weights, UnsupportedModelError, check_bitwise_model, check_tensor_parallel_size
from fp8_align.quant import DEFAULT_BLOCK_SIZE

#: The name `make_bitwise` registers `bitwise_attention` under (transformers' attention and mask interfaces).
ATTENTION_IMPLEMENTATION = "fp8_align_bitwise"
#: The attribute of a converted model (and of its attention modules) that holds its `BitwiseContext`.
CONTEXT_ATTRIBUTE = "fp8_align_bitwise"


@dataclass(frozen=True)
class _Layout:
    """The tokens of one forward's [B, S] grid that the engine would see, as packed sequences:
    `index` [T] their flat positions in the grid (None: every position, in order), `batch` their layout."""

    index: torch.Tensor | None
    batch: PackedBatch


def _packed_layout(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, rows: int, columns: int, device: torch.device) -> _Layout:
    """Split the valid tokens of a [rows, columns] grid (`attention_mask` 2-D, 1 = token; None: all)
    into sequences: a new one at each row's first token and wherever `position_ids` is 0. Raises
    ValueError unless every sequence's positions are 0..n-1 (the engine's numbering)."""
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(f"bitwise attention takes a 2-D padding mask [batch, tokens] (or none); got a {attention_mask.dim()}-D mask")
    valid = torch.ones(rows, columns, dtype=torch.bool) if attention_mask is None else attention_mask.detach().to("cpu", torch.bool)
    positions = torch.arange(columns).expand(rows, columns) if position_ids is None else position_ids.detach().cpu().expand(rows, columns)
    index = valid.reshape(-1).nonzero().flatten()
    if index.numel() == 0:
        raise ValueError("bitwise attention: the batch has no token (the attention mask is all 0)")
    position = positions.reshape(-1)[index]
    row = index // columns
    first_in_row = torch.ones_like(row, dtype=torch.bool)
    first_in_row[1:] = row[1:] != row[:-1]
    start = position == 0
    if bool((first_in_row & ~start).any()):
        bad = int(row[first_in_row & ~start][0])
        raise ValueError(f"row {bad}: its first token is at position {int(position[first_in_row & ~start][0])}, not 0; the engine numbers each sequence's tokens from 0")
    follows = torch.zeros_like(start)
    follows[1:] = position[1:] == position[:-1] + 1
    broken = ~start & ~follows
    if bool(broken.any()):
        at = int(index[broken][0])
        raise ValueError(f"row {at // columns}, token {at % columns}: position {int(positions.reshape(-1)[at])} does not follow the previous token's; "
                         "each sequence's positions must be 0..n-1 (pack sequences with position_ids restarting at 0)")  # fmt: skip
    starts = start.nonzero().flatten().tolist() + [index.numel()]
    lengths = [b - a for a, b in zip(starts, starts[1:])]
    everything = index.numel() == rows * columns
    return _Layout(None if everything else index.to(device), PackedBatch.from_lengths(lengths, device))


def _layout(context: BitwiseContext, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, rows: int, columns: int, device: torch.device) -> _Layout:
    """`_packed_layout`, computed once per forward: every layer gets the same mask and position
    tensors, so the first layer's layout is reused while those objects are the ones passed."""
    key = (attention_mask, position_ids, rows, columns)
    cached = context.layout_cache.get("key")
    if cached is not None and all(a is b for a, b in zip(cached[:2], key[:2])) and cached[2:] == key[2:]:
        return context.layout_cache["layout"]
    layout = _packed_layout(attention_mask, position_ids, rows, columns, device)
    _cache_layout(context, key, layout)
    return layout


def _cache_layout(context: BitwiseContext, key: tuple[Any, ...], layout: _Layout) -> None:
    """`layout` is the one `_layout` returns while its arguments are `key` (the mask and positions by identity)."""
    context.layout_cache.update(key=key, layout=layout)


def use_packed_layout(context: BitwiseContext, position_ids: torch.Tensor, lengths: Sequence[int]) -> None:
    """The next forward of `context`'s model that gets `position_ids` ([1, sum(lengths)], each
    sequence numbered 0..n-1) packs the sequences of `lengths` (host ints) without reading the
    positions back from the device (`_packed_layout` would: one device sync per forward)."""
    _cache_layout(context, (None, position_ids, 1, int(sum(lengths))), _Layout(None, PackedBatch.from_lengths(list(lengths), position_ids.device)))


@without_autocast
def bitwise_attention(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # fmt: skip
    """transformers' attention interface: query [B, Hq, S, D], key/value [B, Hk, S, D] of a converted
    model's layer `module.layer_idx` (RoPE not yet applied: the model's rotary embedding is the
    identity) -> ([B, S, Hq, D], None). Each engine rank's heads: the engine's RoPE at the packed
    sequences' positions, then its attention kernel (`BitwiseContext.kernels.attention`); padding
    positions get zeros. Raises for what the engine does not do: dropout, a sliding window, a
    softmax scale other than D ** -0.5, keys from a generation cache."""
    context: BitwiseContext | None = getattr(module, CONTEXT_ATTRIBUTE, None)
    if context is None:
        raise RuntimeError(f"attention implementation {ATTENTION_IMPLEMENTATION!r} runs only in a model converted by make_bitwise")
    if dropout:
        raise ValueError(f"attention dropout {dropout}: a vLLM engine attends without dropout; set the model config's attention_dropout to 0")
    if kwargs.get("sliding_window") is not None:
        raise UnsupportedModelError("sliding-window attention: the bitwise engine attends to the whole prefix")
    if scaling is not None and scaling != context.head_size**-0.5:
        raise UnsupportedModelError(f"softmax scale {scaling}: the bitwise engine scales by head_size ** -0.5 = {context.head_size**-0.5}")
    rows, heads, columns, size = query.shape
    if key.shape[2] != columns:
        raise ValueError("keys from a generation cache: a bitwise model scores whole sequences (call it with use_cache=False)")
    layout = _layout(context, attention_mask, kwargs.get("position_ids"), rows, columns, query.device)

    def tokens(x: torch.Tensor) -> torch.Tensor:  # [B, H, S, D] -> [T, H * D], the valid tokens in order
        flat = x.transpose(1, 2).reshape(rows * columns, -1)
        return flat if layout.index is None else flat.index_select(0, layout.index)

    out = engine_attention(context, layout.batch, tokens(query), tokens(key), tokens(value), getattr(module, "layer_idx", 0))
    if layout.index is not None:
        out = out.new_zeros(rows * columns, out.shape[1]).index_copy(0, layout.index, out)
    return out.reshape(rows, columns, heads, size), None


def _register_attention() -> None:
    """`bitwise_attention` in transformers' attention interface and FlashAttention's mask convention
    (no mask, or the 2-D padding mask) in its mask interface, both under `ATTENTION_IMPLEMENTATION`
    (registering again replaces the entry with the same function). transformers is imported here:
    the models converted need it, fp8_align's core does not (`fp8-align doctor` runs without it)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(ATTENTION_IMPLEMENTATION, bitwise_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_IMPLEMENTATION, flash_attention_mask)


def bitwise_context(model: nn.Module, cfg: FP8Config, tensor_parallel_size: int = 1) -> BitwiseContext:
    """The `BitwiseContext` of the bitwise engine of `cfg` at `tensor_parallel_size` serving `model`
    (an HF `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` in
    BF16 on one device):
    its kernels for the model's device, RoPE table, and the HF names of the linears the recipe runs
    in FP8. Raises UnsupportedModelError for other model families, ValueError for a non-bitwise
    config, weights not in BF16, or a tensor parallel size the engine does not run bitwise or that
    does not divide the heads."""
    config = model.config.get_text_config()
    check_bitwise_model(config, cfg, "the bitwise trainer")
    check_tensor_parallel_size(config, tensor_parallel_size)
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.bfloat16}:
        raise ValueError(f"the bitwise trainer: the engine runs BF16 weights; this model holds {sorted(map(str, dtypes))} (model.to(torch.bfloat16))")
    device = model.get_input_embeddings().weight.device
    fp8_names = {name for name, _ in (recipe_fp8_modules(model, cfg, config.num_hidden_layers) if cfg.precision == "fp8" else [])}
    head_size = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    rope = RopeSpec.from_hf_config(config)
    table = rope_table(rope, device)
    return BitwiseContext(
        cfg=cfg, rounding=cfg.rounding, kernels=kernels_for(device, cfg.bitwise_attention_tiling),
        fp8_gemm=fp8_gemm_for(cfg, device, [m.weight for m in map(model.get_submodule, sorted(fp8_names)) if isinstance(m, nn.Linear)]),
        tensor_parallel_size=tensor_parallel_size, head_size=head_size, rope=rope, table=table, inverse_table=inverse_rope_table(table),
        num_layers=config.num_hidden_layers, fp8_names=frozenset(fp8_names),
    )  # fmt: skip


def recipe_fp8(context: BitwiseContext, prefix: str, names: tuple[str, ...]) -> bool:
    """Whether the recipe runs the engine layer that stacks HF linears `prefix.<names>` in FP8;
    ValueError when it quantizes only some of them (vLLM computes them as one layer)."""
    chosen = {f"{prefix}.{name}" in context.fp8_names for name in names}
    if len(chosen) > 1:
        raise ValueError(f"{prefix}: {list(names)} are one layer in vLLM; the recipe quantizes only some of them")
    return chosen.pop()


def is_sparse_moe(mlp: nn.Module) -> bool:
    """A transformers-5 MoE block: a router `gate` with a `weight` and fused `experts` (`is_fused_experts`)."""
    return isinstance(getattr(getattr(mlp, "gate", None), "weight", None), nn.Parameter) and is_fused_experts(getattr(mlp, "experts", None))


def sparse_moe(mlp: nn.Module, context: BitwiseContext, prefix: str) -> BitwiseSparseMoE:
    """`BitwiseSparseMoE` of the HF MoE block `prefix` (`mlp`), after `check_sparse_moe`."""
    check_sparse_moe(mlp, context, prefix)
    return BitwiseSparseMoE(mlp, context)


def check_sparse_moe(mlp: nn.Module, context: BitwiseContext, prefix: str) -> None:
    """UnsupportedModelError unless the recipe runs the experts of the HF MoE block `prefix` (`mlp`)
    in FP8 (the bitwise MoE path has block-FP8 experts only) and their intermediate size is a
    multiple of 128 (`moe_experts`' grouped GEMM)."""
    if f"{prefix}.experts" not in context.fp8_names:
        raise UnsupportedModelError(f"{prefix}.experts: the recipe keeps these experts BF16; the bitwise MoE path runs block-FP8 experts only")
    intermediate = mlp.experts.down_proj.shape[-1]
    if intermediate % DEFAULT_BLOCK_SIZE[0]:
        raise UnsupportedModelError(
            f"{prefix}.experts: intermediate size {intermediate} is not a multiple of {DEFAULT_BLOCK_SIZE[0]} (the bitwise MoE's grouped GEMM)"
        )


def make_bitwise(
    model: nn.Module, cfg: FP8Config, kv_scales: Mapping[int, Mapping[str, float]] | None = None, tensor_parallel_size: int = 1
) -> BitwiseContext:
    """Convert `model` (an HF `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM` /
    `Qwen3MoeForCausalLM` in BF16 on one device, transformers' `model.model.rotary_emb` layout) in
    place so that its forward is the bitwise engine's of `cfg` (`on_policy="bitwise"`; its recipe
    picks the FP8 layers) at the engine's `tensor_parallel_size` (module docstring); its logits are
    FP32. Returns the model's
    `BitwiseContext` (also `model.fp8_align_bitwise`). With `cfg.kv_cache_dtype == "fp8"` the
    forward needs the engine's K/V scales: `kv_scales` here or `set_kv_scales(model, scales)`.
    Raises UnsupportedModelError for other model families, a transformers without
    `set_attn_implementation`, MoE experts the recipe keeps BF16 or `output_router_logits=True`
    (the router's auxiliary loss is not computed), ValueError for a non-bitwise config, a
    model not in BF16, a tensor parallel size the engine does not run bitwise or that does not
    divide the heads (an MoE model: any size but 1), or a model converted already."""
    config = model.config.get_text_config()
    check_bitwise_model(config, cfg, "make_bitwise")
    check_tensor_parallel_size(config, tensor_parallel_size)
    if hasattr(model, CONTEXT_ATTRIBUTE):
        raise ValueError("make_bitwise: this model is converted already")
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "rotary_emb") or not hasattr(model, "lm_head"):
        raise UnsupportedModelError("make_bitwise needs transformers' CausalLM layout: model.model.rotary_emb, model.model.layers, model.lm_head")
    if getattr(config, "output_router_logits", False):
        raise UnsupportedModelError(
            "make_bitwise: output_router_logits=True asks for the router's auxiliary loss, which the bitwise MoE block does not "
            "compute (set model.config.output_router_logits = False)"
        )
    if not hasattr(model, "set_attn_implementation"):
        raise UnsupportedModelError(
            "make_bitwise needs a transformers release whose models have `set_attn_implementation` (tested: 5.17 and 5.19)"
        )
    context = bitwise_context(model, cfg, tensor_parallel_size)
    head_size = context.head_size

    def fp8(prefix: str, names: tuple[str, ...]) -> bool:
        return recipe_fp8(context, prefix, names)

    default_eps = float(config.rms_norm_eps)
    for index, layer in enumerate(inner.layers):
        attn, prefix = layer.self_attn, f"model.layers.{index}"
        qkv = ProjectionGroup(context, fp8(f"{prefix}.self_attn", STACKED_PROJECTIONS[0]), row_parallel=False)
        for name in STACKED_PROJECTIONS[0]:
            setattr(attn, name, EngineProjection(getattr(attn, name), qkv))
        attn.o_proj = EngineProjection(attn.o_proj, ProjectionGroup(context, fp8(f"{prefix}.self_attn", ("o_proj",)), row_parallel=True))
        for name in ("q_norm", "k_norm"):
            if hasattr(attn, name):
                setattr(attn, name, EngineRMSNorm(getattr(attn, name), default_eps))
        setattr(attn, CONTEXT_ATTRIBUTE, context)
        if is_sparse_moe(layer.mlp):
            layer.mlp = sparse_moe(layer.mlp, context, f"{prefix}.mlp")
        else:
            layer.mlp = BitwiseMLP(layer.mlp, context, fp8(f"{prefix}.mlp", STACKED_PROJECTIONS[1]), fp8(f"{prefix}.mlp", ("down_proj",)))
        layer.input_layernorm = EngineRMSNorm(layer.input_layernorm, default_eps)
        layer.post_attention_layernorm = EngineRMSNorm(layer.post_attention_layernorm, default_eps)
    inner.norm = EngineRMSNorm(inner.norm, default_eps)
    inner.rotary_emb = IdentityRotary(head_size)
    if tensor_parallel_size > 1:
        inner.embed_tokens = VocabParallelEmbedding(inner.embed_tokens, context)
    model.lm_head = EngineLMHead(model.lm_head, context)
    _register_attention()
    model.set_attn_implementation(ATTENTION_IMPLEMENTATION)
    setattr(model, CONTEXT_ATTRIBUTE, context)
    if kv_scales is not None:
        set_kv_scales(model, kv_scales)
    return context


def set_kv_scales(model: nn.Module, scales: Mapping[int, Mapping[str, float]]) -> None:
    """Score with the engine's FP8 KV-cache scales `scales` ({decoder layer: {"k_scale", "v_scale"
    [, "q_scale"]}}, FP32 amax / 448, as `engine_kv_scales(llm)` returns them), the ones the rollout
    being scored was generated with, in a model converted by `make_bitwise`. Raises ValueError for
    an unconverted model or a BF16-cache config, KVScaleError naming the layer or value otherwise;
    the scales in use do not change then."""
    context: BitwiseContext | None = getattr(model, CONTEXT_ATTRIBUTE, None)
    if context is None:
        raise ValueError("set_kv_scales: the model is not converted by make_bitwise")
    device = next(model.parameters()).device
    context.kv_scales = kv_scales_on_device(context.cfg.kv_cache_dtype, scales, context.num_layers, device, "make_bitwise model")


@contextlib.contextmanager
def frozen_fp8_weights(model: nn.Module) -> Iterator[None]:
    """Within the block, the FP8 linears of `model` (converted by `make_bitwise`, or given the aligned
    FP8 forward by `apply_fp8_training`) quantize each weight once and reuse its codes: for the
    forwards between two optimizer steps (the micro-batches of one step, a log-prob pass), with the
    same bits as quantizing at every forward. Holds one byte per FP8 weight (and its scales) until the
    block ends. A forward after a weight was changed in place inside the block raises RuntimeError;
    a model with neither conversion or a block inside another one raises ValueError. Routed experts
    (MoE) are still quantized at every forward."""
    context: BitwiseContext | None = getattr(model, CONTEXT_ATTRIBUTE, None)
    if context is None:
        with _frozen_training_linears(model):
            yield
        return
    if context.frozen_weights is not None:
        raise ValueError("frozen_fp8_weights: already inside a frozen_fp8_weights block of this model")
    context.frozen_weights = FrozenFp8Weights()
    try:
        yield
    finally:
        context.frozen_weights = None


@contextlib.contextmanager
def _frozen_training_linears(model: nn.Module) -> Iterator[None]:
    linears = [module for module in model.modules() if isinstance(module, Fp8TrainingLinear)]
    if not linears:
        raise ValueError("frozen_fp8_weights: the model is not converted by make_bitwise or apply_fp8_training")
    if any(linear.frozen for linear in linears):
        raise ValueError("frozen_fp8_weights: already inside a frozen_fp8_weights block of this model")
    for linear in linears:
        linear.frozen = True
    try:
        yield
    finally:
        for linear in linears:
            linear.unfreeze()
