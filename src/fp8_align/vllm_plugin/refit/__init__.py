"""Weight updates into a running fp8_align engine.

`push.refit_weights(llm, weights)`: the trainer-side call (validated, one grouped quantization),
its update carried to the workers by `transport`. `weight_sync`: the RL stacks' own
`model.load_weights` re-quantizes (installed by `patches`). Both validate against the engine's
checkpoint (`vllm_plugin.checkpoint`) and raise `RefitError`.
"""

from fp8_align.vllm_plugin.checkpoint import RefitError, check_tensor, checkpoint_layout
from fp8_align.vllm_plugin.refit.push import RefitResult, refit_weights
from fp8_align.vllm_plugin.refit.transport import open_cuda_tensors, share_cuda_tensors

__all__ = [
    "RefitError",
    "RefitResult",
    "check_tensor",
    "checkpoint_layout",
    "open_cuda_tensors",
    "refit_weights",
    "share_cuda_tensors",
]
