"""The aligned training forward on an HF transformers model: block-FP8 linears that still train.

`apply_fp8_training(model, cfg)` swaps every linear the recipe quantizes (the rule of
`fp8_align.layer_selection`, as `fp8_align.hf_emulation` and the vLLM plugin use) for an
`Fp8TrainingLinear`. It keeps the original BF16 `weight` Parameter (so optimizers, state dicts and
weight sync see the same tensors), and every forward quantizes the current weight in 128x128
blocks (once per weight inside `convert.frozen_fp8_weights`) and the input in 1x128 groups exactly
as the vLLM plugin does with the weights it is sent,
then runs `fp8_align.quant.blockwise_fp8_linear`. The backward is BF16: gradients are those of
`x @ w.T` with the BF16 weight (a straight-through estimator for both quantizers), which is what
a BF16-backward FP8 recipe computes.

`forward_kernel="engine"` (CUDA, vLLM installed) makes the forward kernel-identical to a vLLM
engine running fp8_align: the weight is quantized by the plugin's GPU quantizer and the product
runs through the block-FP8 GEMM backend the plugin selects for the engine's layer (DeepGEMM,
CUTLASS, cuBLASLt or Triton, `vllm_plugin.kernels.select_kernel`) with the plugin's activation
quantizer. vLLM stacks q/k/v into `qkv_proj` and gate/up into `gate_up_proj`; the backend is
chosen for that stacked shape (shard sizes included) and run on this projection's shard, whose
rows are the same dot products, except where vLLM's CUTLASS dispatch turns to Stream-K for the
shard alone (K > 3 x its rows, e.g. Qwen3-8B's k/v_proj): there the order of the K sum, and so the
bits, may differ from the engine's stacked call. `BitwiseForward` stacks its projections instead. Only the attention, norms and the
rest of the model still run HF's code. Default "emulation": the pure-torch reference (`fp8_align.quant`).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import torch
from torch import nn

from fp8_align.config import FP8Config
from fp8_align.hf_emulation import is_fused_experts, recipe_fp8_modules, replace_submodule
from fp8_align.quant import blockwise_fp8_linear, quantize_weight_blockwise
from fp8_align.quant.dispatch import quantize_weight_into
from fp8_align.vllm_plugin.kernels.registry import select_kernel
from fp8_align.vllm_plugin.layer_state import Fp8AlignLayerState

#: vLLM's stacked projections of Llama-family models (its `packed_modules_mapping`): HF sibling
#: names in shard order.
STACKED_PROJECTIONS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
FORWARD_KERNELS = ("emulation", "engine")


def codes_still_hold(held: Sequence[torch.Tensor], versions: Sequence[int], weights: Sequence[torch.Tensor], where: str) -> bool:
    """Inside `frozen_fp8_weights`: whether FP8 codes computed from the `held` weight tensors at
    `versions` still belong to `weights` (the tensors the layer holds now): False when it holds other
    tensor objects (compute again), True when the same ones at the same versions; RuntimeError
    naming `where` when one changed in place since (the codes would be stale)."""
    if any(old is not new for old, new in zip(held, weights, strict=True)):
        return False
    if tuple(versions) != tuple(w._version for w in weights):
        raise RuntimeError(
            f"{where}: a weight changed in place inside frozen_fp8_weights(...): its FP8 codes would be stale; "
            "end the block before the optimizer step or weight load and open a new one after it"
        )
    return True


class _BlockFp8LinearFunction(torch.autograd.Function):
    """y = block-FP8(x) @ block-FP8(w).T (+ b) forward; BF16 straight-through backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        module: Fp8TrainingLinear,
    ) -> torch.Tensor:
        rounding = module.rounding
        codes, scale_inv = module.fp8_weight()
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return blockwise_fp8_linear(
            x.detach(), codes, scale_inv, None if bias is None else bias.detach(), rounding.activation_pow2,
            out_dtype=x.dtype, scale_rule=rounding.scale_rule,
        )  # fmt: skip

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        return (*bf16_straight_through(ctx, grad_out), None)


def bf16_straight_through(
    ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Gradients (x, weight, bias) of `x @ w.T + b` with the BF16 x and weight saved first in
    `ctx` (a Function whose first three inputs are x, weight, bias; `ctx.has_bias` set)."""
    x, weight = ctx.saved_tensors
    grad_2d = grad_out.reshape(-1, grad_out.shape[-1]).to(weight.dtype)
    grad_x = (grad_2d @ weight).reshape(x.shape).to(x.dtype) if ctx.needs_input_grad[0] else None
    grad_w = grad_2d.T @ x.reshape(-1, x.shape[-1]).to(weight.dtype) if ctx.needs_input_grad[1] else None
    grad_b = grad_2d.sum(dim=0) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return grad_x, grad_w, grad_b


class _EngineKernelLinearFunction(torch.autograd.Function):
    """Forward through the vLLM plugin's GPU backend `kernel`; BF16 straight-through backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        module: Fp8TrainingLinear,
    ) -> torch.Tensor:
        rounding = module.rounding
        codes, scale_inv = module.fp8_weight()
        layer = SimpleNamespace(
            weight=codes, weight_scale_inv=scale_inv, params_dtype=x.dtype,
            fp8_align=Fp8AlignLayerState("linear", module.name, rounding, shard_sizes=[codes.shape[0]]),
        )  # fmt: skip
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        kernel = module.engine_kernel(x.device, x.dtype)
        return kernel.apply(layer, x.detach(), None if bias is None else bias.detach())

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_out: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, None]:
        return (*bf16_straight_through(ctx, grad_out), None)


class Fp8TrainingLinear(nn.Module):
    """nn.Linear replacement holding the same `weight` / `bias` Parameters, block-FP8 forward.

    Input [..., in_features] in the weight's dtype (BF16 for a BF16 model) -> [..., out_features]
    in the input's dtype. The FP8 codes are recomputed from the current weight at every forward
    (once per block inside `frozen_fp8_weights`), so after an optimizer step the layer computes what
    a vLLM engine sent that weight computes.
    The "engine" forward does not sync the host (a NaN/Inf weight gives NaN outputs, as in
    `BitwiseForward`); the "emulation" forward raises ValueError on one.
    `forward_kernel` "engine" runs the vLLM plugin's GPU kernels (module docstring); then
    `stacked_shape` ([N, K] of the engine's stacked layer) and `shard_sizes` pick the backend.
    """

    def __init__(
        self,
        linear: nn.Linear,
        cfg: FP8Config,
        forward_kernel: str = "emulation",
        name: str = "",
        shard_sizes: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        if forward_kernel not in FORWARD_KERNELS:
            raise ValueError(f"forward_kernel must be one of {FORWARD_KERNELS}, got {forward_kernel!r}")
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.rounding = cfg.rounding
        self.forward_kernel = forward_kernel
        self.name = name
        self.shard_sizes = tuple(shard_sizes or (linear.out_features,))
        self._cfg = cfg
        self._kernels: dict[tuple[torch.device, torch.dtype], object] = {}
        #: inside `frozen_fp8_weights`: codes kept with the weight tensor and its version they came from
        self.frozen = False
        self._held: tuple[torch.Tensor, int, torch.Tensor, torch.Tensor] | None = None

    def fp8_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The current weight's block-FP8 codes [N, K] and inverse scales [N/128, K/128] (FP32): at every
        call, or while `frozen` once per weight version, reused after (RuntimeError when the weight
        changed in place since). The "engine" forward's quantizer does not check finiteness (a device
        sync per layer and micro-batch; a NaN/Inf weight gives NaN outputs, and the engine's weight
        sync refuses it); the "emulation" one raises ValueError."""
        weight = self.weight
        if self.frozen and self._held is not None and codes_still_hold((self._held[0],), (self._held[1],), (weight,), self.name):
            return self._held[2], self._held[3]
        rounding = self.rounding
        if self.forward_kernel == "engine":
            codes, scale_inv = quantize_weight_into(weight.detach(), rounding.weight_pow2, check_finite=False, scale_rule=rounding.scale_rule)
        else:
            codes, scale_inv = quantize_weight_blockwise(weight.detach(), pow2_scale=rounding.weight_pow2, scale_rule=rounding.scale_rule)
        if self.frozen:
            self._held = (weight, weight._version, codes, scale_inv)
        return codes, scale_inv

    def unfreeze(self) -> None:
        """Leave the frozen state and drop the held codes."""
        self.frozen, self._held = False, None

    def engine_kernel(self, device: torch.device, dtype: torch.dtype) -> object:
        """The backend the vLLM plugin selects for this layer's stacked shape on `device`."""
        key = (device, dtype)
        if key not in self._kernels:
            if device.type != "cuda":
                raise RuntimeError(f"{self.name}: forward_kernel='engine' runs the plugin's CUDA kernels; input is on {device}")
            stacked = torch.Size((sum(self.shard_sizes), self.in_features))
            self._kernels[key] = select_kernel(self._cfg, stacked, list(self.shard_sizes), device, dtype)
        return self._kernels[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.forward_kernel == "engine":
            return _EngineKernelLinearFunction.apply(x, self.weight, self.bias, self)
        return _BlockFp8LinearFunction.apply(x, self.weight, self.bias, self)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, block_fp8_forward={self.forward_kernel}, "
            "bf16_backward"
        )


def stacked_shard_sizes(model: nn.Module, name: str) -> tuple[int, ...]:
    """Output sizes of the shards vLLM stacks the linear `name` with (`STACKED_PROJECTIONS`), in
    shard order; just its own size when it is not stacked."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    for group in STACKED_PROJECTIONS:
        if child in group and all(isinstance(getattr(parent, sibling, None), nn.Linear) for sibling in group):
            return tuple(getattr(parent, sibling).out_features for sibling in group)
    return (model.get_submodule(name).out_features,)


def apply_fp8_training(
    model: nn.Module, cfg: FP8Config, num_hidden_layers: int | None = None, forward_kernel: str = "emulation"
) -> list[str]:
    """Replace the recipe's linears in `model` in place; returns the names that became FP8.

    `num_hidden_layers` defaults to `model.config.num_hidden_layers` (HF models). `forward_kernel`:
    "emulation" (pure torch, any device) or "engine" (the vLLM plugin's CUDA kernels, see the
    module docstring). Fused MoE expert modules the recipe runs in FP8 are refused (ValueError):
    their training forward is not implemented here.
    """
    chosen = recipe_fp8_modules(model, cfg, num_hidden_layers)
    for name, module in chosen:
        if is_fused_experts(module):
            raise ValueError(f"{name}: fused MoE experts have no FP8 training forward in fp8_align.hf_training")
    replacements = [
        (name, Fp8TrainingLinear(module, cfg, forward_kernel, name, stacked_shard_sizes(model, name))) for name, module in chosen
    ]
    for name, replacement in replacements:
        replace_submodule(model, name, replacement)
    return [name for name, _ in chosen]
