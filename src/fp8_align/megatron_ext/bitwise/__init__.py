"""Bitwise on-policy FP8 with megatron-core: a GPTModel whose log-probs are a bitwise vLLM engine's
bit for bit (`build_bitwise_gpt`, `token_logprobs`; docs/megatron.md, "Bitwise"). Needs megatron-core;
`modules` holds the layer spec's modules, `model` the build, the THD parameters and the log-probs.
"""

from fp8_align.megatron_ext.bitwise.model import (
    BITWISE_CONFIG,
    bitwise_context_of,
    bitwise_layer_specs,
    build_bitwise_gpt,
    packed_seq_params,
    set_kv_scales,
    token_logprobs,
)

__all__ = [
    "BITWISE_CONFIG",
    "bitwise_context_of",
    "bitwise_layer_specs",
    "build_bitwise_gpt",
    "packed_seq_params",
    "set_kv_scales",
    "token_logprobs",
]
