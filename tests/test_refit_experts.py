"""Expert tensors in a weight update (`vllm_plugin.refit.experts`), without an engine: transformers-5
fused expert tensors become the checkpoint's per-expert views; a wrong fused shape is refused
naming the fused tensor."""

from __future__ import annotations

import pytest
import torch

from fp8_align.vllm_plugin.refit.experts import unfuse_expert_tensors
from fp8_align.vllm_plugin.checkpoint import RefitError, TensorSpec

PREFIX = "model.layers.1.mlp.experts"
#: 3 experts, intermediate 4, hidden 8, as a checkpoint stores them (per expert).
LAYOUT = {
    f"{PREFIX}.{e}.{kind}.weight": TensorSpec((8, 4) if kind == "down_proj" else (4, 8), torch.bfloat16)
    for e in range(3)
    for kind in ("gate_proj", "up_proj", "down_proj")
}


def test_fused_tensors_become_per_expert_views():
    gate_up = torch.randn(3, 8, 8)
    down = torch.randn(3, 8, 4)
    other = ("model.layers.1.self_attn.o_proj.weight", torch.randn(8, 8))
    out = dict(unfuse_expert_tensors([(f"{PREFIX}.gate_up_proj", gate_up), (f"{PREFIX}.down_proj", down), other], LAYOUT))
    assert set(out) == set(LAYOUT) | {other[0]}
    for e in range(3):
        assert torch.equal(out[f"{PREFIX}.{e}.gate_proj.weight"], gate_up[e, :4])  # gate rows first (transformers 5)
        assert torch.equal(out[f"{PREFIX}.{e}.up_proj.weight"], gate_up[e, 4:])
        assert torch.equal(out[f"{PREFIX}.{e}.down_proj.weight"], down[e])
        assert out[f"{PREFIX}.{e}.up_proj.weight"].data_ptr() == gate_up[e, 4:].data_ptr()  # views, no copy


@pytest.mark.parametrize(
    ("name", "shape", "message"),
    [
        (f"{PREFIX}.gate_up_proj", (3, 4, 8), r"shape \(3, 4, 8\), the checkpoint's 3 experts stack to \(3, 8, 8\)"),
        (f"{PREFIX}.down_proj", (2, 8, 4), r"shape \(2, 8, 4\), the checkpoint's 3 experts stack to \(3, 8, 4\)"),
        ("model.layers.7.mlp.experts.down_proj", (3, 8, 4), r"not a tensor of the engine's checkpoint"),
    ],
)
def test_wrong_fused_tensors_are_refused_naming_them(name, shape, message):
    with pytest.raises(RefitError, match=name.replace(".", r"\.") + ": " + message):
        unfuse_expert_tensors([(name, torch.zeros(shape))], LAYOUT)


def test_names_the_checkpoint_has_pass_unchanged():
    fused_layout = {f"{PREFIX}.gate_up_proj": TensorSpec((3, 8, 8), torch.bfloat16)}
    tensor = torch.zeros(3, 8, 8)
    assert unfuse_expert_tensors([(f"{PREFIX}.gate_up_proj", tensor)], fused_layout) == [(f"{PREFIX}.gate_up_proj", tensor)]
