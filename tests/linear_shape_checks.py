"""What the CPU engine tests of each model family share: the checks that `decoder_linear_shapes`
and `expert_shapes` (the shapes `fp8-align prepare-deepgemm --model` compiles) describe the
engine's FP8 linears and routed experts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fp8_align.vllm_plugin.kernels.deepgemm.inventory import decoder_linear_shapes, expert_shapes


def assert_linear_shapes_described(layers: dict[str, dict[str, Any]], checkpoint: Path) -> None:
    """The [N, K] of the fp8_align linears in `layers` (`read_linear_layers` of one worker) are
    exactly the ones `decoder_linear_shapes` computes from `checkpoint`'s config.json (one entry
    per [N, K]: DeepGEMM's warm-up is per [N, K], whatever the shards)."""
    engine = {tuple(entry["weight"].shape) for entry in layers.values() if entry["method"] == "Fp8AlignLinearMethod"}
    config = json.loads((checkpoint / "config.json").read_text())
    described = {(s.n, s.k) for s in decoder_linear_shapes(config)}
    assert engine == described, {"engine only": sorted(engine - described), "described only": sorted(described - engine)}


def assert_expert_shapes_described(experts: dict[str, dict[str, Any]], checkpoint: Path) -> None:
    """The [E, N, K] of every routed-experts layer's w13 and w2 in `experts` (`read_expert_layers`
    of one worker) are the ones `expert_shapes` computes from `checkpoint`'s config.json."""
    engine = {(name, *entry[name].shape) for entry in experts.values() for name in ("w13", "w2")}
    config = json.loads((checkpoint / "config.json").read_text())
    assert engine == {(e.name, e.experts, e.n, e.k) for e in expert_shapes(config)}, sorted(engine)
