"""Bitwise on-policy operators: the kernels a `FP8Config(on_policy="bitwise")` engine and
`fp8_align.hf_training.BitwiseForward` both run, so generation and training log-probs are equal
bit for bit.

`reference` holds the pure-torch definition of each operator (and RoPE's FP32 table), `ops` the
torch custom ops both sides call (Triton kernels on CUDA, the references on CPU), and
`triton_kernels` the kernels themselves: RMSNorm, residual-add + RMSNorm, SiLU-and-mul and a
block-FP8 GEMM with one tile configuration for every token count. Every kernel computes a row
(token) from that row alone, in an order fixed by the kernel's constants, so a token's result
does not depend on how many other tokens share the launch (batch size, prefill or decode).
"""

#: HF `model_type`s whose forward both sides reproduce (vLLM's Llama, Qwen2, Qwen3 and Qwen3-MoE
#: model code; the MoE ones also pass `MOE_MODEL_TYPES`' conditions).
MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
#: The Mixture-of-Experts `model_type`s among them: block-FP8 routed experts without shared experts,
#: at tensor parallel size 1 and without expert parallelism (`moe.moe_experts`; the engine's check
#: `vllm_plugin.on_policy.bitwise_engine_problems` also asks for a GPU proof's lab switch).
MOE_MODEL_TYPES = ("qwen3_moe",)
#: Tensor-parallel sizes a bitwise engine may run and `BitwiseForward` reproduces: at 2 ranks the
#: all-reduce of a row-parallel layer's two BF16 partial sums is one correctly rounded BF16 addition,
#: whatever the collective's algorithm or order; more ranks sum in the collective's own order.
TENSOR_PARALLEL_SIZES = (1, 2)
