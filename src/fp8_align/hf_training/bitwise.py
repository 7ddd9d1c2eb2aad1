"""The trainer half of `FP8Config(on_policy="bitwise")`: an HF Llama/Qwen2/Qwen3 model's forward run
kernel for kernel as a bitwise vLLM engine runs it, so its token log-probs are the engine's bits.

`BitwiseForward(model, cfg)` reads the model's own Parameters (optimizers, state dicts and weight
sync see the usual tensors) and computes, over packed sequences: embedding, RMSNorm with the fused
residual add, the projections stacked as vLLM stacks them (q|k|v, gate|up: one product each, with
the same GEMM calls as the engine; block FP8 through the plugin's fixed-tile backend for the layers
the recipe quantizes, vLLM's batch-invariant matmul for BF16 ones), RMSNorm of q/k per head (Qwen3),
RoPE with the FP32 table, attention with vLLM's TRITON_ATTN kernel over a paged copy of K/V
(BF16, or E4M3 with the engine's per-layer scales: `hf_training.attention`),
SiLU-and-mul, the final norm, lm_head and the log-softmax of the sampler. With
`tensor_parallel_size=2` it runs each engine rank's share as that rank does (vLLM's Megatron-style
split: q|k|v and gate|up by output rows, o and down by input columns, embedding and lm_head by
vocabulary range) and sums the row-parallel partial outputs as the engine's all-reduce does: one
BF16 addition (`all_reduce_sum`). Each op is an autograd
function whose forward is the engine's kernel and whose backward is the standard gradient of the
op at the model's precision (BF16), as a BF16 trainer computes it: in closed form for the linears,
the log-softmax and RoPE (the inverse rotation, no second forward); by autograd through torch's
fused BF16 op at the same inputs for RMSNorm, SiLU-and-mul and attention (SDPA, flash on CUDA);
FP8 projections: BF16 straight-through. So training runs at a BF16 trainer's cost.

On CUDA the kernels are the engine's (fp8_align's Triton operators and vLLM's, via
`vllm_plugin.compat.batch_invariant_kernels`); on CPU every op runs its pure-torch reference, which
no CPU engine shares (a CPU engine refuses `on_policy="bitwise"`): the CPU path checks the plumbing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import fp8_align.bitwise.ops  # noqa: F401  (registers torch.ops.fp8_align.bitwise_*)
from fp8_align.bitwise import MODEL_TYPES, TENSOR_PARALLEL_SIZES
from fp8_align.bitwise.reference import RopeSpec, apply_rope, rope_table
from fp8_align.config import FP8Config
from fp8_align.hf_emulation import recipe_fp8_modules
from fp8_align.hf_training.attention import KVCacheScales, PackedBatch, attention_reference, host_to_device, paged_triton_attention
from fp8_align.hf_training.inputs import check_prompt_lens, check_sequences, check_temperature
from fp8_align.hf_training.linear import STACKED_PROJECTIONS, bf16_straight_through
from fp8_align.quant.dispatch import quantize_weights_into
from fp8_align.rounding import Rounding
from fp8_align.quant.shards import empty_shard_outputs, shard_slices
from fp8_align.vllm_plugin.kernels.emulated import emulated_block_fp8_linear
from fp8_align.vllm_plugin.kernels.registry import select_kernel
from fp8_align.vllm_plugin.kv.scales import KVScaleError, validate_kv_scales
from fp8_align.vllm_plugin.layer_state import Fp8AlignLayerState


class UnsupportedModelError(ValueError):
    """A model family whose forward `BitwiseForward` does not reproduce."""


#: A closed-form backward: (inputs, forward output or None, output gradients) -> one gradient per input.
Vjp = Callable[[tuple[torch.Tensor, ...], torch.Tensor | None, tuple[torch.Tensor, ...]], tuple[torch.Tensor | None, ...]]


class _EngineOp(torch.autograd.Function):
    """Forward: `engine_fn(*inputs)`; backward: `vjp` when given (with the output when
    `save_output`), else autograd of `gradient_fn` at the same inputs."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, engine_fn: Callable[..., Any], gradient_fn: Callable[..., Any], vjp: Vjp | None, save_output: bool, *inputs: torch.Tensor
    ) -> Any:
        ctx.gradient_fn, ctx.vjp, ctx.save_output = gradient_fn, vjp, save_output
        output = engine_fn(*inputs)
        ctx.save_for_backward(*inputs, *((output,) if save_output else ()))
        return output

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        needs = ctx.needs_input_grad[4:]
        if ctx.vjp is not None:
            saved = ctx.saved_tensors
            inputs, output = (saved[:-1], saved[-1]) if ctx.save_output else (saved, None)
            found = ctx.vjp(tuple(inputs), output, grads)
            return (None, None, None, None, *(g if need else None for g, need in zip(found, needs)))
        inputs = [t.detach().requires_grad_(need and t.is_floating_point()) for t, need in zip(ctx.saved_tensors, needs)]
        with torch.enable_grad():
            outputs = ctx.gradient_fn(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        wanted = [t for t in inputs if t.requires_grad]
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True) if pairs and wanted else [])
        return (None, None, None, None, *(next(found) if t.requires_grad else None for t in inputs))


def engine_op(
    engine_fn: Callable[..., Any], gradient_fn: Callable[..., Any], *inputs: torch.Tensor, vjp: Vjp | None = None, save_output: bool = False
) -> Any:
    """`engine_fn(*inputs)` with the backward of `gradient_fn` (the same contract in plain torch at
    the inputs' precision: the op a standard trainer differentiates): `vjp`, that gradient in
    closed form (given the output when `save_output`), if given, else autograd of `gradient_fn`."""
    return _EngineOp.apply(engine_fn, gradient_fn, vjp, save_output, *inputs)


def linear_vjp(inputs: tuple[torch.Tensor, ...], output: torch.Tensor | None, grads: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, ...]:
    """Gradients of `F.linear(x, weight[, bias])` for 2-D x [T, K], weight [N, K], grad [T, N],
    computed as autograd computes them (`grad @ weight`, `grad.T @ x`, `grad.sum(0)`)."""
    (grad,) = grads
    x, weight = inputs[0], inputs[1]
    found = (grad.mm(weight), grad.t().mm(x))
    return (*found, grad.sum(0)) if len(inputs) == 3 else found


def log_softmax_vjp(inputs: tuple[torch.Tensor, ...], output: torch.Tensor | None, grads: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, ...]:
    """Gradient of `torch.log_softmax(x, -1)` from its output (`save_output=True`), with autograd's own formula."""
    assert output is not None
    return (torch.ops.aten._log_softmax_backward_data(grads[0], output, -1, inputs[0].dtype),)


def rms_norm_gradient_fn(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm at x's precision (torch's fused `rms_norm`): the op whose gradient the trainer's RMSNorm backward is."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def fused_add_rms_norm_gradient_fn(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual) at x's precision: the gradient of the fused residual add and norm."""
    summed = x + residual
    return rms_norm_gradient_fn(summed, weight, eps), summed


def silu_and_mul_gradient_fn(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> [..., d] `silu(gate) * up` at x's precision, as HF's MLP computes it."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def inverse_rope_table(table: torch.Tensor) -> torch.Tensor:
    """The [max_pos, rotary_dim] table (cos | -sin) of the inverse rotation: RoPE with it maps an
    output gradient to the input gradient of RoPE with `table` (the exact transpose, in FP32, rounded once)."""
    cos, sin = table.chunk(2, dim=-1)
    return torch.cat((cos, -sin), dim=-1)


#: A block-FP8 product of a quantized layer (codes, scale grids, shard sizes, rounding) with x [T, K], + bias.
Fp8Gemm = Callable[[Any, torch.Tensor, torch.Tensor | None], torch.Tensor]


class _StackedFp8Linear(torch.autograd.Function):
    """x [T, K] times the stacked BF16 weight [sum(shards), K], whose shard-by-shard block-FP8
    `codes` and stacked `scales` are given, through `gemm` with the engine layer's shard sizes and
    `rounding`; BF16 straight-through backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, shard_sizes: tuple[int, ...],
        rounding: Rounding, gemm: Fp8Gemm, codes: torch.Tensor, scales: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        layer = SimpleNamespace(
            weight=codes, weight_scale_inv=scales, bias=bias, params_dtype=x.dtype,
            fp8_align=Fp8AlignLayerState("linear", "bitwise_trainer", rounding, shard_sizes=list(shard_sizes)),
        )  # fmt: skip
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return gemm(layer, x.detach(), None if bias is None else bias.detach())

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        return (*bf16_straight_through(ctx, grad_out), None, None, None, None, None)


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


@dataclass(frozen=True)
class _Kernels:
    """The forward kernels of the ops that are not fp8_align's own: BF16 linear, log-softmax, attention."""

    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    log_softmax: Callable[[torch.Tensor], torch.Tensor]
    #: (q, k, v, batch, head_size, kv_scales) -> attention output, as `attention_reference`
    attention: Callable[..., torch.Tensor]


def _reference_kernels() -> _Kernels:
    return _Kernels(F.linear, functools.partial(torch.log_softmax, dim=-1), attention_reference)


def _engine_kernels() -> _Kernels:
    """vLLM's own kernels of a batch-invariant CUDA engine (vLLM is required on CUDA)."""
    from fp8_align.vllm_plugin.compat import batch_invariant_kernels

    kernels = batch_invariant_kernels()
    return _Kernels(kernels.linear, functools.partial(kernels.log_softmax, dim=-1), functools.partial(paged_triton_attention, kernels))


#: The stacked layers whose input columns tensor parallelism splits (vLLM's RowParallelLinear).
ROW_PARALLEL = ("o_proj", "down_proj")


def _check_tensor_parallel_size(config: Any, tensor_parallel_size: int) -> None:
    """Raise ValueError unless `tensor_parallel_size` is one the engine runs bitwise and splits
    `config`'s heads, KV heads and intermediate size evenly."""
    if isinstance(tensor_parallel_size, bool) or tensor_parallel_size not in TENSOR_PARALLEL_SIZES:
        raise ValueError(f"tensor_parallel_size must be one of {TENSOR_PARALLEL_SIZES} (a bitwise engine's), got {tensor_parallel_size!r}")
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    for name, count in (("num_attention_heads", config.num_attention_heads), ("num_key_value_heads", kv_heads),
                        ("intermediate_size", config.intermediate_size)):  # fmt: skip
        if count % tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} does not divide the model's {name} ({count})")


class BitwiseForward:
    """Token log-probs of packed sequences through the engine's kernels, with gradients.

    `model`: an HF `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM` in BF16 on one
    device; `cfg`: the engine's FP8Config (`on_policy="bitwise"`; its recipe picks the FP8 layers).
    Other model families raise UnsupportedModelError. With `cfg.kv_cache_dtype == "fp8"` the
    forward needs the per-layer K/V scales the engine generated with: `kv_scales` here or
    `set_kv_scales` (`{layer: {"k_scale", "v_scale"[, "q_scale"]}}`, as
    `fp8_align.vllm_plugin.engine_kv_scales(llm)` returns them). `tensor_parallel_size`: the
    engine's (one of `TENSOR_PARALLEL_SIZES`); it must divide the attention heads, the KV heads
    and the intermediate size (ValueError otherwise). The trainer itself stays on one device.
    """

    def __init__(
        self, model: nn.Module, cfg: FP8Config, kv_scales: Mapping[int, Mapping[str, float]] | None = None, tensor_parallel_size: int = 1
    ) -> None:
        config = model.config.get_text_config()
        if config.model_type not in MODEL_TYPES:
            raise UnsupportedModelError(
                f"BitwiseForward reproduces vLLM's {', '.join(MODEL_TYPES)} forward; this model is {config.model_type!r}"
            )
        if cfg.on_policy != "bitwise":
            raise ValueError("BitwiseForward computes what an FP8Config(on_policy='bitwise') engine computes; set on_policy='bitwise'")
        _check_tensor_parallel_size(config, tensor_parallel_size)
        self.model, self.cfg, self.config = model, cfg, config
        self.tensor_parallel_size = tensor_parallel_size
        self.head_size = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.rope = RopeSpec.from_hf_config(config)
        self.device = next(model.parameters()).device
        self.kernels = _engine_kernels() if self.device.type == "cuda" else _reference_kernels()
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
        self.fp8_gemm = self._fp8_gemm()
        self.vocab_size = min(model.get_input_embeddings().num_embeddings, model.get_output_embeddings().out_features)
        #: Per decoder layer, the FP8 KV-cache scales of the rollout being scored (None: not set yet).
        self.kv_scales: dict[int, KVCacheScales] | None = None
        if kv_scales is not None:
            self.set_kv_scales(kv_scales)

    def set_kv_scales(self, scales: Mapping[int, Mapping[str, float]]) -> None:
        """Score with the engine's FP8 KV-cache scales `scales` ({decoder layer: {"k_scale", "v_scale"
        [, "q_scale"]}}, FP32 amax / 448: what `engine_kv_scales(llm)` returns, or
        `calibrate_kv_scales(...).scales`), the ones the rollout being scored was generated with.
        Every decoder layer needs both scales; `q_scale` is accepted and not used (a bitwise engine
        attends with BF16 queries). Raises ValueError for a BF16-cache config and KVScaleError
        naming the layer or value otherwise; the scales in use do not change then."""
        if self.cfg.kv_cache_dtype != "fp8":
            raise ValueError(
                "K/V scales apply to an FP8 KV cache; this BitwiseForward's FP8Config has kv_cache_dtype="
                f"{self.cfg.kv_cache_dtype!r} (the engine's cache is BF16, its K/V are not quantized)"
            )
        payload = validate_kv_scales(scales)
        layers = set(range(self.config.num_hidden_layers))
        if set(payload) != layers:
            raise KVScaleError(
                f"K/V scales for layers {sorted(payload)}; the model's decoder layers are 0..{len(layers) - 1}: "
                f"missing {sorted(layers - set(payload))}, unknown {sorted(set(payload) - layers)}"
            )
        order = sorted(payload)
        values = host_to_device(torch.tensor([[payload[i]["k_scale"], payload[i]["v_scale"]] for i in order], dtype=torch.float32), self.device)
        self.kv_scales = {i: KVCacheScales(values[row, 0:1], values[row, 1:2]) for row, i in enumerate(order)}

    def _layer_kv_scales(self, index: int) -> KVCacheScales | None:
        """Layer `index`'s FP8 KV-cache scales, or None for a BF16 cache."""
        if self.cfg.kv_cache_dtype != "fp8":
            return None
        if self.kv_scales is None:
            raise ValueError(
                "FP8Config(kv_cache_dtype='fp8'): the trainer quantizes K/V as the engine did, with the per-layer scales "
                "the rollout was generated with; call set_kv_scales(engine_kv_scales(llm)) (fp8_align.vllm_plugin) "
                "after the scales were pushed or calibrated and before scoring"
            )
        return self.kv_scales[index]

    def _stacked_linear(self, prefix: str, names: Sequence[str]) -> StackedLinear:
        fp8 = {f"{prefix}.{name}" in self.fp8_names for name in names}
        if len(fp8) > 1:
            raise ValueError(f"{prefix}: {list(names)} are one layer in vLLM; the recipe quantizes only some of them")
        modules = tuple(self.model.get_submodule(f"{prefix}.{name}") for name in names)
        return StackedLinear(modules, tuple(m.out_features for m in modules), fp8.pop(), row_parallel=names[0] in ROW_PARALLEL)

    def _fp8_weights(self) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per FP8 stacked layer, per engine rank: (codes [N, K] e4m3, stacked scale grids) of the
        rank's slice of the current weights, each shard quantized on its own as the engine's rank
        quantizes it, all in one grouped launch on CUDA (`quantize_weights_into`). No finiteness
        check (a device sync): on CUDA a NaN/Inf weight gives NaN log-probs."""
        weights: list[torch.Tensor] = []
        codes_out: list[torch.Tensor] = []
        scales_out: list[torch.Tensor] = []
        found: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        tp = self.tensor_parallel_size
        for key, layer in self.stacked.items():
            if not layer.fp8:
                continue
            found[key] = []
            for rank in range(tp):
                slices = layer.rank_weights(rank, tp)
                sizes = list(layer.rank_sizes(tp))
                codes, scales = empty_shard_outputs(sizes, slices[0].shape[1], self.device)
                for weight, (rows, scale_rows) in zip(slices, shard_slices(sizes)):
                    weights.append(weight.detach().contiguous())
                    codes_out.append(codes[rows])
                    scales_out.append(scales[scale_rows])
                found[key].append((codes, scales))
        if weights:
            quantize_weights_into(weights, codes_out, scales_out, self.rounding.weight_pow2, self.rounding.scale_rule)
        return found

    def _fp8_gemm(self) -> Fp8Gemm:
        """The engine's block-FP8 backend on CUDA (`select_kernel` for this config), the emulated
        product of the CPU backend elsewhere."""
        if self.device.type != "cuda" or not self.fp8_names:
            return lambda layer, x, bias: emulated_block_fp8_linear(x, layer.weight, layer, bias)
        weight = self.model.get_submodule(min(self.fp8_names)).weight
        return select_kernel(self.cfg, weight.shape, [weight.shape[0]], self.device, weight.dtype).apply

    # ------------------------------------------------------------------ ops
    def _stacked(self, key: str, x: torch.Tensor, fp8_weights: dict[str, list[tuple[torch.Tensor, torch.Tensor]]], rank: int = 0) -> torch.Tensor:
        """Engine rank `rank`'s outputs of the stacked layer `key` on its input x [T, K_rank], side
        by side [T, sum(N_rank)]: one product of the rank's stacked weight, as the engine's stacked
        layer (q|k|v, gate|up) computes it; of a row-parallel layer, the rank's partial sum."""
        layer, tp = self.stacked[key], self.tensor_parallel_size
        weight, bias = layer.weight(rank, tp), layer.bias(rank, tp)
        if layer.fp8:
            return _StackedFp8Linear.apply(x, weight, bias, layer.rank_sizes(tp), self.rounding, self.fp8_gemm, *fp8_weights[key][rank])
        return engine_op(self.kernels.linear, F.linear, *((x, weight) if bias is None else (x, weight, bias)), vjp=linear_vjp)

    def _norm(self, x: torch.Tensor, norm: nn.Module, residual: torch.Tensor | None = None) -> Any:
        eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", self.config.rms_norm_eps)))
        if residual is None:
            return engine_op(functools.partial(torch.ops.fp8_align.bitwise_rms_norm, eps=eps), functools.partial(rms_norm_gradient_fn, eps=eps), x, norm.weight)
        return engine_op(
            functools.partial(torch.ops.fp8_align.bitwise_fused_add_rms_norm, eps=eps),
            functools.partial(fused_add_rms_norm_gradient_fn, eps=eps), x, residual, norm.weight,
        )  # fmt: skip

    def _rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        size, rotary = self.head_size, self.rope.rotary_dim

        def rotation(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return apply_rope(positions, q, self.table, size, rotary), apply_rope(positions, k, self.table, size, rotary)

        def kernel(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.ops.fp8_align.bitwise_rope(positions, q, k, self.table, size, rotary)

        def vjp(inputs: tuple[torch.Tensor, ...], output: torch.Tensor | None, grads: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, ...]:
            grad_q, grad_k = (g.contiguous() for g in grads)
            return torch.ops.fp8_align.bitwise_rope(positions, grad_q, grad_k, self.inverse_table, size, rotary)

        return engine_op(kernel, rotation, q, k, vjp=vjp)

    def _attention(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
        """Layer `index`'s attention: forward through the engine's kernel (over its FP8 cache when
        the config has one), backward the BF16 gradient at the unquantized K/V (straight through)."""
        return engine_op(
            functools.partial(self.kernels.attention, batch=batch, head_size=self.head_size, kv_scales=self._layer_kv_scales(index)),
            functools.partial(attention_reference, batch=batch, head_size=self.head_size, compute_dtype=q.dtype), q, k, v,
        )  # fmt: skip

    def _layer(
        self, index: int, layer: nn.Module, h: torch.Tensor, residual: torch.Tensor | None, batch: PackedBatch,
        fp8_weights: dict[str, list[tuple[torch.Tensor, torch.Tensor]]],
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

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The engine's vocabulary-parallel embedding: each rank looks up the ids in its range
        (zero rows elsewhere) and the ranks' rows are summed (so a -0.0 entry becomes +0.0 at 2 ranks)."""
        weight = self.model.model.embed_tokens.weight
        shards = vocab_shards(weight.shape[0], self.tensor_parallel_size)
        if len(shards) == 1:
            return F.embedding(ids, weight)
        rows = F.embedding(ids, weight)
        return all_reduce_sum([rows.masked_fill(((ids < s.start) | (ids >= s.stop))[:, None], 0) for s in shards])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head [T, H] -> FP32 logits [T, V]: each engine rank's vocabulary rows, side by side
        (the engine gathers the ranks' logits)."""
        weight = self.model.lm_head.weight
        parts = [engine_op(self.kernels.linear, F.linear, hidden, weight[s], vjp=linear_vjp) for s in vocab_shards(weight.shape[0], self.tensor_parallel_size)]
        return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)).float()

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
        h = self._embed(ids)
        residual = None
        for index, layer in enumerate(inner.layers):
            h, residual = self._layer(index, layer, h, residual, batch, fp8_weights)
        return self._norm(h, inner.norm, residual)[0]

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
        check_sequences(sequences, self.vocab_size, self.rope.max_positions)
        check_prompt_lens(sequences, prompt_lens)
        check_temperature(temperature)
        rows, targets, start = [], [], 0
        for seq, prompt in zip(sequences, prompt_lens):
            rows.append(torch.arange(start + prompt - 1, start + len(seq) - 1))
            targets.extend(seq[prompt:])
            start += len(seq)
        row_index = host_to_device(torch.cat(rows), self.device)
        target = host_to_device(torch.tensor(targets, dtype=torch.long), self.device)
        hidden = self._hidden_states(sequences)
        picked = []
        for chunk in range(0, row_index.numel(), chunk_rows):
            part = slice(chunk, chunk + chunk_rows)
            logits = self._logits(hidden[row_index[part]])
            if temperature != 1.0:
                logits = logits / torch.full((logits.shape[0], 1), temperature, dtype=torch.float32, device=logits.device)
            logprobs = engine_op(self.kernels.log_softmax, functools.partial(torch.log_softmax, dim=-1), logits, vjp=log_softmax_vjp, save_output=True)
            picked.append(logprobs.gather(1, target[part, None])[:, 0])
        return list(torch.cat(picked).split([len(s) - p for s, p in zip(sequences, prompt_lens)]))
