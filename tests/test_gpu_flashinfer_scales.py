"""vLLM 0.25's FLASHINFER attention (XQA decode of an FP8 cache on Hopper, CUDA graphs on) reads
the K/V scales fp8_align pushes after the engine started (`kv.flashinfer_scales`): decode agrees
with an FA3 engine given the same scales.

Bound: as tests/test_gpu_xqa.py's engine test, both decodes read the same E4M3 cache and differ in
where P is rounded and in accumulation order (and here in the prefill kernel too), so their decode
log-probs must differ on average by less than the FP8 cache itself moves FA3's decode from a BF16
cache. A scale frozen at the first forward (vLLM's float path: v_scale 1 while V is cached as V/4)
scales every attention output by 1/4, far outside that bound.
"""

from __future__ import annotations

import pytest
import torch

from fp8_align.versions import installed_vllm_version, vllm_series
from fp8_align.vllm_plugin.kv.flashinfer_scales import LIVE_SCALES_SERIES
from tests.gpu_decode_checks import ENGINE_KWARGS, XQA_ENGINE_MODEL, decode_diffs, logprob_rows

_VLLM = installed_vllm_version()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_VLLM is None or vllm_series(_VLLM) not in LIVE_SCALES_SERIES,
                       reason=f"live FLASHINFER K/V scales are fp8_align's for vLLM 0.25 (installed: {_VLLM})"),  # fmt: skip
]


def _live_scales(worker) -> list[tuple[bool, bool, float]]:
    """Per attention layer of the worker's model: scales live, bmm2_scale is the `_v_scale` buffer, its value."""
    from fp8_align.vllm_plugin.kv.flashinfer_scales import reads_scales_live
    from fp8_align.vllm_plugin.kv.scales import attention_layers

    return [(reads_scales_live(attn), attn.impl.bmm2_scale is attn._v_scale, float(attn._v_scale))
            for _, attn in sorted(attention_layers(worker.get_model()).items())]  # fmt: skip


def test_flashinfer_decode_reads_the_pushed_kv_scales(tmp_path, vllm_runner) -> None:
    """fp8_align engine, FP8 cache, attention_backend FLASHINFER: every attention layer's scales are
    live (bmm2_scale is the layer's `_v_scale` buffer); greedy decode with the default scales and
    after pushing k 1 / v 4 agrees with FA3 engines given the same scales, within the bound above."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from fp8_align import FP8Config
    from fp8_align.error_bench.generate import run_generation
    from fp8_align.vllm_plugin.kv.scales import push_kv_scales
    from tests.gpu_models import save_random_qwen3

    model = save_random_qwen3(tmp_path / "qwen3_fi", XQA_ENGINE_MODEL, seed=0)
    # 32 prompts: two engines' greedy paths part at near-ties of the random model's logits, so
    # many rows are needed for >= 32 decode tokens where both took the same path
    prompts = torch.randint(0, XQA_ENGINE_MODEL["vocab_size"], (32, 24), generator=torch.Generator().manual_seed(3)).tolist()
    pushed = {i: {"k_scale": 1.0, "v_scale": 4.0} for i in range(XQA_ENGINE_MODEL["num_hidden_layers"])}
    fa3_config = {"kv_cache_dtype": "fp8", "kv_decode_kernel": "backend"}

    def reference(fp8_config: dict, scales: dict | None, name: str) -> list[dict]:
        spec = {"model": str(model), "fp8_config": fp8_config, "prompts": prompts, "max_tokens": 24,
                "temperature": 0.0, "logprobs": 0, "llm_kwargs": {**ENGINE_KWARGS, "attention_backend": "FLASH_ATTN"},
                "kv_scales": scales}  # fmt: skip
        return run_generation(spec, tmp_path / f"{name}.pt", timeout_s=600)["outputs"]

    bf16_kv = reference({}, None, "bf16_kv")
    fa3_default, fa3_pushed = reference(fa3_config, None, "fa3"), reference(fa3_config, pushed, "fa3_pushed")
    fp8_kv_effect = decode_diffs([r["token_ids"] for r in fa3_default], [r["logprobs"] for r in fa3_default], bf16_kv)

    with vllm_runner(model, FP8Config(**fa3_config), attention_backend="FLASHINFER", **ENGINE_KWARGS) as runner:
        llm = runner.llm
        [state] = llm.collective_rpc(_live_scales)
        assert state == [(True, True, 1.0)] * XQA_ENGINE_MODEL["num_hidden_layers"]
        params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=0, ignore_eos=True)
        token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        first = logprob_rows(llm.generate(token_prompts, params, use_tqdm=False))
        push_kv_scales(llm, pushed)
        assert llm.collective_rpc(_live_scales) == [[(True, True, 4.0)] * XQA_ENGINE_MODEL["num_hidden_layers"]]
        second = logprob_rows(llm.generate(token_prompts, params, use_tqdm=False))

    print(f"FP8 vs BF16 KV cache (FA3): decode |dlogp| over {len(fp8_kv_effect)} tokens: mean {fp8_kv_effect.mean():.3e}")
    for label, (tokens, logprobs), fa3 in (("default scales", first, fa3_default), ("pushed scales", second, fa3_pushed)):
        d = decode_diffs(tokens, logprobs, fa3)
        print(f"{label}: FLASHINFER vs FA3 decode |dlogp| over {len(d)} tokens: mean {d.mean():.3e}, max {d.max():.3e}")
        assert len(d) >= 32, f"{label}: only {len(d)} decode tokens where both engines took the same path"
        assert d.mean() < fp8_kv_effect.mean(), f"{label}: FLASHINFER's decode moves more than the FP8 cache itself"


def _backends_and_choice(worker) -> tuple[list[str], str | None, list[bool]]:
    """The worker's attention backends, the backend fp8_align chose for it, and whether each
    attention layer reads its scales live."""
    from fp8_align.vllm_plugin.compat import attention_backend_name
    from fp8_align.vllm_plugin.kv.flashinfer_scales import reads_scales_live
    from fp8_align.vllm_plugin.kv.scales import attention_layers

    layers = [attn for _, attn in sorted(attention_layers(worker.get_model()).items())]
    chosen = worker.vllm_config.quant_config.attention_backend_chosen
    return sorted({str(attention_backend_name(attn)) for attn in layers}), chosen, [reads_scales_live(attn) for attn in layers]


def test_fp8_kv_engine_without_a_backend_gets_flashinfer(tmp_path, vllm_runner) -> None:
    """`quantization="fp8_align"` with an FP8 cache and attention_backend unset on vLLM 0.25 / SM90
    (VLLM_HAS_FLASHINFER_CUBIN=1: XQA compiles from source, as on an offline box): fp8_align picks
    FLASHINFER before the first attention layer is built, so every layer is FLASHINFER with live
    scales, and it generates; asking for FLASH_ATTN keeps FA3."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from fp8_align import FP8Config
    from tests.gpu_models import save_random_qwen3

    model = save_random_qwen3(tmp_path / "qwen3_default", XQA_ENGINE_MODEL, seed=0)
    layers = XQA_ENGINE_MODEL["num_hidden_layers"]
    env = {"VLLM_HAS_FLASHINFER_CUBIN": "1"}
    with vllm_runner(model, FP8Config(kv_cache_dtype="fp8"), env=env, **ENGINE_KWARGS) as runner:
        assert runner.llm.collective_rpc(_backends_and_choice) == [(["FLASHINFER"], "FLASHINFER", [True] * layers)]
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        outputs = runner.llm.generate([TokensPrompt(prompt_token_ids=list(range(1, 17)))] * 4, params, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outputs] == [16] * 4  # the engine the choice built decodes
    with vllm_runner(model, FP8Config(kv_cache_dtype="fp8"), env=env, attention_backend="FLASH_ATTN", **ENGINE_KWARGS) as runner:
        assert runner.llm.collective_rpc(_backends_and_choice) == [(["FLASH_ATTN"], None, [False] * layers)]
