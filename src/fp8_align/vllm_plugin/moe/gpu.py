"""Routed experts in block FP8 on CUDA: fp8_align's weights on vLLM's block-FP8 MoE kernels.

`Fp8AlignMoEMethod` is vLLM's `Fp8MoEMethod` (vLLM 0.22: `quantization/fp8.py`) configured as for
a block-FP8 checkpoint with dynamic activations, so vLLM's backend oracle, modular kernel and
`apply` run unchanged. What differs is where the weights come from: experts load BF16 (vLLM's
loader, unchanged), and after loading `fp8_align.quant.moe` quantizes every expert's gate, up and
down shard (one grouped Triton launch per layer) before `Fp8MoEMethod._setup_kernel` takes them.

Backends (`moe_backend_reads_in_place`): vLLM's Triton fused-MoE kernel with block_shape
[128, 128] (`TRITON`, its default on Hopper with one expert-parallel rank, and `BATCHED_TRITON`)
reads the codes and scales as they are, so an in-place refit is seen by the next forward. So does
DeepGEMM's grouped GEMM (`DEEPGEMM`: vLLM's `TritonOrDeepGemmExperts`, chosen by
`moe_backend="deep_gemm"` or VLLM_USE_DEEP_GEMM=1) on Hopper (SM90) with FP32 activation scales:
there DeepGEMM takes [E, N/128, K/128] FP32 weight scales as they are (its
`transform_sf_into_required_layout` only checks them), and vLLM re-quantizes nothing while
VLLM_USE_DEEP_GEMM_E8M0 is 0. Refused: DeepGEMM elsewhere (SM100 packs the scales into UE8M0
copies) or under E8M0 rounding (vLLM re-quantizes the codes to UE8M0 scales once at load, which a
refit would not repeat), FlashInfer (it shuffles the weights).

Activations are quantized by vLLM inside its MoE kernel (`per_token_group_quant_fp8`, 1x128
groups, `scale = max(amax, 1e-10) / 448`, rounded to a power of two when
`is_deep_gemm_e8m0_used()`); the `moe_activation_rounding` patch sets VLLM_USE_DEEP_GEMM_E8M0 to
the configured `use_activation_pow2_scale` before any MoE kernel is built. These activations are
not bit-identical to `fp8_align.quant.quantize_activation_groupwise` (the epsilon differs for
all-zero groups, and vLLM fuses SiLU-and-multiply with the second quantization when E8M0 is off),
so tests compare the layer output with `block_fp8_moe_reference` within a tolerance.
For the same reason `scale_rule="transformer_engine"` cannot be honoured here: vLLM's kernel always
divides by `amax / 448`, so an engine with that rule refuses to build FP8 routed experts on CUDA
(`check_scale_rule_supported`) instead of silently quantizing activations by the other rule.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8MoEMethod
from vllm.utils.deep_gemm import is_deep_gemm_e8m0_used

from fp8_align.config import FP8Config
from fp8_align.quant import DEFAULT_BLOCK_SIZE
from fp8_align.rounding import Rounding
from fp8_align.vllm_plugin.moe.experts import (
    attach_requantizing_loaders,
    create_bf16_expert_weights,
    experts_state,
    quantize_loaded_experts,
)

#: vLLM MoE backends that read fp8_align's codes and scales in place on any GPU.
IN_PLACE_BACKENDS = ("TRITON", "BATCHED_TRITON")
#: ... and only on Hopper (SM90) with FP32 activation scales (see the module docstring).
IN_PLACE_ON_SM90_FP32_SCALES = ("DEEPGEMM",)


class Fp8AlignMoEError(ValueError):
    """An MoE layer fp8_align cannot run in block FP8 on this engine, with what to change."""


def check_scale_rule_supported(cfg: FP8Config, prefix: str) -> None:
    """Raise Fp8AlignMoEError when `cfg.scale_rule` is one vLLM's MoE kernels cannot compute.

    vLLM quantizes the experts' activations inside its fused-MoE kernel with its own rule
    (`amax / 448`, see the module docstring); TransformerEngine's rule is not available there.
    """
    if cfg.scale_rule != "amax_over_max":
        raise Fp8AlignMoEError(
            f"{prefix}: scale_rule={cfg.scale_rule!r} is not supported for routed experts on CUDA: vLLM's "
            "block-FP8 MoE kernel quantizes the experts' activations itself with scale amax/448, so "
            "TransformerEngine's rule (multiplier 448/amax) cannot be applied there. Use "
            "scale_rule='amax_over_max' for MoE models on GPU, or keep the MoE layers in BF16."
        )


def moe_backend_reads_in_place(backend: str, device_major: int, e8m0_rounding: bool) -> bool:
    """Whether vLLM's FP8 MoE `backend` (an `Fp8MoeBackend` name) computes with fp8_align's codes
    and FP32 scale grids where they lie, on a GPU of compute capability `device_major`.x with
    vLLM's DeepGEMM E8M0 rounding on or off: then a refit written in place is what it reads."""
    if backend in IN_PLACE_BACKENDS:
        return True
    return backend in IN_PLACE_ON_SM90_FP32_SCALES and device_major == 9 and not e8m0_rounding


class Fp8AlignMoEMethod(Fp8MoEMethod):
    """Block-FP8 routed experts on vLLM's Triton or (Hopper) DeepGEMM MoE kernels (module docstring)."""

    def __init__(self, cfg: FP8Config, rounding: Rounding, layer: torch.nn.Module, prefix: str) -> None:
        """`rounding`: `cfg.rounding`, built once per engine (`Fp8AlignQuantConfig.rounding`)."""
        check_scale_rule_supported(cfg, prefix)
        block = list(DEFAULT_BLOCK_SIZE)
        super().__init__(Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=block), layer)
        self.cfg = cfg
        experts_state(layer, prefix, rounding)
        #: vLLM's online-processing flag: experts created on the meta device, quantized once loaded
        self.uses_meta_device = cfg.quantize_during_load
        backend = getattr(self.fp8_backend, "name", str(self.fp8_backend))
        device_major, e8m0 = torch.cuda.get_device_capability()[0], is_deep_gemm_e8m0_used()
        if not moe_backend_reads_in_place(backend, device_major, e8m0):
            raise Fp8AlignMoEError(
                f"{prefix}: vLLM chose the {backend} MoE backend (SM{device_major}x, DeepGEMM E8M0 rounding "
                f"{'on' if e8m0 else 'off'}); fp8_align runs routed experts only on backends "
                "that read its codes and scales in place, so that every step's re-quantization is what they "
                "compute with: vLLM's Triton block-FP8 MoE kernel (moe_backend='triton'), or DeepGEMM "
                "(moe_backend='deep_gemm') on Hopper with FP32 scales. Set moe_backend, or unset "
                "VLLM_USE_DEEP_GEMM / VLLM_MOE_USE_DEEP_GEMM, or use one expert-parallel rank."
            )

    @property
    def kernel_name(self) -> str:
        return f"vllm_{self.fp8_backend.name.lower()}"

    def create_weights(
        self,
        layer: torch.nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        """BF16 experts for vLLM's loader; sizes must fill whole 128-blocks (one grid per expert)."""
        bad = [f"{what}={size}" for what, size in (("intermediate size per partition", intermediate_size_per_partition),
                                                   ("hidden size", hidden_size)) if size % DEFAULT_BLOCK_SIZE[0]]  # fmt: skip
        if bad:
            raise Fp8AlignMoEError(
                f"{layer.fp8_align.prefix}: {', '.join(bad)} is not a multiple of 128, so the gate/up/down 128x128 "
                "grids do not line up with the single grid vLLM's block-FP8 MoE kernel reads. With tensor "
                "parallelism, lower tensor_parallel_size or use enable_expert_parallel=True (whole experts per rank)."
            )
        create_bf16_expert_weights(
            layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, extra_weight_attrs, self.uses_meta_device
        )
        layer.num_experts = num_experts
        layer.orig_dtype = params_dtype
        layer.weight_block_size = list(DEFAULT_BLOCK_SIZE)
        layer.w13_input_scale = None
        layer.w2_input_scale = None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Quantize the loaded experts (idempotent), then build vLLM's MoE kernel on them."""
        if not quantize_loaded_experts(layer):
            return
        self._setup_kernel(
            layer, layer.w13_weight, layer.w2_weight, layer.w13_weight_scale_inv, layer.w2_weight_scale_inv, None, None
        )
        attach_requantizing_loaders(layer)  # _setup_kernel re-registered the codes Parameters

    def weights_written(self, layer: torch.nn.Module) -> None:
        """Nothing to refresh: the Triton and DeepGEMM kernels read the codes and scale Parameters in place."""
