"""Thin adapters from RL stacks' tensors and config names to fp8_align.metrics and fp8_align.is_correction.

- :mod:`fp8_align.adapters.nemo_rl`: NeMo RL ``ClippedPGLossFn`` (``prev_logprobs``,
  ``generation_logprobs``, ``token_mask``, ``sample_mask``; ``loss_fn.use_importance_sampling_correction``).
- :mod:`fp8_align.adapters.openrlhf`: OpenRLHF ``PolicyLoss`` (``old_log_probs``,
  ``rollout_log_probs``, ``action_mask``; ``--enable_vllm_is_correction``).
- :mod:`fp8_align.adapters.verl`: verl rollout correction (``old_log_probs``,
  ``rollout_log_probs``, ``response_mask``; ``algorithm.rollout_correction``).

None of them imports its stack: they take plain tensors and mappings, so they run anywhere.
"""
