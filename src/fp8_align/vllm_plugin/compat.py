"""vLLM symbols whose home differs between the releases fp8_align supports, resolved in one place.

Each name below says which releases it was checked in. Nothing else in the plugin branches on
the vLLM version; the version gate itself is `fp8_align.versions`.
"""

from __future__ import annotations

# vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm(layer, remove_weight): packs a
# BF16 linear's weight for the CPU GEMM library (layer.cpu_linear). vLLM 0.22, 0.32.
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

__all__ = ["dispatch_cpu_unquantized_gemm"]
