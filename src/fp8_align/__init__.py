"""fp8_align: aligned block-FP8 for RL of language models (vLLM generation + Megatron training).

Importing this package changes nothing in vLLM: the plugin acts only when a vLLM engine is asked
for `quantization="fp8_align"`.
"""

from fp8_align.config import CONFIG_ENV_VAR, FP8Config, FP8ConfigError

__version__ = "0.1.0"

__all__ = ["CONFIG_ENV_VAR", "FP8Config", "FP8ConfigError", "__version__"]
