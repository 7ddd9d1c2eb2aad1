"""The engine's layout of an HF Llama/Qwen2/Qwen3(-MoE) decoder, as a bitwise trainer reproduces it:
projections stacked as vLLM stacks them (q|k|v, gate|up), each engine rank's share under tensor
parallelism (vLLM's Megatron-style split), the vocabulary ranges of embedding and lm_head, and the
all-reduce of the row-parallel partial sums. Plain functions over the model's own Parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fp8_align.bitwise import MODEL_TYPES, TENSOR_PARALLEL_SIZES
from fp8_align.config import FP8Config
from fp8_align.layer_selection import num_routed_experts
from fp8_align.hf_training.engine_ops import EngineKernels, Fp8Gemm, StackedFp8Linear, engine_op, linear_vjp
from fp8_align.hf_training.linear import codes_still_hold
from fp8_align.quant.dispatch import quantize_weights_into
from fp8_align.quant.shards import empty_shard_outputs, shard_slices
from fp8_align.rounding import Rounding


class UnsupportedModelError(ValueError):
    """A model family whose forward `BitwiseForward` does not reproduce."""




def check_bitwise_model(config: Any, cfg: FP8Config, caller: str) -> None:
    """Raise UnsupportedModelError unless `config` (an HF text config) is a family whose forward the
    bitwise trainer reproduces, and ValueError unless `cfg` is a bitwise engine's config."""
    if config.model_type not in MODEL_TYPES:
        raise UnsupportedModelError(f"{caller} reproduces vLLM's {', '.join(MODEL_TYPES)} forward; this model is {config.model_type!r}")
    if cfg.on_policy != "bitwise":
        raise ValueError(f"{caller} computes what an FP8Config(on_policy='bitwise') engine computes; set on_policy='bitwise'")


#: vLLM pads the vocabulary of its embedding and lm_head to a multiple of this before splitting it
#: over tensor-parallel ranks (vLLM's `DEFAULT_VOCAB_PADDING_SIZE`).
VOCAB_PADDING = 64


def vocab_shards(vocab_size: int, tensor_parallel_size: int) -> list[slice]:
    """The vocabulary rows each engine rank holds of an embedding or lm_head with `vocab_size`
    rows: the padded vocabulary split evenly, each range cut at `vocab_size` (padding rows hold no
    token)."""
    per_rank = -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING // tensor_parallel_size
    return [slice(rank * per_rank, min((rank + 1) * per_rank, vocab_size)) for rank in range(tensor_parallel_size)]


def all_reduce_sum(partials: Sequence[torch.Tensor]) -> torch.Tensor:
    """The engine's all-reduce of the ranks' BF16 partial outputs: one rank's output as it is; two
    ranks' as one BF16 addition, correctly rounded and commutative, so the same bits whichever way
    the collective adds them (`TENSOR_PARALLEL_SIZES`)."""
    return functools.reduce(torch.add, partials)


@dataclass(frozen=True)
class StackedLinear:
    """One stacked layer of the engine (q|k|v, o, gate|up, down of a decoder layer): its HF
    linears in stacking order, their output sizes, whether the recipe quantizes it to FP8, and
    whether tensor parallelism splits its input columns (o, down) rather than its output rows."""

    modules: tuple[nn.Linear, ...]
    sizes: tuple[int, ...]
    fp8: bool
    row_parallel: bool

    def rank_sizes(self, tensor_parallel_size: int) -> tuple[int, ...]:
        """The output sizes of the shards one engine rank stacks."""
        return self.sizes if self.row_parallel else tuple(size // tensor_parallel_size for size in self.sizes)

    def rank_weights(self, rank: int, tensor_parallel_size: int) -> list[torch.Tensor]:
        """Per module in stacking order, the slice of its weight engine rank `rank` holds: its
        rank-th block of output rows, or (row-parallel) of input columns; the weight itself at size 1."""
        if tensor_parallel_size == 1:
            return [m.weight for m in self.modules]
        if self.row_parallel:
            k = self.modules[0].in_features // tensor_parallel_size
            return [m.weight[:, rank * k : (rank + 1) * k] for m in self.modules]
        return [m.weight[rank * n : (rank + 1) * n] for m, n in zip(self.modules, self.rank_sizes(tensor_parallel_size))]

    def weight(self, rank: int = 0, tensor_parallel_size: int = 1) -> torch.Tensor:
        """Rank `rank`'s stacked [sum(rank_sizes), K / (row-parallel) size] weight, contiguous as the rank holds it."""
        parts = self.rank_weights(rank, tensor_parallel_size)
        return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)

    def bias(self, rank: int = 0, tensor_parallel_size: int = 1) -> torch.Tensor | None:
        """Rank `rank`'s stacked bias, or None: its rows' slices, or (row-parallel) the whole bias on
        rank 0 only, which adds it before the all-reduce."""
        if self.modules[0].bias is None or (self.row_parallel and rank > 0):
            return None
        if self.row_parallel or tensor_parallel_size == 1:
            parts = [m.bias for m in self.modules]
        else:
            parts = [m.bias[rank * n : (rank + 1) * n] for m, n in zip(self.modules, self.rank_sizes(tensor_parallel_size))]
        return parts[0] if len(parts) == 1 else torch.cat(parts)


#: The stacked layers whose input columns tensor parallelism splits (vLLM's RowParallelLinear).
ROW_PARALLEL = ("o_proj", "down_proj")


def check_tensor_parallel_size(config: Any, tensor_parallel_size: int) -> None:
    """Raise ValueError unless `tensor_parallel_size` is one the engine runs bitwise and splits
    `config`'s heads, KV heads and intermediate size evenly; an MoE model's must be 1 (the bitwise
    MoE path runs one rank: the engine refuses more)."""
    if isinstance(tensor_parallel_size, bool) or tensor_parallel_size not in TENSOR_PARALLEL_SIZES:
        raise ValueError(f"tensor_parallel_size must be one of {TENSOR_PARALLEL_SIZES} (a bitwise engine's), got {tensor_parallel_size!r}")
    if num_routed_experts(config) is not None and tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: the bitwise Mixture-of-Experts path runs at tensor parallel size 1")
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    for name, count in (("num_attention_heads", config.num_attention_heads), ("num_key_value_heads", kv_heads),
                        ("intermediate_size", config.intermediate_size)):  # fmt: skip
        if count % tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} does not divide the model's {name} ({count})")



#: Per FP8 stacked layer, per engine rank: (codes [N, K] e4m3, stacked scale grids).
Fp8Weights = list[tuple[torch.Tensor, torch.Tensor]]


def quantize_stacked(layers: Sequence[StackedLinear], tensor_parallel_size: int, rounding: Rounding, device: torch.device) -> list[Fp8Weights]:
    """Per layer of `layers` (each FP8), per engine rank: the rank's slice of the current weights,
    each shard quantized on its own as the engine's rank quantizes it, all in one grouped launch on
    CUDA (`quantize_weights_into`). No finiteness check (a device sync): on CUDA a NaN/Inf weight
    gives NaN log-probs."""
    weights: list[torch.Tensor] = []
    codes_out: list[torch.Tensor] = []
    scales_out: list[torch.Tensor] = []
    found: list[Fp8Weights] = []
    tp = tensor_parallel_size
    for layer in layers:
        per_rank: Fp8Weights = []
        for rank in range(tp):
            slices = layer.rank_weights(rank, tp)
            sizes = list(layer.rank_sizes(tp))
            codes, scales = empty_shard_outputs(sizes, slices[0].shape[1], device)
            for weight, (rows, scale_rows) in zip(slices, shard_slices(sizes)):
                weights.append(weight.detach().contiguous())
                codes_out.append(codes[rows])
                scales_out.append(scales[scale_rows])
            per_rank.append((codes, scales))
        found.append(per_rank)
    if weights:
        quantize_weights_into(weights, codes_out, scales_out, rounding.weight_pow2, rounding.scale_rule)
    return found


class FrozenFp8Weights:
    """FP8 stacked layers' codes (`quantize_stacked`) computed once while their weights are promised
    unchanged (`convert.frozen_fp8_weights`), keyed by each layer's HF linears. A layer's codes are
    reused while its linears hold the same weight tensors at the same version; a weight changed in
    place since (an optimizer step inside the block) raises RuntimeError; a linear that holds another
    tensor object than before (a sharding wrapper that swaps its parameters) has its codes computed
    again."""

    def __init__(self) -> None:
        self._entries: dict[tuple[int, ...], tuple[tuple[torch.Tensor, ...], tuple[int, ...], Fp8Weights]] = {}

    def quantized(self, layers: Sequence[StackedLinear], tensor_parallel_size: int, rounding: Rounding, device: torch.device) -> list[Fp8Weights]:
        """`quantize_stacked(layers, ...)`, the layers not held yet in one grouped launch."""
        keys = [tuple(id(m) for m in layer.modules) for layer in layers]
        missing = [i for i, (key, layer) in enumerate(zip(keys, layers)) if not self._holds(key, layer)]
        fresh = quantize_stacked([layers[i] for i in missing], tensor_parallel_size, rounding, device)
        for i, found in zip(missing, fresh):
            weights = tuple(m.weight for m in layers[i].modules)
            self._entries[keys[i]] = (weights, tuple(w._version for w in weights), found)
        return [self._entries[key][2] for key in keys]

    def _holds(self, key: tuple[int, ...], layer: StackedLinear) -> bool:
        entry = self._entries.get(key)
        return entry is not None and codes_still_hold(entry[0], entry[1], [m.weight for m in layer.modules], "an FP8 stacked layer")


def stacked_product(
    layer: StackedLinear, x: torch.Tensor, rank: int, tensor_parallel_size: int, fp8_weights: Fp8Weights | None,
    rounding: Rounding, fp8_gemm: Fp8Gemm, kernels: EngineKernels, fp8_backward: bool,
) -> torch.Tensor:  # fmt: skip
    """Engine rank `rank`'s outputs of `layer` on its input x [T, K_rank], side by side
    [T, sum(N_rank)]: one product of the rank's stacked weight, as the engine's stacked layer
    computes it (FP8 through `fp8_gemm` with the rank's codes of `fp8_weights`, its backward in
    block FP8 with `fp8_backward`, else BF16; BF16 through the engine's linear); of a row-parallel
    layer, the rank's partial sum."""
    weight, bias = layer.weight(rank, tensor_parallel_size), layer.bias(rank, tensor_parallel_size)
    if layer.fp8:
        assert fp8_weights is not None
        return StackedFp8Linear.apply(x, weight, bias, layer.rank_sizes(tensor_parallel_size), rounding, fp8_gemm, *fp8_weights[rank], fp8_backward)
    return engine_op(kernels.linear, F.linear, *((x, weight) if bias is None else (x, weight, bias)), vjp=linear_vjp)


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, tensor_parallel_size: int) -> torch.Tensor:
    """The engine's vocabulary-parallel embedding of `ids` (any shape) -> [*ids.shape, H]: each rank
    looks up the ids in its range (zero rows elsewhere) and the ranks' rows are summed (so a -0.0
    entry becomes +0.0 at 2 ranks)."""
    shards = vocab_shards(weight.shape[0], tensor_parallel_size)
    rows = F.embedding(ids, weight)
    if len(shards) == 1:
        return rows
    return all_reduce_sum([rows.masked_fill(((ids < s.start) | (ids >= s.stop))[..., None], 0) for s in shards])


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, tensor_parallel_size: int, kernels: EngineKernels) -> torch.Tensor:
    """lm_head [T, H] -> FP32 logits [T, V]: each engine rank's vocabulary rows of `weight` [V, H]
    through the engine's linear, side by side (the engine gathers the ranks' logits), then FP32."""
    parts = [engine_op(kernels.linear, F.linear, hidden, weight[s], vjp=linear_vjp) for s in vocab_shards(weight.shape[0], tensor_parallel_size)]
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).float()
