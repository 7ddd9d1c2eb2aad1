"""The Triton weight quantizers on CPU, through the Triton interpreter (TRITON_INTERPRET=1).

The compiled kernels are tested bit for bit against the torch reference on the GPU box
(tests/test_gpu_kernels.py). Here, in CI: the grouped kernel (a whole refit in one launch) gives
the same codes and scales as one single-weight launch per weight, for FP32 and power-of-two
scales, partial blocks and row views of merged storage, and every scale equals the torch
reference's. Codes are compared kernel to kernel only: the interpreter's float32 -> e4m3 cast
rounds some values next to a power of two differently from the GPU (an interpreter artifact),
which would make a comparison with the reference fail for reasons outside our code.
The interpreter must be enabled before Triton is imported, hence the subprocess.
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
