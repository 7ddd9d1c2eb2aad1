"""The Triton quantizers on CPU, through the Triton interpreter (TRITON_INTERPRET=1).

The compiled kernels are tested bit for bit against the torch reference on the GPU box
(tests/test_gpu_kernels.py). Here, in CI: the grouped kernel (a whole refit in one launch) gives
the same codes and scales as one single-weight launch per weight, for FP32 and power-of-two
scales, partial blocks and row views of merged storage, and every scale equals the torch
reference's. Codes are compared kernel to kernel only: the interpreter's float32 -> e4m3 cast
rounds some values next to a power of two differently from the GPU (an interpreter artifact),
which would make a comparison with the reference fail for reasons outside our code.
The scale_rule="transformer_engine" test swaps that cast (and the interpreter's widening of
bf16/fp16 subnormals) for torch's and compares both kernels with the reference, codes included;
so does the test of the transposed activation kernel (the weight gradient's operands), both rules.
The interpreter must be enabled before Triton is imported, hence the subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

_SCRIPT = """
import sys
import torch
from fp8_align.quant import quantize_weight_blockwise
from fp8_align.quant.triton_blockwise import GROUPED_LAUNCH, LAUNCH, quantize_weight_blockwise_triton, quantize_weights_blockwise_triton
LAUNCH["rows_per_pass"], GROUPED_LAUNCH["rows_per_pass"] = int(sys.argv[1]), int(sys.argv[2])
g = torch.Generator().manual_seed(0)
shapes = [(128, 128), (300, 200), (1, 5), (256, 384), (130, 129)]
checked = 0
for pow2 in (False, True):
    weights = [(torch.randn(*s, generator=g) * 10.0 ** (i - 2)).to(torch.bfloat16) for i, s in enumerate(shapes)]
    weights[3][:128, :128] = 0  # an all-zero block: scale 1.0
    merged = torch.zeros(128 + 300 + 7, 200, dtype=torch.float8_e4m3fn)
    merged_scales = torch.zeros(1 + 3 + 1, 2)
    codes = [torch.zeros(s, dtype=torch.float8_e4m3fn) for s in shapes]
    scales = [torch.zeros(-(-s[0] // 128), -(-s[1] // 128)) for s in shapes]
    codes[1], scales[1] = merged[128:428], merged_scales[1:4]  # a shard in the middle of merged storage
    quantize_weights_blockwise_triton(weights, codes, scales, pow2)
    for w, c, s in zip(weights, codes, scales):
        single_codes, single_scales = quantize_weight_blockwise_triton(w, pow2, check_finite=False)
        _, ref_scales = quantize_weight_blockwise(w, pow2_scale=pow2)
        assert torch.equal(c.view(torch.uint8), single_codes.view(torch.uint8)), (tuple(w.shape), pow2)
        assert torch.equal(s.view(torch.int32), single_scales.view(torch.int32)), (tuple(w.shape), pow2)
        assert torch.equal(s.view(torch.int32), ref_scales.view(torch.int32)), (tuple(w.shape), pow2)
        checked += 1
    assert merged[:128].view(torch.uint8).eq(0).all() and merged[428:].view(torch.uint8).eq(0).all(), "wrote outside the shard"
    # only shapes that are multiples of 16: the launch takes the kernel's ALIGNED branch
    aligned = [w for w in weights if w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0]
    codes = [torch.zeros(w.shape, dtype=torch.float8_e4m3fn) for w in aligned]
    scales = [torch.zeros(-(-w.shape[0] // 128), -(-w.shape[1] // 128)) for w in aligned]
    quantize_weights_blockwise_triton(aligned, codes, scales, pow2)
    for w, c, s in zip(aligned, codes, scales):
        single_codes, single_scales = quantize_weight_blockwise_triton(w, pow2, check_finite=False)
        assert torch.equal(c.view(torch.uint8), single_codes.view(torch.uint8)) and torch.equal(s, single_scales)
        checked += 1
print("checked", checked)
"""


@pytest.mark.parametrize(
    ("single_rows_per_pass", "grouped_rows_per_pass"),
    [(128, 128), (128, 32), (32, 128)],
    ids=["whole_block_slices", "grouped_32_row_slices", "single_32_row_slices"],
)
def test_grouped_kernel_equals_single_kernel_and_reference_scales(single_rows_per_pass: int, grouped_rows_per_pass: int) -> None:
    """Rows per pass (`_quantize_block`): 128 reads the block as one slice, 32 as four; each
    pairing of the two kernels must give the same bits."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-c", _SCRIPT, str(single_rows_per_pass), str(grouped_rows_per_pass)]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "14"


#: Both Triton kernels with scale_rule="transformer_engine" against the torch reference, codes
#: included. Two interpreter conversions are replaced by torch's: float32 -> e4m3 (the
#: interpreter's rounds some values next to a power of two wrongly; torch rounds to nearest even,
#: what the GPU's `cvt.rn.satfinite` computes for the clamped values) and the exact widening of
#: bf16/fp16 to float32 (the interpreter's garbles subnormals, which the overflow case below
#: holds). So the kernels' own arithmetic (multiplier, product, reciprocal) is compared bit for
#: bit with the reference's.
_TORCH_CASTS = """
import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter

_convert_float = interpreter._convert_float
_WIDEN = {tl.bfloat16: torch.bfloat16, tl.float16: torch.float16}


def torch_cast(values, input_dtype, output_dtype, rounding_mode):
    if input_dtype == tl.float32 and output_dtype == tl.float8e4nv:
        as_float = np.ascontiguousarray(values).view(np.float32)
        return torch.from_numpy(as_float).to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(values.shape)
    if input_dtype in _WIDEN and output_dtype == tl.float32:
        narrow = torch.from_numpy(np.ascontiguousarray(values).view(np.int16)).view(_WIDEN[input_dtype])
        return narrow.to(torch.float32).view(torch.int32).numpy().view(np.uint32).reshape(values.shape)
    return _convert_float(values, input_dtype, output_dtype, rounding_mode)


interpreter._convert_float = torch_cast
"""

_TE_RULE_SCRIPT = _TORCH_CASTS + """
from fp8_align.quant import quantize_activation_groupwise, quantize_weight_blockwise
from fp8_align.quant.triton_blockwise import quantize_weight_blockwise_triton, quantize_weights_blockwise_triton
from fp8_align.quant.triton_groupwise import ScaleLayout, quantize_activation_triton

RULE = "transformer_engine"
g = torch.Generator().manual_seed(1)


def spread(rows, cols, dtype, decades):
    # rows scaled over `decades` binades-worth of magnitudes, so amax covers many exponents
    return (torch.randn(rows, cols, generator=g) * torch.logspace(-decades, decades, rows)[:, None]).to(dtype)


def same(got, want):
    # bitwise: e4m3 codes as bytes, float32 scales as int32
    bits = torch.uint8 if got.element_size() == 1 else torch.int32
    return got.dtype == want.dtype and torch.equal(got.view(bits), want.view(bits))


checked, weight_scales_differ, activation_scales_differ = 0, 0, 0
for dtype, decades in ((torch.bfloat16, 6), (torch.float16, 3), (torch.float32, 6)):
    for pow2 in (False, True):
        w = spread(300, 200, dtype, decades)
        w[:128, :128] = 0  # all-zero block
        w[256:, 128:] = torch.randn(44, 72, generator=g).to(dtype) * 1e-37  # 448 / amax overflows (fp16: zeros)
        ref_codes, ref_scales = quantize_weight_blockwise(w, pow2_scale=pow2, scale_rule=RULE)
        codes, scales = quantize_weight_blockwise_triton(w, pow2, scale_rule=RULE)
        assert same(codes, ref_codes) and same(scales, ref_scales), ("single", dtype, pow2)
        grouped_codes, grouped_scales = torch.empty_like(codes), torch.empty_like(scales)
        quantize_weights_blockwise_triton([w], [grouped_codes], [grouped_scales], pow2, RULE)
        assert same(grouped_codes, ref_codes) and same(grouped_scales, ref_scales), ("grouped", dtype, pow2)
        x = spread(37, 300, dtype, decades)
        x[3] = 0  # all-zero groups
        x[5] = (torch.randn(300, generator=g) * 1e-37).to(dtype)  # 448 / amax overflows (fp16: zeros)
        ref_x, ref_x_scales = quantize_activation_groupwise(x, pow2_scale=pow2, scale_rule=RULE)
        for layout in ScaleLayout:
            x_codes, x_scales = quantize_activation_triton(x, pow2, int(layout), RULE)
            assert same(x_codes, ref_x) and same(x_scales.contiguous(), ref_x_scales), ("activation", dtype, pow2, layout)
        if not pow2:  # FP32 scales of the default rule differ in some blocks: the rule is used
            weight_scales_differ += int((quantize_weight_blockwise_triton(w, pow2)[1] != scales).sum())
            activation_scales_differ += int((quantize_activation_triton(x, pow2, 0)[1] != x_scales).sum())
        checked += 1
assert weight_scales_differ > 0 and activation_scales_differ > 0, (weight_scales_differ, activation_scales_differ)
print("checked", checked)
"""


def test_kernels_with_transformer_engine_rule_equal_the_reference_bit_for_bit() -> None:
    """Weight kernel (single and grouped launch) and activation kernel, bf16/fp16/fp32, FP32 and
    power-of-two scales, partial and all-zero blocks: codes and scales equal the torch reference
    with scale_rule="transformer_engine" (itself equal to te_emulation, tests/test_scale_rule.py)."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _TE_RULE_SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "6"


_TRANSPOSED_SCRIPT = _TORCH_CASTS + """
from fp8_align.quant.groupwise import quantize_activation_transposed
from fp8_align.quant.triton_groupwise import quantize_activation_transposed_triton

g = torch.Generator().manual_seed(2)
checked = 0
for rule in ("amax_over_max", "transformer_engine"):
    for dtype in (torch.bfloat16, torch.float32):
        for pow2 in (False, True):
            for m, k in ((300, 200), (128, 64), (1, 130)):
                x = (torch.randn(m, k, generator=g) * torch.logspace(-3, 3, m)[:, None]).to(dtype)
                x[:, :3] = 0  # all-zero channels
                ref_codes, ref_scales = quantize_activation_transposed(x, pow2, rule)
                codes, scales = quantize_activation_transposed_triton(x, pow2, rule)
                assert scales.stride() == (1, k), scales.stride()
                assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)), (rule, dtype, pow2, m, k)
                assert torch.equal(scales.contiguous().view(torch.int32), ref_scales.view(torch.int32)), (rule, dtype, pow2, m, k)
                checked += 1
print("checked", checked)
"""


def test_transposed_kernel_equals_the_reference_bit_for_bit() -> None:
    """`quantize_activation_transposed_triton` (128-token groups of each channel, written transposed:
    the weight gradient's operands) against the torch reference, codes and scales, both scale rules,
    bf16 and fp32, FP32 and power-of-two scales, token counts that pad (300, 1) and do not (128),
    channel counts that fill a program partly, all-zero channels."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", _TRANSPOSED_SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1] == "24"
