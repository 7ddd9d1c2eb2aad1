"""The linear methods of an fp8_align engine: block FP8 (load BF16, quantize, run block FP8), and
BF16 for the layers the recipe keeps in BF16; and the loader that re-quantizes what the model's
`load_weights` sends an FP8 layer later (`requantizing_weight_loader`)."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.parameter import ModelWeightParameter
from vllm.model_executor.utils import set_weight_attrs

from fp8_align.config import FP8Config
from fp8_align.quant import FP8_DTYPE
from fp8_align.quant.dispatch import quantize_weight_into
from fp8_align.quant.shards import quantize_shards, shard_slices
from fp8_align.rounding import Rounding
from fp8_align.vllm_plugin.checkpoint import SYNC_DTYPES, WeightSyncError
from fp8_align.vllm_plugin.compat import dispatch_cpu_unquantized_gemm, initialize_online_processing
from fp8_align.vllm_plugin.kernels.base import BlockFp8Kernel
from fp8_align.vllm_plugin.kernels.registry import select_kernel
from fp8_align.vllm_plugin.layer_state import Fp8AlignLayerState
from fp8_align.vllm_plugin.load_memory import note_quantizing, track_bf16_weights

logger = logging.getLogger("vllm.fp8_align")

#: Shard names vLLM's QKVParallelLinear loader takes, in shard order.
_QKV_SHARDS = ("q", "k", "v")


class Fp8AlignLinearMethod(LinearMethodBase):
    """Block FP8 for one linear layer: BF16 load, per-shard 128x128 quantization, FP8 GEMM."""

    def __init__(self, cfg: FP8Config, rounding: Rounding, prefix: str) -> None:
        """`rounding`: `cfg.rounding`, built once per engine (`Fp8AlignQuantConfig.rounding`)."""
        self.cfg = cfg
        self.rounding = rounding
        self.prefix = prefix
        #: vLLM's flag for online processing: the BF16 weight is created on the meta device and the
        #: layer is quantized as soon as it is loaded (`FP8Config.quantize_during_load`).
        self.uses_meta_device = cfg.quantize_during_load

    def create_weights(
        self,
        layer: torch.nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        """A BF16 weight the stock loaders fill; it is quantized once loaded (during the load when
        `quantize_during_load`: created on the meta device, materialized by vLLM with the layer)."""
        weight_loader = extra_weight_attrs.pop("weight_loader")
        layer.fp8_align = Fp8AlignLayerState(
            "linear",
            self.prefix,
            self.rounding,
            weight_attrs=dict(extra_weight_attrs),
            shard_sizes=list(output_partition_sizes),
        )
        shape = (sum(output_partition_sizes), input_size_per_partition)
        device = torch.device("meta") if self.uses_meta_device else None
        layer.register_parameter("weight", bf16_weight_parameter(layer, shape, params_dtype, weight_loader, device))
        track_bf16_weights(layer, ("weight",))
        if self.uses_meta_device:
            initialize_online_processing(layer)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Quantize the loaded BF16 weight to E4M3 codes + FP32 block scales.

        Idempotent: a layer that already holds FP8 codes is left as it is (verl runs vLLM's
        `process_weights_after_loading` over the whole model again after every weight sync).
        The codes Parameter gets a `weight_loader` that re-quantizes whatever the model's own
        `load_weights` sends it later (`requantizing_weight_loader`).
        """
        if layer.weight.dtype == FP8_DTYPE:
            return
        note_quantizing()
        state: Fp8AlignLayerState = layer.fp8_align
        bf16 = layer.weight.data
        codes, scales = quantize_shards(bf16, state.shard_sizes, state.rounding.weight_pow2, state.rounding.scale_rule)
        kernel = select_kernel(self.cfg, codes.shape, state.shard_sizes, bf16.device, out_dtype=bf16.dtype)
        layer.weight = torch.nn.Parameter(codes, requires_grad=False)
        layer.weight.weight_loader = requantizing_weight_loader(layer)
        layer.weight_scale_inv = torch.nn.Parameter(scales, requires_grad=False)
        state.kernel = kernel
        # DeepSeek-V3's fused q_a/kv_a projection picks a BF16 min-latency GEMM at construction
        # from its then-BF16 weight (vLLM 0.22, SM90/SM100); it must not get FP8 codes.
        if getattr(layer, "_use_min_latency_gemm", False):
            layer._use_min_latency_gemm = False
        kernel.prepare(layer)
        logger.debug("fp8_align: %s -> FP8 %s via %s", self.prefix, tuple(codes.shape), kernel.name)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x @ W.T (+ bias) in block FP8 with 1x128 dynamic activation groups."""
        kernel: BlockFp8Kernel = layer.fp8_align.kernel
        return kernel.apply(layer, x, bias)


class Fp8AlignBf16LinearMethod(UnquantizedLinearMethod):
    """vLLM's BF16 linear for the layers an fp8_align engine keeps in BF16, loadable after start.

    On CPU vLLM packs a BF16 weight for its GEMM library and then drops the loaded weight (an
    empty Parameter is left), so a later `model.load_weights` into the layer fails. Here the
    loaded weight is kept next to the packed copy (same GEMM, same numerics), and
    `refit.weight_sync` packs it again after the model's own `load_weights` wrote into it. On GPUs
    vLLM uses the loaded weight as it is, and this method is vLLM's.
    """

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """vLLM's processing, keeping the loaded weight next to the CPU GEMM's packed copy."""
        if layer.weight.device.type == "cpu" and not getattr(layer, "_cpu_skip_gemm_dispatch", False):
            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
            return
        super().process_weights_after_loading(layer)


def bf16_weight_parameter(
    layer: torch.nn.Module, shape: tuple[int, int], dtype: torch.dtype, weight_loader: Any, device: torch.device | None = None
) -> ModelWeightParameter:
    """An empty [N, K] weight Parameter as vLLM's BF16 linears create it (output dim 0, input dim 1,
    `weight_loader`, the layer's extra weight attributes), on `device` (default: torch's default)."""
    weight = ModelWeightParameter(
        data=torch.empty(shape, dtype=dtype, device=device), input_dim=1, output_dim=0, weight_loader=weight_loader
    )
    set_weight_attrs(weight, layer.fp8_align.weight_attrs)
    return weight


def requantizing_weight_loader(layer: torch.nn.Module) -> Callable[..., None]:
    """The `weight_loader` of an FP8 layer's codes Parameter (the RL stacks' weight sync).

    Called by the model's `load_weights` as vLLM calls any linear's loader:
    `(param, loaded_weight[, loaded_shard_id])`, loaded_weight a checkpoint tensor (a shard such
    as k_proj [n_k, K], or a whole fused weight with shard id None) of a dtype in SYNC_DTYPES
    (else WeightSyncError). Runs the layer's own BF16 loader into a staging tensor of the
    layer's BF16 shape (which cuts this rank's tensor-parallel slice exactly as at engine start),
    quantizes the shard(s) it wrote into `layer.weight` / `layer.weight_scale_inv` in place (data
    pointers unchanged) and refreshes the GEMM backend (`BlockFp8Kernel.weights_written`).
    """
    layer_ref = weakref.ref(layer)  # the Parameter lives on the layer: no reference cycle

    def load_and_requantize(param: torch.nn.Parameter, loaded_weight: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        target = layer_ref()
        assert target is not None
        state: Fp8AlignLayerState = target.fp8_align
        shard_id = kwargs.get("loaded_shard_id", args[0] if args else None)
        if loaded_weight.dtype not in SYNC_DTYPES:
            raise WeightSyncError(
                f"{state.prefix}: a {loaded_weight.dtype} tensor was sent; fp8_align re-quantizes "
                f"from {', '.join(str(d) for d in SYNC_DTYPES)} weights and never copies other data into FP8 codes"
            )
        codes, scales = target.weight.data, target.weight_scale_inv.data
        staging = bf16_weight_parameter(target, tuple(codes.shape), target.params_dtype, target.weight_loader, codes.device)
        target.weight_loader(staging, loaded_weight.to(codes.device), *args, **kwargs)
        slices = shard_slices(state.shard_sizes)
        rounding = state.rounding
        with torch.no_grad():
            for index in shard_indices(shard_id, len(slices)):
                rows, scale_rows = slices[index]
                quantize_weight_into(
                    staging.data[rows], rounding.weight_pow2, codes[rows], scales[scale_rows], scale_rule=rounding.scale_rule
                )
        state.kernel.weights_written(target)

    return load_and_requantize


def shard_indices(shard_id: Any, num_shards: int) -> list[int]:
    """Shards a vLLM loader call writes: None -> all; 'q'/'k'/'v' or an int -> one; a tuple -> those.
    ValueError for a name other than q/k/v."""
    if shard_id is None:
        return list(range(num_shards))
    ids = shard_id if isinstance(shard_id, tuple) else (shard_id,)
    return [_QKV_SHARDS.index(i) if isinstance(i, str) else int(i) for i in ids]
