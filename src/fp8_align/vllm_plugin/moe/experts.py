"""What every fp8_align routed-experts method shares: BF16 loading, quantization after loading,
and the loader that re-quantizes what the model's `load_weights` sends later.

Weights are created BF16 in vLLM's fused layout (`w13_weight` [E, 2I, H], `w2_weight` [E, H, I])
so that vLLM's own `weight_loader` fills them unchanged (expert-parallel ranks take only their
experts, tensor-parallel ranks their slice). `quantize_loaded_experts` then replaces them with
E4M3 codes of the same shapes plus `w13_weight_scale_inv` / `w2_weight_scale_inv`
(`fp8_align.quant.moe` layout), and gives the codes Parameters `requantizing_expert_loader`.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from vllm.model_executor.utils import set_weight_attrs

from fp8_align.quant import FP8_DTYPE
from fp8_align.quant.dispatch import quantize_weights_into
from fp8_align.quant.moe import expert_shard_rows, quantize_experts
from fp8_align.rounding import Rounding
from fp8_align.vllm_plugin.checkpoint import SYNC_DTYPES, WeightSyncError
from fp8_align.vllm_plugin.compat import initialize_online_processing, moe_activation_name
from fp8_align.vllm_plugin.layer_state import Fp8AlignLayerState
from fp8_align.vllm_plugin.load_memory import note_quantizing, track_bf16_weights


def unsupported_experts_reason(layer: torch.nn.Module) -> str | None:
    """Why fp8_align cannot run this routed-experts layer in block FP8, or None.

    Supported: SiLU-gated experts without biases whose router weights scale the output (Qwen-MoE,
    Mixtral, DeepSeek-V2/V3, Moonlight, OLMoE). Not: gpt-oss (biases, interleaved swigluoai),
    Llama-4 (router weight applied to the input), other activations."""
    activation = moe_activation_name(layer)
    moe = getattr(layer, "moe_config", None)
    if activation != "silu":
        return f"expert activation '{activation}' (fp8_align runs SiLU-gated experts)"
    if getattr(moe, "has_bias", False):
        return "experts with biases"
    if getattr(layer, "apply_router_weight_on_input", False):
        return "router weight applied to the expert input"
    return None


def experts_state(layer: torch.nn.Module, prefix: str, rounding: Rounding) -> Fp8AlignLayerState:
    """Give routed-experts `layer` (checkpoint name `prefix`) a fresh `Fp8AlignLayerState` with the
    engine's `rounding`, which marks it as an fp8_align FP8 layer; returns it. Called by the experts
    methods' constructors."""
    layer.fp8_align = Fp8AlignLayerState("experts", prefix, rounding)
    return layer.fp8_align


def create_bf16_expert_weights(
    layer: torch.nn.Module,
    num_experts: int,
    hidden_size: int,
    intermediate_size_per_partition: int,
    params_dtype: torch.dtype,
    extra_weight_attrs: dict[str, Any],
    during_load: bool = False,
) -> None:
    """Register BF16 `w13_weight` [E, 2I, H] and `w2_weight` [E, H, I] for vLLM's loader; with
    `during_load` on the meta device, and the layer handed to vLLM's online processing (it is
    materialized and quantized as soon as its experts are loaded: `FP8Config.quantize_during_load`).
    The layer already carries its `Fp8AlignLayerState` (`experts_state`); this fills in the rest."""
    state: Fp8AlignLayerState = layer.fp8_align
    state.weight_attrs = dict(extra_weight_attrs)
    state.params_dtype = params_dtype
    state.intermediate_size = intermediate_size_per_partition
    shapes = {
        "w13_weight": (num_experts, 2 * intermediate_size_per_partition, hidden_size),
        "w2_weight": (num_experts, hidden_size, intermediate_size_per_partition),
    }
    device = torch.device("meta") if during_load else None
    for name, shape in shapes.items():
        param = torch.nn.Parameter(torch.empty(shape, dtype=params_dtype, device=device), requires_grad=False)
        layer.register_parameter(name, param)
        set_weight_attrs(param, extra_weight_attrs)
    track_bf16_weights(layer, tuple(shapes))
    if during_load:
        initialize_online_processing(layer)


def quantize_loaded_experts(layer: torch.nn.Module) -> bool:
    """Replace the loaded BF16 experts by codes + scales rounded as the layer's `fp8_align.rounding`
    says (Parameters without a loader: see `attach_requantizing_loaders`); False (nothing done) when
    the layer already holds FP8 codes (vLLM may process a model twice: verl does after a sync)."""
    if layer.w13_weight.dtype == FP8_DTYPE:
        return False
    note_quantizing()
    rounding = layer.fp8_align.rounding
    c13, s13, c2, s2 = quantize_experts(layer.w13_weight.data, layer.w2_weight.data, rounding.weight_pow2, rounding.scale_rule)
    layer.w13_weight = torch.nn.Parameter(c13, requires_grad=False)
    layer.w2_weight = torch.nn.Parameter(c2, requires_grad=False)
    layer.w13_weight_scale_inv = torch.nn.Parameter(s13, requires_grad=False)
    layer.w2_weight_scale_inv = torch.nn.Parameter(s2, requires_grad=False)
    return True


def attach_requantizing_loaders(layer: torch.nn.Module) -> None:
    """Give the layer's expert codes Parameters `requantizing_expert_loader` (after any step that
    re-registered them, such as vLLM's kernel setup)."""
    loader = requantizing_expert_loader(layer)
    for param in (layer.w13_weight, layer.w2_weight):
        param.weight_loader = loader


def requantizing_expert_loader(layer: torch.nn.Module) -> Callable[..., Any]:
    """The `weight_loader` of an FP8 experts layer's codes Parameters.

    Called by the model's `load_weights` as vLLM calls the experts' loader:
    `(param, loaded_weight, weight_name, shard_id="w1"|"w2"|"w3", expert_id=global id,
    return_success=...)`, loaded_weight one expert's checkpoint shard [I, H] / [H, I] (or all
    experts' [E, ., .]) of a dtype in SYNC_DTYPES (else WeightSyncError, as for a shard id other
    than w1/w2/w3). Runs the layer's own loader into a BF16 staging tensor (so EP ranks skip
    foreign experts and TP ranks cut their slice as at start), then quantizes the written shard
    into the existing codes and scale rows (data pointers unchanged) and refreshes the backend.
    """
    layer_ref = weakref.ref(layer)

    def load_and_requantize(
        param: torch.nn.Parameter,
        loaded_weight: torch.Tensor,
        weight_name: str,
        shard_id: str | None = None,
        expert_id: int | None = None,
        return_success: bool = False,
        **kwargs: Any,
    ) -> bool | None:
        target = layer_ref()
        assert target is not None
        state: Fp8AlignLayerState = target.fp8_align
        if loaded_weight.dtype not in SYNC_DTYPES:
            raise WeightSyncError(
                f"{state.prefix}: {weight_name} is {loaded_weight.dtype}; fp8_align re-quantizes from "
                f"{', '.join(str(d) for d in SYNC_DTYPES)} weights and never copies other data into FP8 codes"
            )
        if shard_id not in ("w1", "w2", "w3"):
            raise WeightSyncError(f"{state.prefix}: {weight_name}: expert shard must be w1/w2/w3, got {shard_id!r}")
        codes = param.data
        all_experts = loaded_weight.dim() == 3
        buffer_shape = codes.shape if all_experts else (1, *codes.shape[1:])
        # One expert's rows, seen at every expert index: the loader writes only its own expert.
        buffer = torch.empty(buffer_shape, dtype=state.params_dtype, device=codes.device)
        staging = torch.nn.Parameter(buffer.expand(codes.shape), requires_grad=False)
        set_weight_attrs(staging, state.weight_attrs)
        loaded = target.weight_loader(
            staging, loaded_weight.to(codes.device), weight_name, shard_id=shard_id, expert_id=expert_id, return_success=True
        )
        if loaded is False:  # an expert of another expert-parallel rank
            return False if return_success else None
        experts = list(range(codes.shape[0])) if all_experts else [_local_expert_id(target, int(expert_id))]
        _quantize_shard_into(target, buffer, shard_id, experts, all_experts)
        target.quant_method.weights_written(target)
        return True if return_success else None

    return load_and_requantize


def _local_expert_id(layer: torch.nn.Module, global_id: int) -> int:
    expert_map = getattr(layer, "expert_map", None)
    return global_id if expert_map is None else int(expert_map[global_id])


def _quantize_shard_into(
    layer: torch.nn.Module, buffer: torch.Tensor, shard: str, experts: list[int], all_experts: bool
) -> None:
    """Quantize shard `shard` of `experts` from the staging `buffer` into the layer's codes/scales."""
    where = expert_shard_rows(shard, layer.fp8_align.intermediate_size, layer.w2_weight.shape[1])
    codes = layer.w13_weight.data if where.param == "w13" else layer.w2_weight.data
    scales = layer.w13_weight_scale_inv.data if where.param == "w13" else layer.w2_weight_scale_inv.data
    rounding = layer.fp8_align.rounding
    with torch.no_grad():
        quantize_weights_into(
            [buffer[e if all_experts else 0, where.rows] for e in experts],
            [codes[e, where.rows] for e in experts],
            [scales[e, where.scale_rows] for e in experts],
            rounding.weight_pow2,
            rounding.scale_rule,
        )
