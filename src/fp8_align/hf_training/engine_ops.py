"""The autograd ops of the bitwise trainer: each forward is a kernel a bitwise vLLM engine runs,
each backward the standard BF16 gradient of the op (closed form where one exists, else autograd
through torch's op at the same inputs; the FP8 linears' in block FP8 with
`FP8Config(bitwise_linear_backward="fp8")`, `fp8_backward`). Shared by `BitwiseForward` and the
modules `make_bitwise` swaps into an HF model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from fp8_align.bitwise.reference import apply_rope
from fp8_align.hf_training.attention import attention_reference, host_to_device, paged_triton_attention
from fp8_align.config import FP8Config
from fp8_align.hf_training.fp8_backward import check_fp8_backward_shape, input_gradient, weight_gradient
from fp8_align.hf_training.linear import bf16_straight_through
from fp8_align.rounding import Rounding
from fp8_align.vllm_plugin.kernels.emulated import emulated_block_fp8_linear
from fp8_align.vllm_plugin.kernels.registry import select_kernel
from fp8_align.vllm_plugin.layer_state import Fp8AlignLayerState


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


def without_autocast(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` run with torch.autocast off for the device of its first tensor argument, so the
    engine's kernels get the dtypes the engine gives them even where a stack runs the forward under
    autocast (verl's FSDP engine does, BF16)."""

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        device = next((a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
        if device is None or not torch.is_autocast_enabled(device):
            return function(*args, **kwargs)
        with torch.autocast(device_type=device, enabled=False):
            return function(*args, **kwargs)

    return run


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


def routing_weights_gradient_fn(logits: torch.Tensor, ids: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """Router logits [T, E] and the chosen expert ids [T, K] (held fixed) -> routing weights [T, K]
    in the logits' dtype as HF's Qwen3-MoE router computes them: the FP32 softmax over all experts
    at the chosen ones, divided by their sum when `renormalize`, rounded to the logits' dtype."""
    weights = torch.softmax(logits.float(), dim=-1).gather(1, ids.long())
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype)


def moe_experts_gradient_fn(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """x [T, H], routing weights [T, K] and ids [T, K] (experts in [0, E)), gate|up w13 [E, 2I, H]
    and down w2 [E, H, I], all at x's precision -> [T, H]: HF's Qwen3-MoE experts in its order (per
    expert hit, ascending, its (slot, token) pairs slot-major: `F.linear` with gate|up,
    `silu(gate) * up`, `F.linear` with down, times the routing weight, added into the output): the
    formula whose gradient the trainer's MoE block takes."""
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():
        slots, tokens = (ids.t() == expert).nonzero(as_tuple=True)
        gate, up = F.linear(x[tokens], w13[expert]).chunk(2, dim=-1)
        out = out.index_add(0, tokens, F.linear(F.silu(gate) * up, w2[expert]) * weights[tokens, slots, None])
    return out


def inverse_rope_table(table: torch.Tensor) -> torch.Tensor:
    """The [max_pos, rotary_dim] table (cos | -sin) of the inverse rotation: RoPE with it maps an
    output gradient to the input gradient of RoPE with `table` (the exact transpose, in FP32, rounded once)."""
    cos, sin = table.chunk(2, dim=-1)
    return torch.cat((cos, -sin), dim=-1)


#: A block-FP8 product of a quantized layer (codes, scale grids, shard sizes, rounding) with x [T, K], + bias.
Fp8Gemm = Callable[[Any, torch.Tensor, torch.Tensor | None], torch.Tensor]


class StackedFp8Linear(torch.autograd.Function):
    """x [T, K] times the stacked BF16 weight [sum(shards), K], whose shard-by-shard block-FP8
    `codes` and stacked `scales` are given, through `gemm` with the engine layer's shard sizes and
    `rounding`. Backward: BF16 straight-through, or with `fp8_backward` its two products in block
    FP8 (`fp8_backward.input_gradient`, `weight_gradient`; shapes checked in the forward)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, shard_sizes: tuple[int, ...],
        rounding: Rounding, gemm: Fp8Gemm, codes: torch.Tensor, scales: torch.Tensor, fp8_backward: bool,
    ) -> torch.Tensor:  # fmt: skip
        if fp8_backward:
            check_fp8_backward_shape(shard_sizes, codes.shape[1])
        layer = SimpleNamespace(
            weight=codes, weight_scale_inv=scales, bias=bias, params_dtype=x.dtype,
            fp8_align=Fp8AlignLayerState("linear", "bitwise_trainer", rounding, shard_sizes=list(shard_sizes)),
        )  # fmt: skip
        ctx.save_for_backward(x, weight, *((codes, scales) if fp8_backward else ()))
        ctx.has_bias, ctx.fp8_backward, ctx.rounding = bias is not None, fp8_backward, rounding
        return gemm(layer, x.detach(), None if bias is None else bias.detach())

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        if not ctx.fp8_backward:
            return (*bf16_straight_through(ctx, grad_out), None, None, None, None, None, None)
        x, weight, codes, scales = ctx.saved_tensors
        grad = grad_out.reshape(-1, grad_out.shape[-1]).to(weight.dtype)
        grad_x = input_gradient(grad, codes, scales, ctx.rounding).reshape(x.shape).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = weight_gradient(grad, x.reshape(-1, x.shape[-1]).to(weight.dtype), ctx.rounding) if ctx.needs_input_grad[1] else None
        grad_b = grad.sum(dim=0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


@dataclass(frozen=True)
class EngineKernels:
    """The forward kernels of the ops that are not fp8_align's own: BF16 linear, log-softmax, attention."""

    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    log_softmax: Callable[[torch.Tensor], torch.Tensor]
    #: (q, k, v, batch, head_size, kv_scales) -> attention output, as `attention_reference`
    attention: Callable[..., torch.Tensor]


def reference_kernels() -> EngineKernels:
    """The pure-torch forwards: what every op runs on CPU (no engine shares them there)."""
    return EngineKernels(F.linear, functools.partial(torch.log_softmax, dim=-1), attention_reference)


def engine_kernels(attention_tiling: str = "tile64") -> EngineKernels:
    """vLLM's own kernels of a batch-invariant CUDA engine (vLLM is required on CUDA); its linear
    launched with wider tiles (`wide_linear`: the same bits); FP8-cache attention with the trainer's
    tiling for the engine's `FP8Config.bitwise_attention_tiling` (`attention_tiling`)."""
    from fp8_align.vllm_plugin.compat import batch_invariant_kernels

    kernels = batch_invariant_kernels()
    attention = functools.partial(paged_triton_attention, kernels, tiling=attention_tiling)
    return EngineKernels(kernels.wide_linear, functools.partial(kernels.log_softmax, dim=-1), attention)


@functools.cache
def kernels_for(device: torch.device, attention_tiling: str = "tile64") -> EngineKernels:
    """The forwards a converted model on `device` runs: the engine's on CUDA (FP8-cache attention for
    `FP8Config.bitwise_attention_tiling` `attention_tiling`), the references elsewhere (one set per
    device and tiling, built once: a stack's patched log-prob function asks per micro-batch)."""
    return engine_kernels(attention_tiling) if device.type == "cuda" else reference_kernels()


def row_logprobs(logits: torch.Tensor, kernels: EngineKernels) -> torch.Tensor:
    """FP32 log-probs [N, V] of FP32 `logits` [..., V] flattened to rows: the engine's log-softmax of
    each row (backward: autograd's formula)."""
    rows = logits.reshape(-1, logits.shape[-1])
    return engine_op(kernels.log_softmax, functools.partial(torch.log_softmax, dim=-1), rows, vjp=log_softmax_vjp, save_output=True)


def label_logprobs(logits: torch.Tensor, labels: torch.Tensor, kernels: EngineKernels) -> torch.Tensor:
    """FP32 log-probs [...] of `labels` [...] (int64) under FP32 `logits` [..., V]: `row_logprobs`,
    then the label's entry."""
    return row_logprobs(logits, kernels).gather(1, labels.reshape(-1, 1))[:, 0].reshape(labels.shape)


def divided_by_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """`logits` [..., V] divided by `temperature` as vLLM's sampler divides: by an FP32 tensor (a
    true division on CUDA, where division by a Python number multiplies by its reciprocal). Out of
    place, with autograd's gradient."""
    return logits / torch.full((*logits.shape[:-1], 1), temperature, dtype=torch.float32, device=logits.device)


def fp8_gemm_for(cfg: FP8Config, device: torch.device, fp8_weights: Sequence[torch.Tensor]) -> Fp8Gemm:
    """The block-FP8 product of the engine's bitwise backend on CUDA (`select_kernel` for `cfg`,
    which is the same for every layer of a bitwise engine), the CPU backend's emulated product
    elsewhere or when the recipe quantizes none of `fp8_weights`."""
    if device.type != "cuda" or not fp8_weights:
        return lambda layer, x, bias: emulated_block_fp8_linear(x, layer.weight, layer, bias)
    weight = fp8_weights[0]
    return select_kernel(cfg, weight.shape, [weight.shape[0]], device, weight.dtype).apply


def engine_rope(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, table: torch.Tensor, inverse_table: torch.Tensor, head_size: int, rotary_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's RoPE (`bitwise_rope`, FP32 `table`) of q [T, Hq * D] and k [T, Hk * D] at
    `positions` [T]; backward: the same kernel with `inverse_table` (`inverse_rope_table`), the
    exact transpose of the rotation."""

    def rotation(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rope(positions, q, table, head_size, rotary_dim), apply_rope(positions, k, table, head_size, rotary_dim)

    def kernel(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ops.fp8_align.bitwise_rope(positions, q, k, table, head_size, rotary_dim)

    def vjp(inputs: tuple[torch.Tensor, ...], output: torch.Tensor | None, grads: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor | None, ...]:
        grad_q, grad_k = (g.contiguous() for g in grads)
        return torch.ops.fp8_align.bitwise_rope(positions, grad_q, grad_k, inverse_table, head_size, rotary_dim)

    return engine_op(kernel, rotation, q, k, vjp=vjp)


def completion_logprobs(
    hidden: torch.Tensor, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], logits_fn: Callable[[torch.Tensor], torch.Tensor],
    kernels: EngineKernels, temperature: float = 1.0, chunk_rows: int = 2048,
) -> list[torch.Tensor]:  # fmt: skip
    """Per sequence, FP32 [len - prompt_len] log-probs of its completion tokens, as the engine's
    sampler returns them, from `hidden` [sum(len), H] (the packed sequences' final hidden states):
    `logits_fn` (lm_head -> FP32 logits) on each position that predicts a completion token,
    `chunk_rows` rows at a time, divided by an FP32 `temperature` tensor when it is not 1 (vLLM's
    sampler), then the engine's log-softmax (backward: autograd's formula)."""
    rows, targets, start = [], [], 0
    for seq, prompt in zip(sequences, prompt_lens):
        rows.append(torch.arange(start + prompt - 1, start + len(seq) - 1))
        targets.extend(seq[prompt:])
        start += len(seq)
    row_index = host_to_device(torch.cat(rows), hidden.device)
    target = host_to_device(torch.tensor(targets, dtype=torch.long), hidden.device)
    picked = []
    for chunk in range(0, row_index.numel(), chunk_rows):
        part = slice(chunk, chunk + chunk_rows)
        logits = logits_fn(hidden[row_index[part]])
        if temperature != 1.0:
            logits = divided_by_temperature(logits, temperature)
        picked.append(label_logprobs(logits, target[part], kernels))
    return list(torch.cat(picked).split([len(s) - p for s, p in zip(sequences, prompt_lens)]))
