"""What the CPU engine tests of each model family share: the check that `decoder_linear_shapes`
(the shapes `fp8-align prepare-deepgemm --model` compiles) describes the engine's FP8 linears."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fp8_align.vllm_plugin.kernels.deepgemm_inventory import decoder_linear_shapes


def assert_linear_shapes_described(layers: dict[str, dict[str, Any]], checkpoint: Path) -> None:
    """The [N, K] of the fp8_align linears in `layers` (`read_linear_layers` of one worker) are
    exactly the ones `decoder_linear_shapes` computes from `checkpoint`'s config.json (one entry
    per [N, K]: DeepGEMM's warm-up is per [N, K], whatever the shards)."""
    engine = {tuple(entry["weight"].shape) for entry in layers.values() if entry["method"] == "Fp8AlignLinearMethod"}
    config = json.loads((checkpoint / "config.json").read_text())
    described = {(s.n, s.k) for s in decoder_linear_shapes(config)}
    assert engine == described, {"engine only": sorted(engine - described), "described only": sorted(described - engine)}
