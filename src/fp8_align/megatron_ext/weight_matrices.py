"""The 2-D weight matrices of a state dict that the block-FP8 recipe quantizes, by HF or Megatron name.

Dense linears are their 2-D tensors. Routed experts come in several layouts, each split into one
[N, K] matrix per expert and projection, since generation quantizes gate, up and down each on
its own 128x128 grid (`fp8_align.quant.moe`):

- HF per-expert tensors: `...experts.<e>.{gate,up,down}_proj.weight` (Qwen-MoE, DeepSeek on disk),
  `...block_sparse_moe.experts.<e>.{w1,w2,w3}.weight` (Mixtral on disk);
- transformers-5 fused tensors: `...experts.gate_up_proj` [E, 2I, H] (gate rows [0, I), then up
  rows) and `...experts.down_proj` [E, H, I];
- Megatron `TEGroupedMLP`: `...experts.linear_fc{1,2}.weight<e>`; `SequentialMLP`:
  `...experts.local_experts.<e>.linear_fc{1,2}.weight`. With a gated linear unit, linear_fc1
  [2I, H] holds the gate rows, then the up rows, of one expert (per expert-TP shard).

Stacked gate/up halves are split on both sides. TransformerEngine quantizes the stacked shard as
one tensor; its grid is the halves' grids exactly when the per-partition size is a multiple of
128, which `fp8_align.megatron_ext.moe.check_moe_alignment` requires for FP8 training.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import torch

from fp8_align.layer_selection import decoder_layer_index

_FUSED_EXPERTS = re.compile(r"^(?P<module>.*\.experts)\.(?P<projection>gate_up_proj|down_proj)$")
_GROUPED_EXPERT = re.compile(r"^(?P<module>.*\.experts)\.(?P<projection>linear_fc[12])\.weight(?P<expert>\d+)$")
_PER_EXPERT = re.compile(
    r"^(?P<module>.*\.experts)\.(?:local_experts\.)?(?P<expert>\d+)\.(?P<projection>[^.]+)\.weight$"
)


@dataclasses.dataclass(frozen=True)
class WeightMatrix:
    """One matrix to quantize: `weight` [N, K] (a view of the state-dict tensor), reported as
    `name`, in decoder layer `layer_index`; `module` and `kind` ("linear" or "experts") are what
    `layer_selection.decide_layer` decides on; `expert` is the routed-expert index in the name
    (local under expert parallelism)."""

    name: str
    weight: torch.Tensor
    module: str
    kind: str
    layer_index: int
    expert: int | None = None


def decoder_matrices(
    weights: Mapping[str, torch.Tensor], gated_linear_unit: bool
) -> tuple[list[WeightMatrix], list[str]]:
    """(matrices of the tensors inside `layers.<i>.`, in name order; names of everything else:
    tensors outside decoder layers and those neither 2-D nor a fused expert tensor).

    gated_linear_unit: Megatron expert linear_fc1 tensors hold gate and up halves (megatron-core's
    `gated_linear_unit`, True for SwiGLU experts); HF names say so themselves.
    """
    matrices: list[WeightMatrix] = []
    skipped: list[str] = []
    for name in sorted(weights):
        tensor, index = weights[name], decoder_layer_index(name)
        if index is None:
            skipped.append(name)
        elif (experts := _expert_matrices(name, tensor, index, gated_linear_unit)) is not None:
            matrices += experts
        elif tensor.dim() == 2:
            matrices.append(WeightMatrix(name, tensor, name.removesuffix(".weight"), "linear", index))
        else:
            skipped.append(name)
    return matrices, skipped


def num_experts_in(matrices: list[WeightMatrix]) -> int | None:
    """1 + the largest expert index among `matrices`; None when none is a routed expert."""
    indices = [matrix.expert for matrix in matrices if matrix.expert is not None]
    return 1 + max(indices) if indices else None


def _expert_matrices(
    name: str, tensor: torch.Tensor, layer_index: int, gated_linear_unit: bool
) -> list[WeightMatrix] | None:
    """The per-expert matrices of a routed-expert tensor in layer `layer_index`, or None when
    `name` is not one."""
    fused = _FUSED_EXPERTS.match(name)
    if fused is not None and tensor.dim() == 3:
        stacked = fused["projection"] == "gate_up_proj"
        return [
            matrix
            for expert in range(tensor.shape[0])
            for matrix in _expert_rows(
                WeightMatrix(f"{name}[{expert}]", tensor[expert], fused["module"], "experts", layer_index, expert),
                stacked,
            )
        ]
    match = _GROUPED_EXPERT.match(name) or _PER_EXPERT.match(name)
    if match is None or tensor.dim() != 2:
        return None
    stacked = gated_linear_unit and match["projection"] == "linear_fc1"
    expert = WeightMatrix(name, tensor, match["module"], "experts", layer_index, int(match["expert"]))
    return _expert_rows(expert, stacked)


def _expert_rows(expert: WeightMatrix, stacked: bool) -> list[WeightMatrix]:
    """One expert's [N, K] matrix, or its gate and up halves ([N/2, K] each) when `stacked`."""
    if not stacked:
        return [expert]
    rows = expert.weight.shape[0]
    if rows % 2:
        raise ValueError(f"{expert.name}: {rows} rows cannot hold equal gate and up halves")
    half = rows // 2
    return [
        dataclasses.replace(expert, name=f"{expert.name}[gate]", weight=expert.weight[:half]),
        dataclasses.replace(expert, name=f"{expert.name}[up]", weight=expert.weight[half:]),
    ]
