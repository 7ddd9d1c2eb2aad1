"""Training forwards on an HF transformers model that match an fp8_align engine.

`linear`: block-FP8 linears that still train (`apply_fp8_training`, `Fp8TrainingLinear`).
`convert`: `make_bitwise(model, cfg)` turns an HF model's own forward into a bitwise engine's
(`FP8Config(on_policy="bitwise")`), so a stack's log-probs from its logits are the engine's bits.
`stack_patches`: `patch_stack_logprobs(stack)` makes the stack's own log-prob function the engine's.
`bitwise`: `BitwiseForward`, token log-probs of packed sequences through a converted copy.
"""

from fp8_align.hf_training.bitwise import BitwiseForward
from fp8_align.hf_training.convert import frozen_fp8_weights, make_bitwise, set_kv_scales
from fp8_align.hf_training.linear import FORWARD_KERNELS, STACKED_PROJECTIONS, Fp8TrainingLinear, apply_fp8_training, stacked_shard_sizes
from fp8_align.hf_training.stack_patches import patch_stack_logprobs, unpatch_stack_logprobs
from fp8_align.hf_training.stacked import UnsupportedModelError

__all__ = [
    "FORWARD_KERNELS",
    "STACKED_PROJECTIONS",
    "BitwiseForward",
    "Fp8TrainingLinear",
    "UnsupportedModelError",
    "apply_fp8_training",
    "frozen_fp8_weights",
    "make_bitwise",
    "patch_stack_logprobs",
    "set_kv_scales",
    "stacked_shard_sizes",
    "unpatch_stack_logprobs",
]
