"""GPU backends of the vLLM plugin against the torch reference (CUDA + vLLM 0.22 only).

Activation quantization must be bit-identical to `fp8_align.quant.quantize_activation_groupwise`
(codes and scales). The block GEMMs get bit-identical operands, so they may differ from
`fp8_align.quant.fp8_block_gemm` only by accumulation rounding and the final output rounding;
`_error_bound` derives the per-element bound from those two sources.
"""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch

from fp8_align.config import FP8Config
from fp8_align.quant import E4M3_MAX, fp8_block_gemm, quantize_activation_groupwise, quantize_weight_blockwise
from fp8_align.rounding import Rounding
from fp8_align.vllm_plugin.layer_state import Fp8AlignLayerState

pytestmark = pytest.mark.gpu

#: (M, shard sizes of the merged weight, K): full 128 blocks, partial N/K blocks, uneven shards.
GEMM_SHAPES = [
    (1, [256], 128),
    (7, [128, 256], 640),
    (33, [2048, 512, 512], 1024),  # q|k|v
    (130, [1536, 1536], 2048),  # gate|up
    (257, [1024], 3072),  # down
    (64, [384, 128], 4096),
    (5, [200], 200),  # partial N and K block
    (17, [640], 576),  # partial K block
    (9, [100, 200], 1000),  # shards not multiples of 128: per-shard scale grids
]
EXPECTED_ON_H100 = {  # default FP8Config (use_deep_gemm=True), bf16
    (256,): "deepgemm", (128, 256): "deepgemm", (2048, 512, 512): "deepgemm", (1536, 1536): "deepgemm",
    (1024,): "deepgemm", (384, 128): "deepgemm", (200,): "triton", (640,): "triton", (100, 200): "triton_per_shard",
}  # fmt: skip


@pytest.fixture(scope="module")
def gk() -> ModuleType:
    """The GPU backend module (imports vLLM and Triton, so only where the GPU tests run)."""
    import fp8_align.vllm_plugin.kernels.gpu as module

    return module


@pytest.fixture(scope="module")
def tq() -> ModuleType:
    """The Triton activation quantizer (imports Triton, so only where the GPU tests run)."""
    import fp8_align.quant.triton_groupwise as module

    return module


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _activations(m: int, k: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """[m, k] normal values whose 128-groups span 2^-12..2^12 in magnitude."""
    g = _generator(seed)
    x = torch.randn(m, k, generator=g, device="cuda")
    groups = math.ceil(k / 128)
    magnitude = torch.exp2(torch.randint(-12, 13, (m, groups), generator=g, device="cuda").float())
    return (x * magnitude.repeat_interleave(128, dim=1)[:, :k]).to(dtype)


ACTIVATION_CASES = [
    "mixed_magnitudes", "partial_group_k200", "partial_group_k1000", "one_row", "zeros", "tiny", "huge",
    "exact_pow2_amax", "fp16", "fp32",
]  # fmt: skip


def _activation_cases() -> dict[str, torch.Tensor]:
    """Inputs that probe every branch of the scale rule: zeros, tiny/huge, exact powers of two."""
    g = _generator(1)
    exact_pow2 = torch.randn(64, 512, generator=g, device="cuda") * 0.1
    exact_pow2[:, ::128] = E4M3_MAX * torch.exp2(torch.randint(-20, 20, (64, 4), generator=g, device="cuda").float())
    with_zeros = _activations(48, 384, 2)
    with_zeros[::3] = 0
    with_zeros[1, 128:256] = 0
    return {
        "mixed_magnitudes": _activations(333, 4096, 3),
        "partial_group_k200": _activations(31, 200, 4),
        "partial_group_k1000": _activations(7, 1000, 5),
        "one_row": _activations(1, 2048, 6),
        "zeros": with_zeros,
        "tiny": (torch.randn(16, 256, generator=g, device="cuda") * 1e-30).to(torch.bfloat16),
        "huge": (torch.randn(16, 256, generator=g, device="cuda") * 1e30).to(torch.bfloat16),
        "exact_pow2_amax": exact_pow2.to(torch.bfloat16),
        "fp16": _activations(65, 768, 7, torch.float16),
        "fp32": _activations(65, 768, 8, torch.float32),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of an FP8 or FP32 tensor as integers, contiguous (for bitwise equality)."""
    return t.contiguous().view(torch.uint8 if t.element_size() == 1 else torch.int32)


@pytest.mark.parametrize("case", ACTIVATION_CASES)
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scale", "pow2_scale"])
def test_activation_quant_bit_identical_to_reference(tq: ModuleType, case: str, pow2: bool) -> None:
    x = _activation_cases()[case]
    ref_codes, ref_scales = quantize_activation_groupwise(x, pow2_scale=pow2)
    for layout in tq.ScaleLayout:
        codes, scales = tq.quantize_activation_triton(x, pow2, int(layout))
        assert torch.equal(_bits(codes), _bits(ref_codes)), f"{layout.name}: codes differ"
        assert torch.equal(_bits(scales), _bits(ref_scales)), f"{layout.name}: scales differ"
        m, groups = scales.shape
        expected_stride = {
            tq.ScaleLayout.ROW_MAJOR: (groups, 1),
            tq.ScaleLayout.COLUMN_MAJOR: (1, m),
            tq.ScaleLayout.COLUMN_MAJOR_TMA: (1, -(-m // 4) * 4),
        }[layout]
        assert scales.stride() == expected_stride or groups == 1


def _multiplier_overflow(shape: tuple[int, int], dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Values near 1e-37 (bf16 subnormals among them): 448 / amax overflows FP32, where TE uses the
    input dtype's largest value as multiplier and stores a subnormal scale_inv."""
    return (torch.randn(*shape, generator=_generator(21), device="cuda") * 1e-37).to(dtype)


@pytest.mark.parametrize("case", [*ACTIVATION_CASES, "multiplier_overflow"])
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scale", "pow2_scale"])
def test_activation_quant_transformer_engine_rule_bit_identical(tq: ModuleType, case: str, pow2: bool) -> None:
    """scale_rule="transformer_engine": the Triton kernel equals the torch reference and
    te_emulation (TE's Float8BlockQuantizer) bit for bit, in every scale layout."""
    from fp8_align.megatron_ext.te_emulation import te_quantize_activation_1d

    x = _multiplier_overflow((16, 256)) if case == "multiplier_overflow" else _activation_cases()[case]
    ref_codes, ref_scales = quantize_activation_groupwise(x, pow2_scale=pow2, scale_rule="transformer_engine")
    te_codes, te_scales = te_quantize_activation_1d(x, pow2)
    assert torch.equal(_bits(ref_codes), _bits(te_codes)) and torch.equal(_bits(ref_scales), _bits(te_scales))
    for layout in tq.ScaleLayout:
        codes, scales = tq.quantize_activation_triton(x, pow2, int(layout), "transformer_engine")
        assert torch.equal(_bits(codes), _bits(ref_codes)), f"{layout.name}: codes differ"
        assert torch.equal(_bits(scales), _bits(ref_scales)), f"{layout.name}: scales differ"


def test_reference_scale_rule_on_cuda() -> None:
    """The premise of the Triton kernel: on CUDA the reference scale is amax / 448 correctly
    rounded (not `amax * fl32(1/448)`, which torch computes for `tensor / python_float`)."""
    x = _activations(4096, 1024, 9)
    _, scales = quantize_activation_groupwise(x)
    amax = x.float().abs().view(4096, 8, 128).amax(dim=-1)
    assert torch.equal(_bits(scales), _bits((amax.double() / E4M3_MAX).float()))


WEIGHT_CASES = ["qkv_4096", "partial_n_k", "one_row", "zero_blocks", "tiny", "huge", "exact_pow2_amax", "fp16", "fp32"]


def _weight_cases() -> dict[str, torch.Tensor]:
    """Weights whose 128x128 blocks span 2^-12..2^12 in magnitude, and the scale rule's edge cases."""
    g = _generator(11)
    with_zeros = _activations(384, 512, 12)
    with_zeros[128:256, 256:384] = 0
    exact_pow2 = (torch.randn(256, 256, generator=g, device="cuda") * 0.01).to(torch.bfloat16)
    exact_pow2[0, 0], exact_pow2[128, 200] = E4M3_MAX * 2.0**-9, E4M3_MAX * 2.0**5
    return {
        "qkv_4096": (torch.randn(6144, 4096, generator=g, device="cuda") * 0.02).to(torch.bfloat16),
        "partial_n_k": _activations(1000, 200, 13),
        "one_row": _activations(1, 640, 14),
        "zero_blocks": with_zeros,
        "tiny": (torch.randn(130, 130, generator=g, device="cuda") * 1e-30).to(torch.bfloat16),
        "huge": (torch.randn(130, 130, generator=g, device="cuda") * 1e30).to(torch.bfloat16),
        "exact_pow2_amax": exact_pow2,
        "fp16": _activations(300, 576, 15, torch.float16),
        "fp32": _activations(300, 576, 16, torch.float32),
    }


#: `rows_per_pass` of the weight kernels: the height of the block slices they read (128: the whole block).
ROWS_PER_PASS = [128, 64, 32]


@pytest.mark.parametrize("rows_per_pass", ROWS_PER_PASS, ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("case", WEIGHT_CASES)
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scale", "pow2_scale"])
def test_weight_quant_triton_bit_identical_to_reference(
    case: str, pow2: bool, rows_per_pass: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Triton weight quantizer == torch reference (CUDA) == independent numpy reference (small cases)."""
    from fp8_align.quant import triton_blockwise
    from fp8_align.quant.triton_blockwise import quantize_weight_blockwise_triton
    from tests.fp8_reference import reference_quantize_blocks

    monkeypatch.setitem(triton_blockwise.LAUNCH, "rows_per_pass", rows_per_pass)
    w = _weight_cases()[case]
    codes, scales = quantize_weight_blockwise_triton(w, pow2)
    ref_codes, ref_scales = quantize_weight_blockwise(w, pow2_scale=pow2)
    assert torch.equal(_bits(codes), _bits(ref_codes)), "codes differ from the torch reference"
    assert torch.equal(_bits(scales), _bits(ref_scales)), "scales differ from the torch reference"
    if w.numel() <= 2**18:
        np_values, np_scales = reference_quantize_blocks(w.float().cpu().numpy(), 128, 128, pow2)
        assert torch.equal(codes.cpu().double(), torch.from_numpy(np_values)), "codes differ from the numpy reference"
        assert torch.equal(scales.cpu(), torch.from_numpy(np_scales)), "scales differ from the numpy reference"


@pytest.mark.parametrize("case", [*WEIGHT_CASES, "multiplier_overflow"])
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scale", "pow2_scale"])
def test_weight_quant_triton_transformer_engine_rule_bit_identical(case: str, pow2: bool) -> None:
    """scale_rule="transformer_engine": single and grouped Triton launches equal the torch
    reference and te_emulation (TE's Float8BlockQuantizer) bit for bit."""
    from fp8_align.megatron_ext.te_emulation import te_quantize_weight_2d
    from fp8_align.quant.triton_blockwise import quantize_weight_blockwise_triton, quantize_weights_blockwise_triton

    w = _multiplier_overflow((130, 300)) if case == "multiplier_overflow" else _weight_cases()[case]
    ref_codes, ref_scales = quantize_weight_blockwise(w, pow2_scale=pow2, scale_rule="transformer_engine")
    te_codes, te_scales = te_quantize_weight_2d(w, pow2)
    assert torch.equal(_bits(ref_codes), _bits(te_codes)) and torch.equal(_bits(ref_scales), _bits(te_scales))
    codes, scales = quantize_weight_blockwise_triton(w, pow2, scale_rule="transformer_engine")
    grouped_codes, grouped_scales = torch.empty_like(codes), torch.empty_like(scales)
    quantize_weights_blockwise_triton([w], [grouped_codes], [grouped_scales], pow2, "transformer_engine")
    for got_codes, got_scales in ((codes, scales), (grouped_codes, grouped_scales)):
        assert torch.equal(_bits(got_codes), _bits(ref_codes)), "codes differ from the torch reference"
        assert torch.equal(_bits(got_scales), _bits(ref_scales)), "scales differ from the torch reference"


def test_weight_quant_triton_writes_into_merged_storage() -> None:
    """Per-shard quantization into row views of one merged tensor (the in-place refit path)."""
    from fp8_align.quant.dispatch import quantize_weight_into
    from fp8_align.quant.shards import quantize_shards
    from fp8_align.quant.shards import shard_slices

    sizes = [2048, 512, 200]
    w = _activations(sum(sizes), 1000, 17)
    codes = torch.zeros(w.shape, dtype=torch.float8_e4m3fn, device="cuda")
    scales = torch.zeros((16 + 4 + 2, 8), device="cuda")
    for rows, scale_rows in shard_slices(sizes):
        quantize_weight_into(w[rows], False, codes[rows], scales[scale_rows])
    start, ref_codes, ref_scales = 0, [], []
    for size in sizes:
        c, sc = quantize_weight_blockwise(w[start : start + size])
        ref_codes.append(c)
        ref_scales.append(sc)
        start += size
    assert torch.equal(_bits(codes), _bits(torch.cat(ref_codes)))
    assert torch.equal(_bits(scales), _bits(torch.cat(ref_scales)))
    merged_codes, merged_scales = quantize_shards(w, sizes, False)
    assert torch.equal(_bits(merged_codes), _bits(codes)) and torch.equal(_bits(merged_scales), _bits(scales))


def test_weight_quant_triton_rejects_non_finite_and_bad_outputs() -> None:
    from fp8_align.quant.triton_blockwise import quantize_weight_blockwise_triton

    w = _activations(256, 384, 18)
    w[130, 300] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_weight_blockwise_triton(w)
    _, scales = quantize_weight_blockwise_triton(w, check_finite=False)
    assert torch.isnan(scales[1, 2]) and torch.isfinite(scales).sum() == scales.numel() - 1
    w[130, 300] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        quantize_weight_blockwise_triton(w)
    good = _activations(256, 384, 19)
    with pytest.raises(ValueError, match="out_scales"):
        quantize_weight_blockwise_triton(good, out_scales=torch.empty(2, 2, device="cuda"))
    with pytest.raises(ValueError, match="out_codes"):
        quantize_weight_blockwise_triton(good, out_codes=torch.empty(256, 384, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(TypeError):
        quantize_weight_blockwise_triton(good.t())


@pytest.mark.parametrize("rows_per_pass", ROWS_PER_PASS, ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("subset", ["all", "aligned"])
@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scale", "pow2_scale"])
def test_grouped_weight_quant_bit_identical_to_reference(
    pow2: bool, subset: str, rows_per_pass: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Weight cases (three dtypes, partial blocks, zeros, extremes) in one grouped launch per dtype,
    half of them into row views of merged storage: each == the torch reference, bit for bit.
    "all" includes odd shapes (the kernel's unhinted path); "aligned" only shapes whose N and K
    are multiples of 16 (the path with vectorization hints, what an 8B refit runs)."""
    from fp8_align.quant import triton_blockwise
    from fp8_align.quant.dispatch import quantize_weights_into
    from fp8_align.quant.triton_blockwise import quantize_weights_blockwise_triton
    from fp8_align.quant.shards import shard_slices

    monkeypatch.setitem(triton_blockwise.GROUPED_LAUNCH, "rows_per_pass", rows_per_pass)
    cases = [w for w in _weight_cases().values() if subset == "all" or (w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0)]
    assert len(cases) >= 3
    weights, out_codes, out_scales = [], [], []
    for i, w in enumerate(cases):
        if i % 2:  # a shard in the middle of a merged tensor, as in a refit of qkv_proj
            sizes = [256, w.shape[0], 130]
            merged_codes = torch.zeros((sum(sizes), w.shape[1]), dtype=torch.float8_e4m3fn, device="cuda")
            merged_scales = torch.zeros((sum(-(-n // 128) for n in sizes), -(-w.shape[1] // 128)), device="cuda")
            rows, scale_rows = shard_slices(sizes)[1]
            out_codes.append(merged_codes[rows])
            out_scales.append(merged_scales[scale_rows])
        else:
            out_codes.append(torch.zeros(w.shape, dtype=torch.float8_e4m3fn, device="cuda"))
            out_scales.append(torch.zeros((-(-w.shape[0] // 128), -(-w.shape[1] // 128)), device="cuda"))
        weights.append(w)
    quantize_weights_blockwise_triton(weights, out_codes, out_scales, pow2)
    for w, codes, scales in zip(weights, out_codes, out_scales):
        ref_codes, ref_scales = quantize_weight_blockwise(w, pow2_scale=pow2)
        assert torch.equal(_bits(codes), _bits(ref_codes)), (tuple(w.shape), w.dtype)
        assert torch.equal(_bits(scales), _bits(ref_scales)), (tuple(w.shape), w.dtype)
    again = [torch.zeros_like(c) for c in out_codes], [torch.zeros_like(s) for s in out_scales]
    quantize_weights_into(weights, *again, pow2)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(again[0], out_codes))


def test_grouped_weight_quant_is_queued_without_a_device_sync() -> None:
    """The grouped launch returns while earlier device work still runs (the refit's `load_weights`
    host work overlaps it), and the codes it then writes are the reference's.

    A ~0.5 s `torch.cuda._sleep` is queued first: a pageable host->device copy of the launch
    table would wait for it, and the event after it would be complete on return."""
    from fp8_align.quant.triton_blockwise import quantize_weights_blockwise_triton

    weights = [w for w in _weight_cases().values() if w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0][:3]
    out_codes = [torch.zeros(w.shape, dtype=torch.float8_e4m3fn, device="cuda") for w in weights]
    out_scales = [torch.zeros((-(-w.shape[0] // 128), -(-w.shape[1] // 128)), device="cuda") for w in weights]
    quantize_weights_blockwise_triton(weights, out_codes, out_scales, False)  # compiled before the timed part
    for codes, scales in zip(out_codes, out_scales):
        codes.zero_()
        scales.zero_()
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)
    busy = torch.cuda.Event()
    busy.record()
    quantize_weights_blockwise_triton(weights, out_codes, out_scales, False)
    assert not busy.query(), "the grouped launch waited for the device"
    for w, codes, scales in zip(weights, out_codes, out_scales):
        ref_codes, ref_scales = quantize_weight_blockwise(w)
        assert torch.equal(_bits(codes), _bits(ref_codes)) and torch.equal(_bits(scales), _bits(ref_scales))


def test_grouped_weight_quant_rejects_bad_outputs() -> None:
    from fp8_align.quant.triton_blockwise import quantize_weights_blockwise_triton

    w = _activations(256, 384, 20)
    codes = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device="cuda")
    with pytest.raises(ValueError, match="weights"):
        quantize_weights_blockwise_triton([w], [codes], [], False)
    with pytest.raises(ValueError, match="out_scales"):
        quantize_weights_blockwise_triton([w], [codes], [torch.empty(2, 2, device="cuda")], False)
    with pytest.raises(TypeError):
        quantize_weights_blockwise_triton([w.t()], [codes], [torch.empty(2, 3, device="cuda")], False)


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scale", "pow2_scale"])
def test_vllm_per_token_group_quant_agreement(pow2: bool) -> None:
    """Why the plugin does not use vLLM's `per_token_group_quant_fp8`: report where it differs.

    Asserted: wherever vLLM's scale equals the reference scale, the codes are identical, so any
    difference comes from the scale rule (vLLM clamps amax to eps=1e-10: an all-zero group gets
    scale 1e-10/448 where fp8_align uses 1.0) and not from the rounding of the codes.
    """
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

    x = _activations(1024, 4096, 10)
    x[::50] = 0
    ref_codes, ref_scales = quantize_activation_groupwise(x, pow2_scale=pow2)
    codes, scales = per_token_group_quant_fp8(x, 128, use_ue8m0=pow2)
    same_scale = _bits(scales) == _bits(ref_scales)
    same_codes = (_bits(codes) == _bits(ref_codes)).view(*same_scale.shape, 128).all(dim=-1)
    print(
        f"\nvLLM per_token_group_quant_fp8(use_ue8m0={pow2}) vs fp8_align: scales differ in "
        f"{(~same_scale).float().mean().item():.4%} of groups, codes in {(~same_codes).float().mean().item():.4%}"
    )
    assert bool(same_codes[same_scale].all())


# --------------------------------------------------------------------------- GEMM backends
def _layer(shard_sizes: list[int], k: int, pow2: bool, seed: int) -> torch.nn.Module:
    """A stand-in for a vLLM linear layer after fp8_align quantized it (weights with block
    magnitudes spanning 2^-4..2^4, so block scales differ), weight and activation scales pow2 or not."""
    from fp8_align.quant.shards import quantize_shards

    g = _generator(seed)
    n = sum(shard_sizes)
    w = torch.randn(n, k, generator=g, device="cuda") * 0.02
    block_gain = torch.exp2(torch.randint(-4, 5, (math.ceil(n / 128), math.ceil(k / 128)), generator=g, device="cuda").float())
    w = (w * block_gain.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]).to(torch.bfloat16)
    codes, scales = quantize_shards(w, shard_sizes, pow2)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(codes, requires_grad=False)
    layer.weight_scale_inv = torch.nn.Parameter(scales, requires_grad=False)
    rounding = Rounding(weight_pow2=pow2, activation_pow2=pow2)
    layer.fp8_align = Fp8AlignLayerState("linear", f"test[{shard_sizes}x{k}]", rounding, shard_sizes=list(shard_sizes))
    layer.params_dtype = torch.bfloat16
    return layer


def _target(gk: ModuleType, out_dtype: torch.dtype = torch.bfloat16) -> object:
    return gk.Target(torch.device("cuda", 0), torch.cuda.get_device_capability(0), out_dtype, FP8Config())


def _eligible_kernel(gk: ModuleType, name: str, shard_sizes: list[int], k: int, out_dtype: torch.dtype = torch.bfloat16) -> object:
    """The backend called `name`, or a pytest skip naming why it cannot run this shape here."""
    kernel = next(t for t in gk.GPU_KERNEL_ORDER if t.name == name)()
    reason = kernel.unsupported_reason(gk.LayerShape(sum(shard_sizes), k, tuple(shard_sizes)), _target(gk, out_dtype))
    if reason is not None:
        pytest.skip(f"{name} not eligible: {reason}")
    return kernel


def _per_shard(layer: torch.nn.Module, x_fp8: torch.Tensor, x_scale: torch.Tensor, absolute: bool) -> torch.Tensor:
    """`fp8_block_gemm` shard by shard in FP32; with `absolute`, of |codes| (the bound's sum)."""
    outputs, row, scale_row = [], 0, 0
    x = x_fp8.float().abs() if absolute else x_fp8
    for size in layer.fp8_align.shard_sizes:
        blocks = -(-size // 128)
        w = layer.weight[row : row + size]
        outputs.append(
            fp8_block_gemm(x, x_scale, w.float().abs() if absolute else w, layer.weight_scale_inv[scale_row : scale_row + blocks], torch.float32)
        )
        row += size
        scale_row += blocks
    return torch.cat(outputs, dim=-1)


def _error_bound(ref: torch.Tensor, abs_sum: torch.Tensor, k: int, out_dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound on |kernel - reference| for bit-identical FP8 operands.

    * Accumulation: Hopper FP8 tensor-core MMAs (K=32 per instruction) keep about 14 bits of
      the running sum (DeepSeek-V3 report, sec. 3.3.2), i.e. a relative error <= 2^-13 of the
      block's sum of |products| per instruction; the kernels promote to FP32 every 128 K, so a
      128-wide block accumulates 4 instructions: <= 2^-11 * sum|x_k w_k| * scales. The FP32 scale
      multiply and the FP32 sum over the K/128 blocks add <= (K/128 + 3) * 2^-24 of the same sum.
    * Output rounding: round-to-nearest into `out_dtype` adds at most half an ulp, i.e. the unit
      roundoff 2^-8 |value| for bf16 (8 significant bits; 2^-11 for fp16). Relative to the
      reference: <= 2^-8 |ref| + 2^-8 * (accumulation error), hence the factor 1.01 below.
    """
    unit = 2.0**-8 if out_dtype == torch.bfloat16 else 2.0**-11
    accumulation = 2.0**-11 + (math.ceil(k / 128) + 3) * 2.0**-24
    return unit * ref.abs() + 1.01 * accumulation * abs_sum


@pytest.mark.parametrize("pow2", [False, True], ids=["fp32_scale", "pow2_scale"])
@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: f"M{s[0]}-N{'+'.join(map(str, s[1]))}-K{s[2]}")
@pytest.mark.parametrize("kernel_name", ["deepgemm", "cutlass", "cublas", "triton", "triton_per_shard", "emulated"])
def test_gemm_backend_matches_reference(gk: ModuleType, kernel_name: str, shape: tuple, pow2: bool) -> None:
    m, shard_sizes, k = shape
    kernel = _eligible_kernel(gk, kernel_name, shard_sizes, k)
    layer = _layer(shard_sizes, k, pow2, seed=m + k)
    kernel.prepare(layer)
    x = _activations(m, k, seed=m * 7 + k)
    out = kernel.apply(layer, x, None)
    assert out.shape == (m, sum(shard_sizes)) and out.dtype == torch.bfloat16
    assert bool(torch.isfinite(out).all())

    x_fp8, x_scale = quantize_activation_groupwise(x, pow2_scale=pow2)
    ref = _per_shard(layer, x_fp8, x_scale, absolute=False)
    bound = _error_bound(ref, _per_shard(layer, x_fp8, x_scale, absolute=True), k, torch.bfloat16)
    err = (out.float() - ref).abs()
    rel_fro = (err.norm() / ref.norm()).item()
    print(f"\n{kernel_name} {shape} pow2={pow2}: max err/bound {(err / bound).max().item():.3f}, rel Frobenius {rel_fro:.2e}")
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item():.3f}"
    assert rel_fro < 2.0**-8


@pytest.mark.parametrize("shape", GEMM_SHAPES, ids=lambda s: f"N{'+'.join(map(str, s[1]))}-K{s[2]}")
def test_selection_on_h100(gk: ModuleType, shape: tuple) -> None:
    if torch.cuda.get_device_capability(0) != (9, 0):
        pytest.skip("expected choices are for SM90")
    _, shard_sizes, k = shape
    device = torch.device("cuda", 0)
    kernel = gk.select_gpu_kernel(FP8Config(), torch.Size([sum(shard_sizes), k]), shard_sizes, device)
    assert kernel.name == EXPECTED_ON_H100[tuple(shard_sizes)], kernel.passed
    assert len(kernel.passed) == [t.name for t in gk.GPU_KERNEL_ORDER].index(kernel.name)
    without_deepgemm = gk.select_gpu_kernel(FP8Config(use_deep_gemm=False), torch.Size([sum(shard_sizes), k]), shard_sizes, device)
    if kernel.name == "deepgemm":
        assert without_deepgemm.name == "cutlass" and "use_deep_gemm=False" in without_deepgemm.passed[0]
    fp16 = gk.select_gpu_kernel(FP8Config(), torch.Size([sum(shard_sizes), k]), shard_sizes, device, torch.float16)
    assert fp16.name != "deepgemm"


@pytest.mark.parametrize("kernel_name", ["deepgemm", "cutlass", "cublas", "triton", "triton_per_shard"])
def test_bias_and_leading_dims(gk: ModuleType, kernel_name: str) -> None:
    """apply(x[..., K], bias) == apply(x.view(-1, K)) + bias, reshaped: same kernel, same bits."""
    kernel = _eligible_kernel(gk, kernel_name, [256, 128], 512)
    layer = _layer([256, 128], 512, False, seed=3)
    x = _activations(12, 512, seed=4)
    bias = torch.randn(384, generator=_generator(5), device="cuda").to(torch.bfloat16)
    with_bias = kernel.apply(layer, x.view(3, 4, 512), bias)
    assert with_bias.shape == (3, 4, 384)
    assert torch.equal(with_bias, (kernel.apply(layer, x, None) + bias).view(3, 4, 384))


@pytest.mark.parametrize("kernel_name", ["cutlass", "cublas", "triton"])
def test_fp16_output(gk: ModuleType, kernel_name: str) -> None:
    kernel = _eligible_kernel(gk, kernel_name, [512], 1024, torch.float16)
    layer = _layer([512], 1024, False, seed=6)
    x = _activations(40, 1024, seed=7, dtype=torch.float16)
    out = kernel.apply(layer, x, None)
    assert out.dtype == torch.float16
    x_fp8, x_scale = quantize_activation_groupwise(x)
    ref = _per_shard(layer, x_fp8, x_scale, absolute=False)
    bound = _error_bound(ref, _per_shard(layer, x_fp8, x_scale, absolute=True), 1024, torch.float16)
    assert bool(((out.float() - ref).abs() <= bound).all())


def test_deepgemm_refuses_non_bf16_layer(gk: ModuleType) -> None:
    layer = _layer([256], 256, False, seed=8)
    layer.params_dtype = torch.float16
    with pytest.raises(ValueError, match="DeepGEMM"):
        gk.DeepGemmBlockFp8Kernel().prepare(layer)


def test_graph_capture_and_compile(gk: ModuleType) -> None:
    """The backends run inside torch.compile (as vLLM traces them) and CUDA-graph replay."""
    layer = _layer([512, 256], 1024, False, seed=9)
    x = _activations(16, 1024, seed=10)
    for kernel_type in gk.GPU_KERNEL_ORDER[:-1]:
        kernel = kernel_type()
        if kernel.unsupported_reason(gk.LayerShape(768, 1024, (512, 256)), _target(gk)) is not None:
            continue
        eager = kernel.apply(layer, x, None)
        compiled = torch.compile(lambda inp, k=kernel: k.apply(layer, inp, None), fullgraph=True, dynamic=True)
        assert torch.equal(compiled(x), eager), kernel.name
        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        kernel.apply(layer, static_x, None)  # warm-up (JIT) outside the capture
        with torch.cuda.graph(graph):
            static_out = kernel.apply(layer, static_x, None)
        static_x.copy_(_activations(16, 1024, seed=11))
        graph.replay()
        assert torch.equal(static_out, kernel.apply(layer, static_x, None)), kernel.name


# --------------------------------------------------------------------------- kernel-identical training forward
@pytest.mark.parametrize("shard_sizes,k", [([2048, 512, 512], 1024), ([1536, 1536], 2048), ([1024], 3072), ([576, 192, 192], 576),
                                           ([1536, 1536], 576)])  # fmt: skip
def test_engine_kernel_training_linear_is_bit_identical_to_the_engine_layer(shard_sizes: list[int], k: int) -> None:
    """`Fp8TrainingLinear(forward_kernel="engine")` on one HF projection (q_proj, k_proj, ...) gives,
    bit for bit, the rows of what the plugin's stacked vLLM layer (qkv_proj, gate_up_proj) computes
    for the same input, with the backend the plugin selects for the stacked shape (DeepGEMM for
    full 128 blocks, Triton / per-shard Triton for SmolLM2's 576/192 shards)."""
    from fp8_align.hf_training import Fp8TrainingLinear
    from fp8_align.vllm_plugin.kernels.registry import select_kernel
    from fp8_align.quant.shards import quantize_shards

    cfg = FP8Config()
    g = _generator(7)
    weights = [(torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16) for n in shard_sizes]
    x = _activations(77, k, seed=8)
    codes, scales = quantize_shards(torch.cat(weights), shard_sizes, cfg.use_weight_pow2_scale)
    stacked = torch.nn.Module()
    stacked.weight, stacked.weight_scale_inv = codes, scales
    stacked.fp8_align = Fp8AlignLayerState("linear", "stacked", cfg.rounding, shard_sizes=list(shard_sizes))
    stacked.params_dtype = torch.bfloat16
    kernel = select_kernel(cfg, codes.shape, list(shard_sizes), codes.device)
    engine_out = kernel.apply(stacked, x, None)
    row = 0
    for i, w in enumerate(weights):
        linear = torch.nn.Linear(k, w.shape[0], bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            linear.weight.copy_(w)
        training = Fp8TrainingLinear(linear, cfg, "engine", f"shard{i}", tuple(shard_sizes))
        assert training.engine_kernel(x.device, x.dtype).name == kernel.name
        with torch.no_grad():
            got = training(x)
        assert torch.equal(got, engine_out[:, row : row + w.shape[0]]), f"{kernel.name}: shard {i} differs"
        row += w.shape[0]
    print(f"{shard_sizes}x{k}: {kernel.name}, bit-identical")


def test_engine_kernel_training_linear_trains() -> None:
    """The backward is the BF16 straight-through one: gradients equal nn.Linear's on the same inputs."""
    from fp8_align.hf_training import Fp8TrainingLinear

    linear = torch.nn.Linear(1024, 512, bias=True, device="cuda", dtype=torch.bfloat16)
    training = Fp8TrainingLinear(linear, FP8Config(), "engine", "proj")
    x = _activations(64, 1024, seed=3).requires_grad_(True)
    training(x).float().square().sum().backward()
    gx, gw = x.grad.clone(), linear.weight.grad.clone()
    assert gx is not None and torch.isfinite(gw).all() and gw.abs().sum() > 0


@pytest.mark.parametrize("in_features,out_features", [(2048, 4096), (576, 192)])  # DeepGEMM; Triton per shard
def test_engine_kernel_training_linear_does_not_sync_the_host(in_features: int, out_features: int) -> None:
    """Forward and backward of `Fp8TrainingLinear(forward_kernel="engine")` queue GPU work without
    waiting for it: a device sync per layer would leave the GPU idle between a trainer's layers
    (`torch.cuda.set_sync_debug_mode("error")` raises on any sync). The first call, which selects
    the backend and compiles, runs before the check."""
    from fp8_align.hf_training import Fp8TrainingLinear

    linear = torch.nn.Linear(in_features, out_features, bias=False, device="cuda", dtype=torch.bfloat16)
    training = Fp8TrainingLinear(linear, FP8Config(), "engine", "proj")
    x = _activations(3072, in_features, seed=5).requires_grad_(True)
    training(x).float().sum().backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        training(x).float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_engine_kernel_training_linears_frozen_give_the_same_bits() -> None:
    """`frozen_fp8_weights` over `Fp8TrainingLinear(forward_kernel="engine")` layers on CUDA: the
    second forward of the block reuses the first one's codes, and both give the outputs and weight
    gradients of quantizing at every forward, bit for bit, without a host sync inside the block
    (the CPU test, tests/test_hf_training.py, counts the quantizations)."""
    from fp8_align.hf_training import Fp8TrainingLinear, frozen_fp8_weights

    model = torch.nn.Sequential(torch.nn.Linear(2048, 4096, bias=False), torch.nn.Linear(4096, 2048, bias=False)).to("cuda", torch.bfloat16)
    for i in range(2):
        model[i] = Fp8TrainingLinear(model[i], FP8Config(), "engine", f"proj{i}")
    x = _activations(3072, 2048, seed=7)

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        out = model(x)
        out.float().square().sum().backward()
        return out.detach(), [layer.weight.grad.clone() for layer in model]

    plain_out, plain_grads = run()
    with frozen_fp8_weights(model):
        run()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out, grads = run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out, plain_out) and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
