"""The linear methods of an fp8_align engine: block FP8 (load BF16, quantize, run block FP8), and
BF16 for the layers the recipe keeps in BF16."""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearMethodBase, UnquantizedLinearMethod
from vllm.model_executor.parameter import ModelWeightParameter
from vllm.model_executor.utils import set_weight_attrs

from fp8_align.config import FP8Config
from fp8_align.quant import DEFAULT_BLOCK_SIZE, FP8_DTYPE
from fp8_align.quant.dispatch import quantize_weight_into
from fp8_align.vllm_plugin.compat import dispatch_cpu_unquantized_gemm, initialize_online_processing
from fp8_align.vllm_plugin.kernels.base import BlockFp8Kernel
from fp8_align.vllm_plugin.kernels.registry import select_kernel
from fp8_align.vllm_plugin.linear.shards import shard_slices
from fp8_align.vllm_plugin.load_memory import note_quantizing, track_bf16_weights
from fp8_align.vllm_plugin.refit.weight_sync import requantizing_weight_loader

logger = logging.getLogger("vllm.fp8_align")


def quantize_shards(
    weight: torch.Tensor, shard_sizes: list[int], pow2_scale: bool, scale_rule: str = "amax_over_max"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a merged [sum(shard_sizes), K] weight shard by shard (q|k|v, gate|up) with
    `pow2_scale` and `scale_rule`.

    Each shard gets its own 128x128 block grid, exactly as if the checkpoint's separate
    projections were quantized one by one. Returns (codes [N, K] e4m3, scales [sum_s ceil(n_s/128),
    ceil(K/128)] float32, the shards' grids stacked in order), via `quantize_weight_into`
    (the Triton kernel on CUDA, the torch reference elsewhere; same bits).
    """
    slices = shard_slices(shard_sizes)
    codes = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scales = torch.empty((slices[-1][1].stop, -(-weight.shape[1] // DEFAULT_BLOCK_SIZE[1])), dtype=torch.float32, device=weight.device)
    for rows, scale_rows in slices:
        quantize_weight_into(weight[rows], pow2_scale, codes[rows], scales[scale_rows], scale_rule=scale_rule)
    return codes, scales


class Fp8AlignLinearMethod(LinearMethodBase):
    """Block FP8 for one linear layer: BF16 load, per-shard 128x128 quantization, FP8 GEMM."""

    def __init__(self, cfg: FP8Config, prefix: str) -> None:
        self.cfg = cfg
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
        layer.fp8_align_weight_attrs = dict(extra_weight_attrs)
        shape = (sum(output_partition_sizes), input_size_per_partition)
        device = torch.device("meta") if self.uses_meta_device else None
        layer.register_parameter("weight", bf16_weight_parameter(layer, shape, params_dtype, weight_loader, device))
        layer.fp8_align_shard_sizes = list(output_partition_sizes)
        layer.fp8_align_prefix = self.prefix
        track_bf16_weights(layer, ("weight",))
        if self.uses_meta_device:
            initialize_online_processing(layer)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Quantize the loaded BF16 weight to E4M3 codes + FP32 block scales.

        Idempotent: a layer that already holds FP8 codes is left as it is (verl runs vLLM's
        `process_weights_after_loading` over the whole model again after every weight sync).
        The codes Parameter gets a `weight_loader` that re-quantizes whatever the model's own
        `load_weights` sends it later (`weight_sync.requantizing_weight_loader`).
        """
        if layer.weight.dtype == FP8_DTYPE:
            return
        note_quantizing()
        bf16 = layer.weight.data
        codes, scales = quantize_shards(bf16, layer.fp8_align_shard_sizes, self.cfg.use_weight_pow2_scale, self.cfg.scale_rule)
        kernel = select_kernel(self.cfg, codes.shape, layer.fp8_align_shard_sizes, bf16.device, out_dtype=bf16.dtype)
        layer.weight = torch.nn.Parameter(codes, requires_grad=False)
        layer.weight.weight_loader = requantizing_weight_loader(layer)
        layer.weight_scale_inv = torch.nn.Parameter(scales, requires_grad=False)
        layer.fp8_align_kernel = kernel
        # DeepSeek-V3's fused q_a/kv_a projection picks a BF16 min-latency GEMM at construction
        # from its then-BF16 weight (vLLM 0.22, SM90/SM100); it must not get FP8 codes.
        if getattr(layer, "_use_min_latency_gemm", False):
            layer._use_min_latency_gemm = False
        kernel.prepare(layer)
        logger.debug("fp8_align: %s -> FP8 %s via %s", self.prefix, tuple(codes.shape), kernel.name)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x @ W.T (+ bias) in block FP8 with 1x128 dynamic activation groups."""
        kernel: BlockFp8Kernel = layer.fp8_align_kernel
        return kernel.apply(layer, x, bias, self.cfg.use_activation_pow2_scale, self.cfg.scale_rule)


class Fp8AlignBf16LinearMethod(UnquantizedLinearMethod):
    """vLLM's BF16 linear for the layers an fp8_align engine keeps in BF16, loadable after start.

    On CPU vLLM packs a BF16 weight for its GEMM library and then drops the loaded weight (an
    empty Parameter is left), so a later `model.load_weights` into the layer fails. Here the
    loaded weight is kept next to the packed copy (same GEMM, same numerics), and
    `weight_sync` packs it again after the model's own `load_weights` wrote into it. On GPUs
    vLLM uses the loaded weight as it is, and this method is vLLM's.
    """

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
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
    set_weight_attrs(weight, layer.fp8_align_weight_attrs)
    return weight
