"""What the MLA engine tests (tests/test_mla_engine.py on CPU, tests/test_gpu_mla.py on CUDA)
share: the check that an engine's MLA projections hold the recipe of their checkpoint tensors."""

from __future__ import annotations

from typing import Any

import torch

from fp8_align.quant import quantize_weight_blockwise

MLA_PROJECTIONS = ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")


def assert_mla_projections_hold(layers: dict[str, dict[str, Any]], weights: dict[str, torch.Tensor], num_layers: int) -> None:
    """Each MLA projection of layers 0..num_layers-1 in `layers` (`read_linear_layers` of one
    worker) is an fp8_align FP8 linear whose codes and scales equal `quantize_weight_blockwise` of
    its checkpoint tensor in `weights`, bit for bit."""
    for layer in range(num_layers):
        for projection in MLA_PROJECTIONS:
            entry = layers[f"model.layers.{layer}.self_attn.{projection}"]
            assert entry["method"] == "Fp8AlignLinearMethod", (layer, projection)
            codes, scales = quantize_weight_blockwise(weights[f"model.layers.{layer}.self_attn.{projection}.weight"])
            assert torch.equal(entry["weight"].view(torch.uint8), codes.view(torch.uint8)), (layer, projection)
            assert torch.equal(entry["weight_scale_inv"].view(torch.int32), scales.view(torch.int32)), (layer, projection)
