"""The linear method vLLM calls for every FP8 layer: load BF16, quantize, run block FP8."""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.parameter import ModelWeightParameter
from vllm.model_executor.utils import set_weight_attrs

from fp8_align.config import FP8Config
from fp8_align.quant import DEFAULT_BLOCK_SIZE, FP8_DTYPE
from fp8_align.quant.dispatch import quantize_weight_into
from fp8_align.vllm_plugin.kernels import BlockFp8Kernel, select_kernel
from fp8_align.vllm_plugin.shards import shard_slices

logger = logging.getLogger("vllm.fp8_align")


def quantize_shards(weight: torch.Tensor, shard_sizes: list[int], pow2_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a merged [sum(shard_sizes), K] weight shard by shard (q|k|v, gate|up).

    Each shard gets its own 128x128 block grid, exactly as if the checkpoint's separate
    projections were quantized one by one. Returns (codes [N, K] e4m3, scales [sum_s ceil(n_s/128),
    ceil(K/128)] float32, the shards' grids stacked in order), via `quantize_weight_into`
    (the Triton kernel on CUDA, the torch reference elsewhere; same bits).
    """
    slices = shard_slices(shard_sizes)
    codes = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scales = torch.empty((slices[-1][1].stop, -(-weight.shape[1] // DEFAULT_BLOCK_SIZE[1])), dtype=torch.float32, device=weight.device)
    for rows, scale_rows in slices:
        quantize_weight_into(weight[rows], pow2_scale, codes[rows], scales[scale_rows])
    return codes, scales


class Fp8AlignLinearMethod(LinearMethodBase):
    """Block FP8 for one linear layer: BF16 load, per-shard 128x128 quantization, FP8 GEMM."""

    def __init__(self, cfg: FP8Config, prefix: str) -> None:
        self.cfg = cfg
        self.prefix = prefix

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
        """A BF16 weight the stock loaders fill; it is quantized after loading."""
        weight_loader = extra_weight_attrs.pop("weight_loader")
        weight = ModelWeightParameter(
            data=torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype),
            input_dim=1,
            output_dim=0,
            weight_loader=weight_loader,
        )
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)
        layer.fp8_align_shard_sizes = list(output_partition_sizes)
        layer.fp8_align_prefix = self.prefix

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Quantize the loaded BF16 weight to E4M3 codes + FP32 block scales, in place."""
        bf16 = layer.weight.data
        codes, scales = quantize_shards(bf16, layer.fp8_align_shard_sizes, self.cfg.use_weight_pow2_scale)
        kernel = select_kernel(self.cfg, codes.shape, layer.fp8_align_shard_sizes, bf16.device, out_dtype=bf16.dtype)
        layer.weight = torch.nn.Parameter(codes, requires_grad=False)
        layer.weight_scale_inv = torch.nn.Parameter(scales, requires_grad=False)
        layer.fp8_align_kernel = kernel
        kernel.prepare(layer)
        logger.debug("fp8_align: %s -> FP8 %s via %s", self.prefix, tuple(codes.shape), kernel.name)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x @ W.T (+ bias) in block FP8 with 1x128 dynamic activation groups."""
        kernel: BlockFp8Kernel = layer.fp8_align_kernel
        return kernel.apply(layer, x, bias, self.cfg.use_activation_pow2_scale)
