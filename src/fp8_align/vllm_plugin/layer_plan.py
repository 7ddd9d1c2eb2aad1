"""Per-engine record of which layers run in FP8 and why: one summary line, and strict mode.

`Fp8AlignQuantConfig.get_quant_method` decides each layer with `fp8_align.layer_selection` and
records the decision on the module (`record_decision`); once the model is loaded,
`log_layer_plan(model)` logs one line with the FP8 and BF16 counts by reason.
`FP8Config(strict=True)` makes any BF16 decision the recipe did not plan (outside the decoder
layers, a shape or an expert kind fp8_align cannot run in FP8) an error at engine start.
"""

from __future__ import annotations

import logging

import torch

from fp8_align.config import FP8Config, FP8ConfigError
from fp8_align.layer_selection import LayerDecision, summarize_decisions

logger = logging.getLogger("vllm.fp8_align")

_DECISION = "fp8_align_decision"


class StrictModeError(FP8ConfigError):
    """strict=True and a layer the recipe would run in FP8 has to stay BF16."""


def record_decision(layer: torch.nn.Module, decision: LayerDecision, cfg: FP8Config) -> None:
    """Keep `decision` on `layer`; log BF16 ones; raise StrictModeError for an unplanned BF16
    decision when `cfg.strict`."""
    layer.__dict__[_DECISION] = decision
    if decision.fp8:
        return
    if cfg.strict and not decision.planned:
        raise StrictModeError(
            f"fp8_align strict mode: {decision.describe()} would stay BF16. Keep it BF16 knowingly with "
            "strict=False, or change the model/engine settings so it can run in FP8."
        )
    log = logger.info if decision.planned else logger.warning
    detail = f": {decision.detail}" if decision.detail else ""
    log("fp8_align: %s stays BF16 (%s: %s%s)", decision.prefix, decision.kind, decision.reason, detail)


def recorded_decision(module: torch.nn.Module) -> LayerDecision | None:
    """The decision `record_decision` kept on `module`, or None (a module fp8_align did not decide)."""
    return module.__dict__.get(_DECISION)


def layer_decisions(model: torch.nn.Module) -> list[LayerDecision]:
    """The decisions recorded on `model`'s modules, in module order."""
    return [decision for decision in map(recorded_decision, model.modules()) if decision is not None]


def log_layer_plan(model: torch.nn.Module) -> str:
    """Log (and return) the one-line summary of `model`'s decisions."""
    line = summarize_decisions(layer_decisions(model))
    logger.info("fp8_align: %s: %s", type(model).__name__, line)
    return line
