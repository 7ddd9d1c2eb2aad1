"""Block-FP8 numerics: E4M3 codes with 128x128 weight blocks and 1x128 activation groups.

Pure torch; works on CPU and CUDA tensors alike. Every function here is the reference that the
fast kernels of the vLLM plugin are tested against.
"""

from fp8_align.quant.blockwise import (
    DEFAULT_BLOCK_SIZE,
    blockwise_scale_shape,
    dequantize_blockwise,
    quantize_weight_blockwise,
)
from fp8_align.quant.groupwise import DEFAULT_GROUP_SIZE, dequantize_groupwise, quantize_activation_groupwise
from fp8_align.quant.linear import blockwise_fp8_linear, fp8_block_gemm
from fp8_align.quant.scales import E4M3_MAX, FP8_DTYPE, round_up_to_pow2, scale_from_amax

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_GROUP_SIZE",
    "E4M3_MAX",
    "FP8_DTYPE",
    "blockwise_fp8_linear",
    "blockwise_scale_shape",
    "dequantize_blockwise",
    "dequantize_groupwise",
    "fp8_block_gemm",
    "quantize_activation_groupwise",
    "quantize_weight_blockwise",
    "round_up_to_pow2",
    "scale_from_amax",
]
