"""Every change fp8_align makes to vLLM's behaviour, in one place.

Each patch names the vLLM symbol and the versions it targets, is applied only when an engine is
built with `quantization="fp8_align"` (from `Fp8AlignQuantConfig.get_quant_method`, i.e. in the
worker that builds the model), is idempotent, and can be undone with `undo_patches()`.

No environment patch is needed. vLLM 0.22 on Hopper rounds block-FP8 scales to powers of two
(UE8M0) by default (VLLM_USE_DEEP_GEMM_E8M0=1), but only inside its own FP8 methods and wherever
`is_deep_gemm_e8m0_used()` is left to decide. fp8_align's layers never reach those: the GPU
backends (`gpu_kernels.py`) quantize activations with their own kernel and call DeepGEMM through
`torch.ops.vllm.fp8_gemm_nt_op(..., use_deep_gemm_e8m0=False)`, so the scales fp8_align computed
are used as they are (tests/test_gpu_kernels.py checks DeepGEMM against the FP32-scale reference
with the env default left at 1). The former VLLM_USE_DEEP_GEMM_E8M0 patch was removed.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fp8_align.config import FP8Config
from fp8_align.versions import installed_vllm_version, vllm_series

logger = logging.getLogger("vllm.fp8_align")


@dataclass(frozen=True)
class MethodPatch:
    """Replace `<module>.<cls>.<attribute>` by `wrap(original)`, remembering the original."""

    name: str
    module: str
    cls: str
    attribute: str
    wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
    versions: tuple[tuple[int, int], ...]
    reason: str

    @property
    def target(self) -> str:
        return f"{self.module}.{self.cls}.{self.attribute}"


def _hash_with_fp8_align_config(compute_hash: Callable[[Any], str]) -> Callable[[Any], str]:
    """`VllmConfig.compute_hash` that also covers the engine's FP8Config (10 hex chars, as vLLM's)."""

    @functools.wraps(compute_hash)
    def patched(self: Any) -> str:
        base = compute_hash(self)
        fp8_config: FP8Config | None = getattr(self.quant_config, "fp8_config", None)
        if fp8_config is None:
            return base
        return hashlib.sha256(f"{base}|fp8_align:{fp8_config.to_json()}".encode()).hexdigest()[:10]

    return patched


def _patches_for(cfg: FP8Config) -> list[MethodPatch]:
    """The patches an engine running `cfg` needs (the same for every FP8Config)."""
    return [
        MethodPatch(
            name="compile_cache_key_includes_fp8_config",
            module="vllm.config.vllm",
            cls="VllmConfig",
            attribute="compute_hash",
            wrap=_hash_with_fp8_align_config,
            versions=((0, 22), (0, 32)),
            reason=(
                "vLLM keys its torch.compile/AOT cache on VllmConfig.compute_hash, which skips "
                "hf_overrides and the quant config (only the name 'fp8_align' is hashed): a second "
                "engine with another FP8Config (BF16 layers, pow2 scales) on the same model would "
                "load the first one's compiled graph"
            ),
        )
    ]


_applied: dict[str, tuple[MethodPatch, Callable[..., Any]]] = {}


def apply_patches(cfg: FP8Config) -> list[str]:
    """Apply the patches for `cfg` that target the installed vLLM; returns their names."""
    version = installed_vllm_version()
    series = vllm_series(version) if version else None
    names = []
    for patch in _patches_for(cfg):
        if series not in patch.versions:
            continue
        if patch.name not in _applied:
            owner = getattr(importlib.import_module(patch.module), patch.cls)
            original = getattr(owner, patch.attribute)
            setattr(owner, patch.attribute, patch.wrap(original))
            _applied[patch.name] = (patch, original)
            logger.info("fp8_align: patched %s (%s)", patch.target, patch.reason)
        names.append(patch.name)
    return names


def undo_patches() -> None:
    """Restore everything `apply_patches` changed."""
    for patch, original in _applied.values():
        setattr(getattr(importlib.import_module(patch.module), patch.cls), patch.attribute, original)
    _applied.clear()


def applied_patches() -> list[str]:
    """Names of the patches currently applied."""
    return sorted(_applied)
