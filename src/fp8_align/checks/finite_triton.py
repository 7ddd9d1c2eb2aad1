"""Triton kernel behind `fp8_align.checks.nonfinite_tensors` on CUDA: flag tensors holding NaN/Inf.

One launch covers a whole list of same-dtype tensors on one device: a table of (address,
element count, output slot) per tensor, a grid of (programs per tensor, tensors); each program
strides through its tensor `BLOCK` elements at a time and raises the tensor's flag when any
element read is NaN or +-Inf (its magnitude does not compare <= FLT_MAX). Import only where
Triton and CUDA exist.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from fp8_align.quant.triton_blockwise import TRITON_DTYPES, int64_table_to_device

#: Launch configuration: elements one program reads per step, warps per program, programs per
#: tensor per SM (benchmarks/tune_weight_quant.py times alternatives).
LAUNCH = {"block": 4096, "num_warps": 8, "programs_per_sm": 2}
#: Grid dimension 1 (tensors per launch) is limited by CUDA.
MAX_TENSORS_PER_LAUNCH = 65535


@triton.jit
def _flag_nonfinite_kernel(
    table, flags, num_tensors, FP32_MAX: tl.constexpr, DTYPE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr
):
    """ALIGNED: every address is a multiple of 16 bytes and every element count a multiple of 16
    (facts Triton cannot know of values loaded from memory; without them loads are not vectorized)."""
    tensor = tl.program_id(1)
    base = tl.load(table + tensor).to(tl.pointer_type(DTYPE))
    numel = tl.load(table + num_tensors + tensor)
    if ALIGNED:
        base = tl.multiple_of(base, 16)
        numel = tl.multiple_of(numel, 16)
    slot = tl.load(table + 2 * num_tensors + tensor)
    offsets = tl.arange(0, BLOCK)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    first = tl.program_id(0).to(tl.int64) * BLOCK
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    for chunk in tl.range(first, numel, step):
        index = tl.multiple_of(chunk, BLOCK) + offsets
        x = tl.load(base + index, mask=index < numel, other=0.0).to(tl.float32)
        bad = tl.maximum(bad, tl.where(tl.abs(x) <= FP32_MAX, 0, 1))
    tl.store(flags + slot, 1, mask=tl.max(bad, axis=0) > 0)


def flag_nonfinite_triton(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """int32 flags [len(tensors)] on the tensors' device: 1 where a tensor holds NaN or +-Inf.

    tensors: CUDA tensors of one device, each bf16, fp16 or fp32, any shape (non-contiguous ones
    are read through a contiguous copy). Asynchronous (no device sync): reading the flags waits.
    With TRITON_INTERPRET=1 CPU tensors work too (how the CPU tests run this kernel).
    """
    if not tensors:
        raise ValueError("flag_nonfinite_triton needs at least one tensor")
    device = tensors[0].device
    for tensor in tensors:
        if tensor.device != device or tensor.dtype not in TRITON_DTYPES:
            raise TypeError(f"expected {list(TRITON_DTYPES)} tensors on {device}, got {tensor.dtype} on {tensor.device}")
    flags = torch.zeros(len(tensors), dtype=torch.int32, device=device)
    contiguous = [tensor if tensor.is_contiguous() else tensor.contiguous() for tensor in tensors]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for slot, tensor in enumerate(contiguous):
        if tensor.numel():
            by_dtype.setdefault(tensor.dtype, []).append(slot)
    # (CPU tensors only reach here under the Triton interpreter, in tests)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    programs, block = LAUNCH["programs_per_sm"] * sms, LAUNCH["block"]
    for dtype, slots in by_dtype.items():
        for start in range(0, len(slots), MAX_TENSORS_PER_LAUNCH):
            group = slots[start : start + MAX_TENSORS_PER_LAUNCH]
            rows = [[contiguous[s].data_ptr() for s in group], [contiguous[s].numel() for s in group], group]
            table = int64_table_to_device(rows, device)
            largest = max(contiguous[s].numel() for s in group)
            grid = (min(programs, triton.cdiv(largest, block)), len(group))
            aligned = all(address % 16 == 0 for address in rows[0]) and all(numel % 16 == 0 for numel in rows[1])
            _flag_nonfinite_kernel[grid](
                table, flags, len(group), FP32_MAX=torch.finfo(torch.float32).max, DTYPE=TRITON_DTYPES[dtype],
                BLOCK=block, ALIGNED=aligned, num_warps=LAUNCH["num_warps"],
            )  # fmt: skip
    # Freeing `contiguous` copies and tables now is safe: the caching allocator reuses their
    # memory only for work queued after these kernels on the same stream.
    return flags
