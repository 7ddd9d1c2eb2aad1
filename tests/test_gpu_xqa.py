"""XQA FP8-KV decode (FlashInfer's `trtllm_batch_decode_with_kv_cache(backend="xqa")`, module
prebuilt by scripts/build_flashinfer_aot.sh) on one FP8 paged KV cache, against FA3's FP8 decode
(vLLM's `_vllm_fa3_C.fwd`, as its FLASH_ATTN backend calls it) and an FP32 reference.

Shapes: the Qwen3-8B decode layer (32 query heads, 8 KV heads, head dim 128), pages of 16 tokens
scattered over the cache, 16 sequences of 40 to 700 tokens. K/V are E4M3 codes with per-tensor
scales (vLLM's `k_scale`/`v_scale`); the query is BF16.

Tolerance: both kernels run Q and the softmax probabilities P through E4M3 (Q: XQA casts it inside,
FA3 is given it quantized as vLLM does; scale 1.0 for these N(0, 1) queries). The reference uses
the same E4M3 query and exact FP32 P. Rounding P to E4M3 changes each weight by a relative
delta <= 2^-4, so the normalized weights move by at most 2*delta/(1 - delta) in L1 and every
output element by at most that times max|V| (V dequantized), plus BF16 output rounding (2^-8
relative). A kernel reading a wrong page, head or scale is off by O(max|V|) and fails.
"""

from __future__ import annotations

import pytest
import torch

from fp8_align.versions import installed_vllm_version, vllm_series
from fp8_align.vllm_plugin.kv.xqa_decode import XQA_SERIES
from tests.gpu_decode_checks import ENGINE_KWARGS, XQA_ENGINE_MODEL, decode_diffs, logprob_rows

pytestmark = pytest.mark.gpu
_VLLM = installed_vllm_version()

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
K_SCALE, V_SCALE = 0.02, 0.015
DELTA = 2.0**-4
P_ROUNDING_BOUND = 2 * DELTA / (1 - DELTA)


def _paged_cache(seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [B, QH, D] bf16, k_cache, v_cache [num_pages, PAGE, KVH, D] e4m3, block_table [B, P] int32)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    pages_per_seq = -(-max(seq_lens) // PAGE)
    num_pages = len(seq_lens) * pages_per_seq + 3
    k_cache = (torch.randn(num_pages, PAGE, KV_HEADS, HEAD_DIM, device="cuda", generator=g) * 40).to(torch.float8_e4m3fn)
    v_cache = (torch.randn(num_pages, PAGE, KV_HEADS, HEAD_DIM, device="cuda", generator=g) * 40).to(torch.float8_e4m3fn)
    perm = torch.randperm(num_pages, device="cuda", generator=g)[: len(seq_lens) * pages_per_seq]
    block_table = perm.view(len(seq_lens), pages_per_seq).to(torch.int32)
    q = torch.randn(len(seq_lens), Q_HEADS, HEAD_DIM, device="cuda", generator=g).to(torch.bfloat16)
    return q, k_cache, v_cache, block_table


def _reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: list[int],
               k_scale: float, v_scale: float) -> torch.Tensor:  # fmt: skip
    """FP32 attention of the E4M3-rounded query over the dequantized pages, exact softmax. [B, QH, D]."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    group = Q_HEADS // KV_HEADS
    for b, length in enumerate(seq_lens):
        pages = block_table[b, : -(-length // PAGE)].long()
        k = k_cache[pages].reshape(-1, KV_HEADS, HEAD_DIM)[:length].float() * k_scale  # [L, KVH, D]
        v = v_cache[pages].reshape(-1, KV_HEADS, HEAD_DIM)[:length].float() * v_scale
        qf = q[b].to(torch.float8_e4m3fn).float().view(KV_HEADS, group, HEAD_DIM)
        scores = torch.einsum("hgd,lhd->hgl", qf, k) * HEAD_DIM**-0.5
        out[b] = torch.einsum("hgl,lhd->hgd", scores.softmax(dim=-1), v).reshape(Q_HEADS, HEAD_DIM)
    return out


def _xqa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: list[int],
         k_scale: float, v_scale: float) -> torch.Tensor:  # fmt: skip
    from flashinfer.decode import trtllm_batch_decode_with_kv_cache

    workspace = torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda")
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return trtllm_batch_decode_with_kv_cache(
        q, (k_cache, v_cache), workspace, block_table, lens, max(seq_lens),
        bmm1_scale=k_scale * HEAD_DIM**-0.5, bmm2_scale=v_scale, kv_layout="NHD", backend="xqa",
    )  # fmt: skip


def _fa3(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: list[int],
         k_scale: float, v_scale: float) -> torch.Tensor:  # fmt: skip
    import vllm.vllm_flash_attn  # noqa: F401  (registers torch.ops._vllm_fa3_C)

    batch = q.shape[0]
    out = torch.empty_like(q)
    descale = torch.ones(1, dtype=torch.float32, device="cuda").expand(batch, KV_HEADS)
    torch.ops._vllm_fa3_C.fwd(
        q.to(torch.float8_e4m3fn), k_cache, v_cache, None, None, None, out,
        torch.arange(batch + 1, dtype=torch.int32, device="cuda"), None, None, None,
        torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), 1, max(seq_lens), block_table, None, None, None, None, None,
        descale, descale * k_scale, descale * v_scale, HEAD_DIM**-0.5, True, -1, -1, 0.0, True, None, 0, None, 0, None, 1, 0, None,
    )  # fmt: skip
    return out


SEQ_LENS = [40, 700, 333, 129, 512, 64, 255, 601, 17 + 128, 300, 450, 96, 640, 200, 385, 77]


@pytest.fixture(scope="module")
def cache() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _paged_cache(SEQ_LENS)


def _bound(reference: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    max_v = v_cache.float().abs().max() * V_SCALE
    return P_ROUNDING_BOUND * max_v + 2.0**-8 * reference.abs()


def test_xqa_fp8_kv_decode_matches_the_reference_within_the_p_rounding_bound(cache) -> None:
    q, k_cache, v_cache, block_table = cache
    got = _xqa(q, k_cache, v_cache, block_table, SEQ_LENS, K_SCALE, V_SCALE).float()
    reference = _reference(q, k_cache, v_cache, block_table, SEQ_LENS, K_SCALE, V_SCALE)
    error = (got - reference).abs()
    print(f"xqa vs reference: max {error.max():.4g}, mean {error.mean():.4g}, max|ref| {reference.abs().max():.4g}, "
          f"relative Frobenius {(got - reference).norm() / reference.norm():.4g}")  # fmt: skip
    assert bool((error <= _bound(reference, v_cache)).all())


def test_xqa_and_fa3_agree_on_the_same_fp8_cache(cache) -> None:
    q, k_cache, v_cache, block_table = cache
    xqa = _xqa(q, k_cache, v_cache, block_table, SEQ_LENS, K_SCALE, V_SCALE).float()
    fa3 = _fa3(q, k_cache, v_cache, block_table, SEQ_LENS, K_SCALE, V_SCALE).float()
    reference = _reference(q, k_cache, v_cache, block_table, SEQ_LENS, K_SCALE, V_SCALE)
    fa3_error = (fa3 - reference).abs()
    print(f"fa3 vs reference: max {fa3_error.max():.4g}, mean {fa3_error.mean():.4g}; xqa vs fa3: max {(xqa - fa3).abs().max():.4g}, "
          f"mean {(xqa - fa3).abs().mean():.4g}")  # fmt: skip
    assert bool((fa3_error <= _bound(reference, v_cache)).all())
    assert bool(((xqa - fa3).abs() <= 2 * _bound(reference, v_cache)).all())


def test_the_kv_scales_reach_xqa(cache) -> None:
    q, k_cache, v_cache, block_table = cache
    base = _xqa(q, k_cache, v_cache, block_table, SEQ_LENS, K_SCALE, V_SCALE).float()
    doubled_v = _xqa(q, k_cache, v_cache, block_table, SEQ_LENS, K_SCALE, 2 * V_SCALE).float()
    torch.testing.assert_close(doubled_v, 2 * base, rtol=2.0**-7, atol=0.0)  # output is linear in v_scale
    other_k = _xqa(q, k_cache, v_cache, block_table, SEQ_LENS, 2 * K_SCALE, V_SCALE).float()
    reference = _reference(q, k_cache, v_cache, block_table, SEQ_LENS, 2 * K_SCALE, V_SCALE)
    assert not torch.allclose(other_k, base, atol=1e-3)
    assert bool(((other_k - reference).abs() <= _bound(reference, v_cache)).all())


# --------------------------------------------------------------------------- a whole engine
@pytest.mark.slow
@pytest.mark.skipif(_VLLM is None or vllm_series(_VLLM) not in XQA_SERIES,
                    reason=f"fp8_align's XQA route is vLLM 0.22's (installed: {_VLLM}); 0.25+ decodes with XQA itself on FLASHINFER")  # fmt: skip
def test_engine_decode_runs_on_xqa_agrees_with_fa3_and_reads_pushed_scales(tmp_path, vllm_runner) -> None:
    """vLLM 0.22 engine with FP8Config(kv_cache_dtype="fp8", kv_decode_kernel="xqa") (CUDA graphs on),
    against FA3 engines (kv_decode_kernel="backend") on the same model and prompts, greedy:
    - decode runs XQA (the route counts its Python calls: CUDA-graph captures included), prefill
      stays on FA3: the first generated token's log-prob (from prefill) equals FA3's bit for bit;
    - decode log-probs differ from FA3's by less than FA3's FP8 cache differs from a BF16 cache:
      XQA adds less error than the FP8 KV cache itself (both kernels read the same E4M3 codes and
      differ only in where P is rounded to E4M3 and in accumulation order; session 10 measured
      XQA vs FA3 mean |dlogp| 0.042, max 0.125 over 70 decode tokens of this random model);
    - K/V scales pushed after capture (v_scale 4: V is cached as V/4) are the ones the captured XQA
      calls read: decode again agrees with an FA3 engine given the same scales, within the same
      bound. A scale frozen at capture (1.0) would scale every attention output by 1/4."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from fp8_align import FP8Config
    from fp8_align.error_bench.generate import run_generation
    from fp8_align.vllm_plugin.kv import xqa_decode
    from fp8_align.vllm_plugin.kv.scales import push_kv_scales
    from tests.gpu_models import save_random_qwen3

    model = save_random_qwen3(tmp_path / "qwen3_xqa", XQA_ENGINE_MODEL, seed=0)
    prompts = torch.randint(0, XQA_ENGINE_MODEL["vocab_size"], (8, 24), generator=torch.Generator().manual_seed(3)).tolist()
    pushed = {i: {"k_scale": 1.0, "v_scale": 4.0} for i in range(XQA_ENGINE_MODEL["num_hidden_layers"])}

    def reference(fp8_config: dict, scales: dict | None, name: str) -> list[dict]:
        spec = {"model": str(model), "fp8_config": fp8_config, "prompts": prompts, "max_tokens": 24,
                "temperature": 0.0, "logprobs": 0, "llm_kwargs": ENGINE_KWARGS, "kv_scales": scales}  # fmt: skip
        return run_generation(spec, tmp_path / f"{name}.pt", timeout_s=600)["outputs"]

    bf16_kv = reference({}, None, "bf16_kv")
    fa3_config = {"kv_cache_dtype": "fp8", "kv_decode_kernel": "backend"}  # "auto", the default, would decode with XQA
    fa3_default = reference(fa3_config, None, "fa3")
    fa3_pushed = reference(fa3_config, pushed, "fa3_pushed")
    fp8_kv_effect = decode_diffs([r["token_ids"] for r in fa3_default], [r["logprobs"] for r in fa3_default], bf16_kv)

    in_process = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the worker runs here: read its counter
    with vllm_runner(model, FP8Config(kv_cache_dtype="fp8", kv_decode_kernel="xqa"), env=in_process, **ENGINE_KWARGS) as runner:
        llm = runner.llm
        assert xqa_decode.decode_calls > 0, "no decode step went to XQA (warm-up and CUDA-graph capture run decode batches)"
        params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=0, ignore_eos=True)
        token_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        first = logprob_rows(llm.generate(token_prompts, params, use_tqdm=False))
        push_kv_scales(llm, pushed)
        second = logprob_rows(llm.generate(token_prompts, params, use_tqdm=False))

    print(f"FP8 vs BF16 KV cache (FA3): decode |dlogp| over {len(fp8_kv_effect)} tokens: mean {fp8_kv_effect.mean():.3e}")
    for label, (tokens, logprobs), fa3 in (("default scales", first, fa3_default), ("pushed scales", second, fa3_pushed)):
        for row, lps in enumerate(logprobs):
            assert tokens[row][0] == fa3[row]["token_ids"][0]
            assert lps[0] == fa3[row]["logprobs"][0], f"{label}: prefill (FA3 in both engines) must be unchanged"
        d = decode_diffs(tokens, logprobs, fa3)
        print(f"{label}: XQA vs FA3 decode |dlogp| over {len(d)} tokens: mean {d.mean():.3e}, max {d.max():.3e}")
        assert len(d) >= 8 * 4
        assert d.mean() < fp8_kv_effect.mean(), f"{label}: XQA moves decode more than the FP8 cache itself"
