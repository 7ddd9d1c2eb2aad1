"""The megatron-core modules of the bitwise layer spec: each slot of a GPT layer (norms, the fused
linears, SwiGLU, core attention, Qwen3-MoE's sparse MLP) and the output layer computing what a bitwise vLLM engine
computes for that part, with the standard BF16 gradient. They run the same ops as `make_bitwise`'s
HF modules (`fp8_align.hf_training.bitwise_modules`: `stacked_output(s)`, `engine_attention`, the
engine's RMSNorm and SiLU-and-mul) on Megatron's tensors and Parameters, whose names, shapes and
layouts stay megatron-core's own (the fused QKV rows interleaved per query group, fc1 = [gate; up]).

Megatron's own code runs around them unchanged: the embedding, the residual adds (a BF16 addition,
the bits the engine's fused add + RMSNorm writes as its residual), TransformerLayer, SelfAttention's
split of the fused QKV and its q/k norms, TransformerBlock, GPTModel, backward and optimizer.

Under Megatron tensor parallelism (size 2, no sequence parallelism) each Megatron rank computes what
the engine rank of the same index computes: its heads' q|k|v rows, gate|up rows and o/down input
columns are the engine rank's, so the linears multiply the local Parameters (the context's
`tensor_parallel_size` stays 1: nothing is emulated), the row-parallel partial sums go through
Megatron's all-reduce (two ranks: one BF16 addition, the engine's all-reduce bits), and the output
layer's vocabulary shards are all-gathered as the engine gathers its logits.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, copy_to_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
)  # fmt: skip
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

import fp8_align.bitwise.ops  # noqa: F401  (registers torch.ops.fp8_align.bitwise_*)
from fp8_align.hf_training.attention import PackedBatch, host_to_device
from fp8_align.hf_training.bitwise_modules import BitwiseContext, engine_attention, sparse_moe_output, stacked_output, stacked_outputs
from fp8_align.hf_training.engine_ops import engine_op, rms_norm_gradient_fn, silu_and_mul_gradient_fn, without_autocast
from fp8_align.hf_training.stacked import StackedLinear, UnsupportedModelError, vocab_parallel_logits


@dataclass(frozen=True)
class _Shard:
    """One member of an engine stacked layer: a view of rows of a Megatron weight (no bias)."""

    weight: torch.Tensor
    bias: None = None


class EngineNorm(nn.Module):
    """RMSNorm [..., H] through the engine's kernel (`bitwise_rms_norm`, FP32, rounded once); a
    megatron-core norm builder (`config=, hidden_size=, eps=`) for the layer norms, the final norm
    and Qwen3's per-head q/k norms. Parameter `weight` [H] in `config.params_dtype`."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.eps = float(eps)

    @without_autocast
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = self.eps
        return engine_op(
            functools.partial(torch.ops.fp8_align.bitwise_rms_norm, eps=eps), functools.partial(rms_norm_gradient_fn, eps=eps), x.contiguous(), self.weight
        )  # fmt: skip


class EngineSiluAndMul(nn.Module):
    """SwiGLU [..., 2F] ([gate | up], fc1's output) -> [..., F] through the engine's kernel; the MLP's
    `activation_func` slot under `use_te_activation_func=True` (the one path that hands the
    activation fc1's whole output; no TransformerEngine is involved)."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()

    @without_autocast
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return engine_op(torch.ops.fp8_align.bitwise_silu_and_mul, silu_and_mul_gradient_fn, x.contiguous())


class _ExpertWeights(nn.Module):
    """One Parameter per expert, `weight0` ... `weight<E-1>` (megatron-core's grouped-experts names)."""

    def __init__(self, num_experts: int, shape: tuple[int, int], dtype: torch.dtype) -> None:
        super().__init__()
        for expert in range(num_experts):
            self.register_parameter(f"weight{expert}", nn.Parameter(torch.empty(shape, dtype=dtype)))

    def stacked(self) -> torch.Tensor:
        """[E, *shape]: every expert's weight, stacked (gradients flow back to each)."""
        return torch.stack(list(self.parameters()))


class EngineMoE(MegatronModule):
    """A Qwen3-MoE sparse layer in the MLP slot, as the bitwise engine runs it at tensor parallel size 1
    (`hf_training.bitwise_modules.sparse_moe_output`: router, routing, block-FP8 experts and their
    weighted sum together; megatron-core's `MoELayer` cannot give these bits, docs/megatron.md).
    Parameters under megatron-core's MoE names: `router.weight` [E, H], and per expert e
    `experts.linear_fc1.weight<e>` [2F, H] (gate rows, then up) and `experts.linear_fc2.weight<e>`
    [H, F]. Input [s, b, H] (or THD's [t, 1, H]) -> ([s, b, H], None), each token's row from that
    token alone. Built by TransformerLayer (`config=, pg_collection=, is_mtp_layer=, name=`) with the
    spec's `context`, `num_experts`, `top_k`, `renormalize` and `ffn_hidden_size` bound."""

    def __init__(
        self, config: TransformerConfig, pg_collection: Any, is_mtp_layer: bool, name: str | None = None, *,
        context: BitwiseContext, num_experts: int, top_k: int, renormalize: bool, ffn_hidden_size: int,
    ) -> None:  # fmt: skip
        super().__init__(config=config)
        hidden, dtype = config.hidden_size, config.params_dtype
        self.context, self.top_k, self.renormalize = context, top_k, renormalize
        self.router = nn.Module()
        self.router.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype))
        self.experts = nn.Module()
        self.experts.linear_fc1 = _ExpertWeights(num_experts, (2 * ffn_hidden_size, hidden), dtype)
        self.experts.linear_fc2 = _ExpertWeights(num_experts, (hidden, ffn_hidden_size), dtype)

    @without_autocast
    def forward(self, hidden_states: torch.Tensor, padding_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, None]:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        w13, w2 = self.experts.linear_fc1.stacked(), self.experts.linear_fc2.stacked()
        out = sparse_moe_output(self.context, x, self.router.weight, w13, w2, self.top_k, self.renormalize)
        return out.reshape(hidden_states.shape), None


def _column_input(layer: ColumnParallelLinear, input_: torch.Tensor) -> torch.Tensor:
    """A column-parallel layer's input: as it is, its gradient all-reduced over the tensor-parallel ranks (size > 1)."""
    return copy_to_tensor_model_parallel_region(input_, group=layer.tp_group) if layer.tp_group.size() > 1 else input_


class EngineQKVLinear(ColumnParallelLinear):
    """`linear_qkv` [s, b, H] -> ([s, b, ng_r * (np/ng + 2) * hn], None): megatron-core's fused QKV
    Parameter (this rank's ng_r = ng / tp query groups, rows interleaved per group: its q heads, its
    k head, its v head) multiplied as the engine rank multiplies its q|k|v layer: one product of the
    rows in engine order, each of q, k, v quantized on its own 128x128 grid where the recipe runs it
    in FP8; the result's columns are then put back in Megatron's interleaved order (a permutation,
    no arithmetic)."""

    def __init__(self, input_size: int, output_size: int, *, context: BitwiseContext, fp8: bool, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, **kwargs)
        config = kwargs["config"]
        self.context, self.fp8 = context, fp8
        self.groups, self.head_size = int(config.num_query_groups) // self.tp_group.size(), int(config.kv_channels)

    @without_autocast
    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        w = self.weight if weight is None else weight
        input_ = _column_input(self, input_)
        groups, d = self.groups, self.head_size
        per_group = w.shape[0] // groups
        q_rows = per_group - 2 * d
        grouped = w.view(groups, per_group, w.shape[1])
        bounds = (0, q_rows, q_rows + d, per_group)
        members = tuple(_Shard(grouped[:, a:b].reshape(-1, w.shape[1])) for a, b in zip(bounds, bounds[1:]))
        layer = StackedLinear(members, tuple(m.weight.shape[0] for m in members), self.fp8, row_parallel=False)  # type: ignore[arg-type]
        q, k, v = stacked_outputs(self.context, layer, input_)
        lead = input_.shape[:-1]
        out = torch.cat([q.reshape(*lead, groups, q_rows), k.reshape(*lead, groups, d), v.reshape(*lead, groups, d)], dim=-1)
        return out.reshape(*lead, -1), None


class EngineFc1Linear(ColumnParallelLinear):
    """`linear_fc1` [s, b, H] -> ([s, b, 2F / tp] = [gate_r | up_r], None) as the engine rank's
    gate|up layer: one product, gate and up each quantized on its own grid where the recipe runs it
    in FP8."""

    def __init__(self, input_size: int, output_size: int, *, context: BitwiseContext, fp8: bool, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, **kwargs)
        self.context, self.fp8 = context, fp8

    @without_autocast
    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        w = self.weight if weight is None else weight
        input_ = _column_input(self, input_)
        gate, up = w.chunk(2)
        layer = StackedLinear((_Shard(gate), _Shard(up)), (gate.shape[0], up.shape[0]), self.fp8, row_parallel=False)  # type: ignore[arg-type]
        return stacked_output(self.context, layer, input_), None


class EngineRowLinear(RowParallelLinear):
    """`linear_proj` / `linear_fc2` [s, b, K / tp] (this rank's input columns) -> ([s, b, N], None)
    as the engine's o / down layer (FP8 where the recipe runs it so): the rank's partial product,
    all-reduced over the tensor-parallel ranks (size > 1)."""

    def __init__(self, input_size: int, output_size: int, *, context: BitwiseContext, fp8: bool, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, **kwargs)
        self.context, self.fp8 = context, fp8

    @without_autocast
    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, None]:
        layer = StackedLinear((_Shard(self.weight),), (self.weight.shape[0],), self.fp8, row_parallel=True)  # type: ignore[arg-type]
        partial = stacked_output(self.context, layer, input_)
        return (reduce_from_tensor_model_parallel_region(partial, group=self.tp_group) if self.tp_group.size() > 1 else partial), None


@dataclass(frozen=True)
class _TokenLayout:
    """Where one forward's sequences sit: `index` [T] the rows of the attention input that hold
    tokens (None: all, in order), `batch` their packed layout, `sbhd` the [s, b] grid or None (THD)."""

    index: torch.Tensor | None
    batch: PackedBatch
    sbhd: tuple[int, int] | None


def _thd_layout(params: PackedSeqParams, rows: int, device: torch.device) -> _TokenLayout:
    """The sequences of THD input of `rows` token rows (`cu_seqlens_q`; with `cu_seqlens_q_padded`,
    each sequence starts at its padded offset and its pad rows hold no token). One host sync, one
    more each for a separate `cu_seqlens_kv` and for `cu_seqlens_q_padded`."""
    if params.qkv_format != "thd":
        raise ValueError(f"bitwise core attention takes qkv_format 'thd' or no packed_seq_params (sbhd); got {params.qkv_format!r}")
    bounds = params.cu_seqlens_q.detach().cpu().long()
    kv = params.cu_seqlens_kv
    if kv is not None and kv is not params.cu_seqlens_q and not torch.equal(kv.detach().cpu().long(), bounds):
        raise ValueError("bitwise core attention is self-attention: cu_seqlens_kv must equal cu_seqlens_q")
    lengths = (bounds[1:] - bounds[:-1]).tolist()
    if not lengths or min(lengths) < 1:
        raise ValueError(f"bitwise core attention: every packed sequence needs a token; cu_seqlens_q {bounds.tolist()}")
    index = None
    if params.cu_seqlens_q_padded is not None:
        starts = params.cu_seqlens_q_padded.detach().cpu().long()[:-1].tolist()
        index = host_to_device(torch.cat([torch.arange(a, a + n) for a, n in zip(starts, lengths)]), device)
    elif sum(lengths) != rows:
        raise ValueError(f"cu_seqlens_q covers {sum(lengths)} tokens; the input has {rows} rows (set cu_seqlens_q_padded for padded sequences)")
    return _TokenLayout(index, PackedBatch.from_lengths(lengths, device), None)


class EngineCoreAttention(MegatronModule):
    """`core_attention` of a self-attention layer: q [T, np, hn], k/v [T, ng, hn] (THD, with
    `packed_seq_params`) or [s, b, np/ng, hn] (sbhd: each of the b rows one sequence of s tokens)
    -> [T, np * hn] / [s, b, np * hn], the engine's RoPE at each sequence's positions 0..n-1 (the
    model is built with `position_embedding_type="none"`) and the engine's attention kernel
    (`engine_attention`; FP8 KV cache with this layer's scales where the config has one). Causal
    within each sequence; `attention_mask` is not read (pass THD packing or rows that start at
    their first token). Padding rows of padded THD give zeros."""

    def __init__(
        self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
        attention_dropout: float | None = None, softmax_scale: float | None = None, cp_comm_type: str | None = None,
        pg_collection: Any = None, *, context: BitwiseContext,
    ) -> None:  # fmt: skip
        super().__init__(config=config)
        if attention_type != "self" or attn_mask_type != AttnMaskType.causal:
            raise UnsupportedModelError(f"bitwise core attention is causal self-attention; got {attention_type!r} with mask {attn_mask_type}")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention dropout {dropout}: a vLLM engine attends without dropout")
        if softmax_scale is not None and softmax_scale != context.head_size**-0.5:
            raise UnsupportedModelError(f"softmax scale {softmax_scale}: the bitwise engine scales by head_size ** -0.5")
        self.context, self.layer_index = context, layer_number - 1

    def _layout(self, query: torch.Tensor, packed_seq_params: PackedSeqParams | None) -> _TokenLayout:
        """The forward's layout, built by its first layer and reused by the others (same params object and shape)."""
        key = (packed_seq_params, tuple(query.shape[:-2]))
        cached = self.context.layout_cache.get("megatron")
        if cached is not None and cached[0][0] is key[0] and cached[0][1] == key[1]:
            return cached[1]
        if packed_seq_params is None:
            s, b = query.shape[:2]
            layout = _TokenLayout(None, PackedBatch.from_lengths([s] * b, query.device), (s, b))
        else:
            layout = _thd_layout(packed_seq_params, query.shape[0], query.device)
        self.context.layout_cache["megatron"] = (key, layout)
        return layout

    @without_autocast
    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None, attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:  # fmt: skip
        if attention_bias is not None:
            raise UnsupportedModelError("bitwise core attention: the engine adds no attention bias")
        layout = self._layout(query, packed_seq_params)

        def tokens(x: torch.Tensor) -> torch.Tensor:  # -> [T, heads * hn], the sequences' tokens in order
            flat = x.transpose(0, 1).reshape(-1, x.shape[-2] * x.shape[-1]) if layout.sbhd else x.reshape(x.shape[0], -1)
            return flat if layout.index is None else flat.index_select(0, layout.index)

        out = engine_attention(self.context, layout.batch, tokens(query), tokens(key), tokens(value), self.layer_index)
        if layout.sbhd is not None:
            s, b = layout.sbhd
            return out.view(b, s, -1).transpose(0, 1).contiguous()
        if layout.index is not None:
            out = out.new_zeros(query.shape[0], out.shape[1]).index_copy(0, layout.index, out)
        return out


class _GatherLastDim(torch.autograd.Function):
    """All ranks' x [..., N] of `group` side by side [..., size * N] in rank order (any device:
    megatron-core's own gather allocates on CUDA); backward: this rank's columns of the gradient
    (the loss downstream is replicated on every rank)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.rank, ctx.size = group.rank(), group.size()
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad.chunk(ctx.size, dim=-1)[ctx.rank].contiguous(), None


class EngineOutputLayer(ColumnParallelLinear):
    """GPTModel's output layer [s, b, H] -> (FP32 logits [s, b, vocab_size], None) as the engine
    computes them (`vocab_parallel_logits`: BF16 products through the engine's linear, then FP32),
    with the layer's weight or, tied, the embedding's (`weight=`): this rank's rows of the padded
    vocabulary, the ranks' logits all-gathered (size > 1), the padding rows cut off."""

    def __init__(self, input_size: int, output_size: int, *, context: BitwiseContext, vocab_size: int, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, **kwargs)
        self.context, self.vocab_size = context, vocab_size

    @without_autocast
    def forward(self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        w = self.weight if weight is None else weight
        ctx = self.context
        logits = vocab_parallel_logits(_column_input(self, input_).reshape(-1, input_.shape[-1]), w, ctx.tensor_parallel_size, ctx.kernels)
        if self.tp_group.size() > 1:
            logits = _GatherLastDim.apply(logits, self.tp_group)
        return logits[:, : self.vocab_size].reshape(*input_.shape[:-1], self.vocab_size), None
