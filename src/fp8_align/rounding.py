"""How an engine rounds its FP8 scales: one immutable value, built once from the config.

`Rounding` holds the three choices every quantization of a run shares: power-of-two weight
scales, power-of-two activation scales, and the scale rule (`SCALE_RULES`, computed by
`fp8_align.quant.scales`). `FP8Config.rounding` builds it; the vLLM plugin keeps it in each
layer's state. The quantizers of `fp8_align.quant` stay plain functions over tensors and take the
flags and the rule as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

#: The names of the scale rules (see `fp8_align.quant.scales`).
ScaleRule = Literal["amax_over_max", "transformer_engine"]
#: The scale rule used unless one is chosen.
DEFAULT_SCALE_RULE: ScaleRule = "amax_over_max"
#: Every scale rule, in `ScaleRule` order.
SCALE_RULES: tuple[ScaleRule, ...] = get_args(ScaleRule)


def check_scale_rule(scale_rule: str) -> ScaleRule:
    """Return `scale_rule` when it is one of `SCALE_RULES`, else raise ValueError."""
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    return scale_rule  # type: ignore[return-value]


@dataclass(frozen=True)
class Rounding:
    """The scale rounding of every block-FP8 quantization of one run (frozen, hashable).

    weight_pow2 / activation_pow2: round weight / activation scales to powers of two (how each
    rule rounds: `fp8_align.quant.scales`). scale_rule: one of `SCALE_RULES` (ValueError otherwise).
    """

    weight_pow2: bool = False
    activation_pow2: bool = False
    scale_rule: ScaleRule = DEFAULT_SCALE_RULE

    def __post_init__(self) -> None:
        check_scale_rule(self.scale_rule)
