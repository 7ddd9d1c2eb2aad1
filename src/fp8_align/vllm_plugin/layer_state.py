"""What fp8_align keeps on each of its block-FP8 layers, and the one test for such a layer.

Every FP8 linear and FP8 routed-experts layer of an fp8_align engine carries one
`Fp8AlignLayerState` as its attribute `fp8_align` (`STATE_ATTR`), set when its quant method
creates it; besides its vLLM Parameters (`weight` / `weight_scale_inv`, `w13_weight` /
`w2_weight` and their `*_scale_inv`) nothing else of fp8_align's lives on the layer.
`is_fp8_align_layer` answers "does fp8_align run this module in block FP8" everywhere.

The state is a plain attribute, not a Parameter or buffer, on purpose: vLLM's layerwise reload
(`reload_weights`, the weight-transfer API, and the online processing behind
`FP8Config.quantize_during_load`) re-runs `process_weights_after_loading` on a rebuilt layer and
then puts the layer's old Parameters and buffers back, copying the new values into them (except
non-persistent buffers, which it restores without copying). Plain attributes keep what the
processing set, so the backend and the float32 copies of the codes (`widened`) stay the fresh ones,
equal to the codes copied back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from fp8_align.rounding import Rounding
from fp8_align.vllm_plugin.kernels.base import BlockFp8Kernel

#: The module attribute holding a layer's `Fp8AlignLayerState`.
STATE_ATTR = "fp8_align"

LayerKind = Literal["linear", "experts"]


@dataclass(eq=False)
class Fp8AlignLayerState:
    """fp8_align's state of one block-FP8 layer (see the module docstring)."""

    kind: LayerKind
    #: the module's name in the checkpoint, e.g. model.layers.1.self_attn.qkv_proj
    prefix: str
    #: the engine's scale rounding (`FP8Config.rounding`), set when the state is created: fp8_align's
    #: quantizations of the layer (load, re-quantizing loaders, refit, activations in its forward) read it here
    rounding: Rounding
    #: vLLM's extra weight attributes of the layer (given to every BF16 staging Parameter)
    weight_attrs: dict[str, Any] = field(default_factory=dict)
    #: linears: rows of each stacked shard (q|k|v, gate|up), each with its own 128x128 grid
    shard_sizes: list[int] = field(default_factory=list)
    #: linears: the GEMM backend, once the layer is quantized
    kernel: BlockFp8Kernel | None = None
    #: linears of an `on_policy="bitwise"` engine: the GEMM calls its backend makes, planned once by
    #: `prepare` outside the compiled forward ((codes rows, scale rows, GEMM name) per call)
    gemm_calls: tuple[tuple[slice, slice, str], ...] = ()
    #: experts: dtype of the BF16 weights the checkpoint loads into
    params_dtype: torch.dtype | None = None
    #: experts: intermediate size of this rank's partition
    intermediate_size: int = 0
    #: float32 copies of FP8 codes by Parameter name ("weight", "w13_weight", ...), kept by the
    #: CPU backends and refreshed in place when the codes are rewritten
    widened: dict[str, torch.Tensor] = field(default_factory=dict)


def is_fp8_align_layer(module: Any, kind: LayerKind | None = None) -> bool:
    """True when fp8_align runs `module` in block FP8 (a linear or routed-experts layer of its
    engine), and it is of `kind` when given."""
    state = getattr(module, STATE_ATTR, None)
    return isinstance(state, Fp8AlignLayerState) and (kind is None or state.kind == kind)


def fp8_align_layers(model: torch.nn.Module, kind: LayerKind | None = None) -> list[torch.nn.Module]:
    """The modules of `model` for which `is_fp8_align_layer(module, kind)`, in module order."""
    return [module for module in model.modules() if is_fp8_align_layer(module, kind)]
