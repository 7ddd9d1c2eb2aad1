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

_FUSED_NAME = re.compile(r"^(?P<experts>.+\.experts)\.(?P<kind>gate_up_proj|down_proj)$")


def unfuse_expert_tensors(
    batch: list[tuple[str, torch.Tensor]], layout: Mapping[str, object]
) -> list[tuple[str, torch.Tensor]]:
    """`batch` with every fused expert tensor that the checkpoint `layout` stores per expert
    replaced by its per-expert views, in expert order; other entries unchanged. A fused name the
    checkpoint itself has (a fused-layout checkpoint) is left as it is."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in batch:
        match = _FUSED_NAME.match(name)
        if match is None or name in layout or not isinstance(tensor, torch.Tensor) or tensor.dim() != 3:
            out.append((name, tensor))
            continue
        experts = match["experts"]
        if match["kind"] == "down_proj":
            out.extend((f"{experts}.{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0]))
            continue
        half = tensor.shape[1] // 2
        for e in range(tensor.shape[0]):
            out.append((f"{experts}.{e}.gate_proj.weight", tensor[e, :half]))
            out.append((f"{experts}.{e}.up_proj.weight", tensor[e, half:]))
    return out


def expert_prefixes(model: torch.nn.Module) -> tuple[str, ...]:
    """Checkpoint-name prefixes ('model.layers.1.mlp.experts.') of `model`'s fp8_align FP8
    expert layers: a tensor whose name starts with one is written by those layers' loaders."""
    from fp8_align.vllm_plugin.moe.experts import expert_layers

    return tuple(f"{layer.fp8_align_prefix}." for layer in expert_layers(model))
