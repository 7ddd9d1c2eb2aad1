"""vLLM plugin: `LLM(model=bf16_checkpoint, quantization="fp8_align")` gives aligned block FP8.

`register()` is the `vllm.general_plugins` entry point. vLLM calls it in the engine process and
in every worker. It checks the installed vLLM version and registers the quantization method
name; it patches nothing. Patches (see `patches.py`) are applied only when an engine is built
with `quantization="fp8_align"`.

The RL loop's calls are importable from here and load their modules on first use, so importing
this package (what vLLM does in every process) imports neither them nor vLLM:

    from fp8_align.vllm_plugin import refit_weights, push_kv_scales, engine_kv_scales, calibrate_kv_scales
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from fp8_align.vllm_plugin.engine_args import QUANTIZATION_NAME, engine_kwargs

if TYPE_CHECKING:
    from fp8_align.vllm_plugin.kv.calibration import calibrate_kv_scales
    from fp8_align.vllm_plugin.kv.scales import engine_kv_scales, push_kv_scales
    from fp8_align.vllm_plugin.refit import refit_weights

logger = logging.getLogger("vllm.fp8_align")

#: Public name -> the module that defines it, imported when the name is first read.
_LAZY = {
    "refit_weights": "fp8_align.vllm_plugin.refit",
    "push_kv_scales": "fp8_align.vllm_plugin.kv.scales",
    "engine_kv_scales": "fp8_align.vllm_plugin.kv.scales",
    "calibrate_kv_scales": "fp8_align.vllm_plugin.kv.calibration",
}

__all__ = ["QUANTIZATION_NAME", "calibrate_kv_scales", "engine_kv_scales", "engine_kwargs", "push_kv_scales", "refit_weights", "register"]


def __getattr__(name: str) -> Any:
    """`refit_weights`, `push_kv_scales`, `engine_kv_scales`, `calibrate_kv_scales`: imported from their modules on first use."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


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
