"""Routed experts of an fp8_align engine in block FP8 (CPU emulation and vLLM's GPU MoE kernels)."""
