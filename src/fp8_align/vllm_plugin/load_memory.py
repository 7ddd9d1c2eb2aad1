"""How many bytes of BF16 weights an engine's FP8 layers held at once while its model loaded.

Every FP8 layer (linears, routed experts) is created with BF16 weights that vLLM's loaders fill
and that fp8_align then quantizes. With `FP8Config.quantize_during_load` those weights start on
the meta device and vLLM materializes and quantizes one layer at a time, so only the layers being
loaded hold BF16 at once; without it every FP8 layer holds its BF16 weight until the whole
checkpoint is in. `track_bf16_weights` registers a layer at creation; `note_quantizing` is called
as each layer is quantized and records the BF16 bytes then held by all registered layers; the
engine-start line (`log_load_memory`) reports the peak against the total. Per process: a worker
loads one model.
"""

from __future__ import annotations

import logging
import weakref

import torch

from fp8_align.quant import FP8_DTYPE

logger = logging.getLogger("vllm.fp8_align")

_LAYERS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[str, ...]] = weakref.WeakKeyDictionary()
_STATE = {"peak_bytes": 0, "total_bytes": 0, "layers": 0}


def track_bf16_weights(layer: torch.nn.Module, names: tuple[str, ...]) -> None:
    """Register `layer`'s BF16 weight Parameters `names` (just created, possibly on meta)."""
    _LAYERS[layer] = names
    _STATE["total_bytes"] += sum(w.numel() * w.element_size() for w in (getattr(layer, name) for name in names))
    _STATE["layers"] += 1


def bf16_bytes_held() -> int:
    """Bytes of BF16 weights the registered layers hold now on a real device (not meta, not yet FP8)."""
    held = 0
    for layer, names in list(_LAYERS.items()):
        for name in names:
            weight = getattr(layer, name)
            if weight.dtype != FP8_DTYPE and not weight.is_meta:
                held += weight.numel() * weight.element_size()
    return held


def note_quantizing() -> None:
    """Record the BF16 bytes held right before a layer is quantized (the load's high points)."""
    _STATE["peak_bytes"] = max(_STATE["peak_bytes"], bf16_bytes_held())


def take_load_memory() -> dict[str, int]:
    """{"peak_bytes", "total_bytes", "layers"} of the load since the last call, and reset."""
    state = dict(_STATE)
    _STATE.update(peak_bytes=0, total_bytes=0, layers=0)
    _LAYERS.clear()
    return state


def log_load_memory(model: torch.nn.Module) -> dict[str, int]:
    """Log the load's peak against the total and keep it on `model` as `fp8_align_load_memory`.
    On CUDA the record also holds `device_peak_bytes`: `torch.cuda.max_memory_allocated` of the
    model's device when the load finished, the worker's highest allocation so far (the load's
    peak: nothing larger is allocated before the model)."""
    state = take_load_memory()
    if state["layers"]:
        mib = 1 << 20
        device = next(model.parameters()).device
        device_peak = ""
        if device.type == "cuda":
            state["device_peak_bytes"] = torch.cuda.max_memory_allocated(device)
            device_peak = f"; the device's peak allocation so far: {state['device_peak_bytes'] / (1 << 30):.2f} GiB"
        logger.info(
            "fp8_align: while loading, the %d FP8 layers held at most %.1f MiB of BF16 weights at once (all of them: %.1f MiB)%s",
            state["layers"], state["peak_bytes"] / mib, state["total_bytes"] / mib, device_peak,
        )  # fmt: skip
        model.fp8_align_load_memory = state
    return state


def load_memory_state(model: torch.nn.Module) -> dict[str, int] | None:
    """The model's load record (run inside a worker by `LLM.apply_model`); None for a stock model."""
    return getattr(model, "fp8_align_load_memory", None)
