"""Every change fp8_align makes to vLLM's behaviour, in one place.

Each patch names the vLLM symbol and the versions it targets, is applied only when an engine is
built with `quantization="fp8_align"`, is idempotent, and can be undone with `undo_patches()`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from fp8_align.config import FP8Config
from fp8_align.versions import installed_vllm_version, vllm_series

logger = logging.getLogger("vllm.fp8_align")


@dataclass(frozen=True)
class EnvPatch:
    """Set an environment variable that vLLM reads lazily, remembering the previous value."""

    name: str
    value: str
    target: str
    versions: tuple[tuple[int, int], ...]
    reason: str


def _patches_for(cfg: FP8Config) -> list[EnvPatch]:
    # vLLM 0.22 on Hopper rounds block-FP8 scales to powers of two for DeepGEMM (UE8M0) unless
    # VLLM_USE_DEEP_GEMM_E8M0=0; fp8_align must run exactly the configured scales.
    e8m0 = "1" if (cfg.use_weight_pow2_scale and cfg.use_activation_pow2_scale) else "0"
    return [
        EnvPatch(
            name="VLLM_USE_DEEP_GEMM_E8M0",
            value=e8m0,
            target="vllm.envs.VLLM_USE_DEEP_GEMM_E8M0 (read by vllm.utils.deep_gemm.is_deep_gemm_e8m0_used)",
            versions=((0, 22),),
            reason="DeepGEMM scale rounding must equal the configured weight/activation pow2 flags",
        )
    ]


_applied: dict[str, str | None] = {}


def apply_patches(cfg: FP8Config) -> list[str]:
    """Apply the patches for `cfg` that target the installed vLLM; returns their names."""
    version = installed_vllm_version()
    series = vllm_series(version) if version else None
    names = []
    for patch in _patches_for(cfg):
        if series not in patch.versions:
            continue
        if patch.name not in _applied:
            _applied[patch.name] = os.environ.get(patch.name)
        if os.environ.get(patch.name) != patch.value:
            os.environ[patch.name] = patch.value
            logger.info("fp8_align: %s=%s (%s; %s)", patch.name, patch.value, patch.target, patch.reason)
        names.append(patch.name)
    return names


def undo_patches() -> None:
    """Restore everything `apply_patches` changed."""
    for name, previous in _applied.items():
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous
    _applied.clear()


def applied_patches() -> list[str]:
    """Names of the patches currently applied."""
    return sorted(_applied)
