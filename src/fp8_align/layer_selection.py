"""Which linear layers the recipe quantizes: one rule for the generation and training sides."""

from __future__ import annotations

import re
from dataclasses import dataclass

from fp8_align.config import FP8Config

#: Projection names (HF and vLLM merged) that run in FP8; everything else stays BF16.
FP8_PROJECTIONS = frozenset(
    {"q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj", "down_proj"}
)
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(frozen=True)
class LinearDecision:
    """Whether the linear at `prefix` runs in FP8, with the reason (for logs and reports)."""

    prefix: str
    fp8: bool
    reason: str
    layer_index: int | None


def decoder_layer_index(prefix: str) -> int | None:
    """Decoder layer index in a module name such as 'model.layers.3.mlp.down_proj', or None."""
    match = _LAYER_INDEX.search(prefix)
    return int(match.group(1)) if match else None


def decide_linear(prefix: str, num_hidden_layers: int, cfg: FP8Config) -> LinearDecision:
    """Decide FP8 vs BF16 for the linear module named `prefix` in a model of that depth."""
    index = decoder_layer_index(prefix)
    name = prefix.rsplit(".", 1)[-1]
    if cfg.precision != "fp8":
        return LinearDecision(prefix, False, "precision is bf16", index)
    if index is None or name not in FP8_PROJECTIONS:
        return LinearDecision(prefix, False, "not a decoder attention/MLP projection", index)
    if index in cfg.bf16_layer_indices(num_hidden_layers):
        return LinearDecision(prefix, False, f"decoder layer {index} is kept in BF16 by the config", index)
    return LinearDecision(prefix, True, "block FP8", index)
