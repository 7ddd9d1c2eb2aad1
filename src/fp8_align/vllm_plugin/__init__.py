"""vLLM plugin: `LLM(model=bf16_checkpoint, quantization="fp8_align")` gives aligned block FP8.

`register()` is the `vllm.general_plugins` entry point. vLLM calls it in the engine process and
in every worker. It checks the installed vLLM version and registers the quantization method
name; it patches nothing. Patches (see `patches.py`) are applied only when an engine is built
with `quantization="fp8_align"`.
"""

from __future__ import annotations

import logging

from fp8_align.vllm_plugin.engine_args import QUANTIZATION_NAME, engine_kwargs

logger = logging.getLogger("vllm.fp8_align")

__all__ = ["QUANTIZATION_NAME", "engine_kwargs", "register"]


def register() -> None:
    """Entry point: check the vLLM version, then register `quantization="fp8_align"`."""
    from fp8_align.versions import check_vllm_version, installed_vllm_version

    version = installed_vllm_version()
    if version is None:
        raise RuntimeError("fp8_align's vLLM plugin was loaded but no vLLM distribution is installed")
    warning = check_vllm_version(version)
    if warning:
        logger.warning(warning)
    from fp8_align.vllm_plugin.quant_config import register_quantization_method

    register_quantization_method()
