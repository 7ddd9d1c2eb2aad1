"""Weight updates into a running fp8_align engine.

`push.refit_weights(llm, weights)`: the trainer-side call (validated, one grouped quantization).
`weight_sync`: the RL stacks' own `model.load_weights` re-quantizes (installed by `patches`).
"""

from fp8_align.vllm_plugin.refit.push import (
    RefitError,
    RefitResult,
    check_tensor,
    checkpoint_layout,
    open_cuda_tensors,
    refit_weights,
    share_cuda_tensors,
)

__all__ = [
    "RefitError",
    "RefitResult",
    "check_tensor",
    "checkpoint_layout",
    "open_cuda_tensors",
    "refit_weights",
    "share_cuda_tensors",
]
