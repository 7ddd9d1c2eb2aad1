"""Training forwards on an HF transformers model that match an fp8_align engine.

`linear`: block-FP8 linears that still train (`apply_fp8_training`, `Fp8TrainingLinear`).
`bitwise`: the whole forward on the engine's kernels for `FP8Config(on_policy="bitwise")`
(`BitwiseForward`), whose token log-probs equal a bitwise engine's.
"""

from fp8_align.hf_training.bitwise import BitwiseForward
from fp8_align.hf_training.stacked import UnsupportedModelError
from fp8_align.hf_training.linear import FORWARD_KERNELS, STACKED_PROJECTIONS, Fp8TrainingLinear, apply_fp8_training, stacked_shard_sizes

__all__ = [
    "FORWARD_KERNELS",
    "STACKED_PROJECTIONS",
    "BitwiseForward",
    "Fp8TrainingLinear",
    "UnsupportedModelError",
    "apply_fp8_training",
    "stacked_shard_sizes",
]
