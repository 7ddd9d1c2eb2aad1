"""Build FlashInfer's XQA decode modules (BF16 query, FP8 E4M3 KV cache, sm_90a) ahead of time.

Run by benchmarks/box/build_flashinfer_aot.sh inside its build environment (CUDA_HOME = the CUDA 13.0
compiler wheels, FLASHINFER_CUDA_ARCH_LIST=9.0a). For each module spec it runs FlashInfer's own
JIT build (`JitSpec.build`), copies the library to OUT/aot/<name>/<name>.so (the layout
`flashinfer.jit.env.FLASHINFER_AOT_DIR` expects, where `JitSpec.build_and_load` loads it without
compiling), checks that it loads, and writes OUT/manifest.json (versions, specs, sha256).

    python benchmarks/box/build_flashinfer_aot.py OUT [--specs HEAD_DIM:GROUP_RATIO:PAGE_SIZE ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from pathlib import Path

#: (head_dim, query heads per KV head, page size) of the models the benchmarks run:
#: Qwen3-8B (32/8 heads), Qwen3-30B-A3B (32/4), SmolLM2-135M (9/3, head_dim 64); vLLM pages of 16.
DEFAULT_SPECS = ("128:4:16", "128:8:16", "64:3:16")


def main() -> int:
    import torch
    import tvm_ffi
    from flashinfer import __version__ as flashinfer_version
    from flashinfer.jit.xqa import gen_xqa_module

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--specs", nargs="+", default=list(DEFAULT_SPECS), help="HEAD_DIM:GROUP_RATIO:PAGE_SIZE")
    args = parser.parse_args()
    built = []
    for text in args.specs:
        head_dim, ratio, page = (int(v) for v in text.split(":"))
        spec = gen_xqa_module(torch.bfloat16, torch.float8_e4m3fn, page, head_dim, ratio, False, torch.bfloat16, 1)
        start = time.perf_counter()
        spec.build(verbose=False)
        seconds = time.perf_counter() - start
        target = args.out / "aot" / spec.name / f"{spec.name}.so"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(spec.jit_library_path, target)
        tvm_ffi.load_module(str(target))  # every symbol resolves (the driver's against the build's libcuda stub)
        digest = hashlib.sha256(target.read_bytes()).hexdigest()
        built.append({"name": spec.name, "head_dim": head_dim, "head_group_ratio": ratio, "page_size": page,
                      "bytes": target.stat().st_size, "sha256": digest, "build_s": round(seconds, 1)})  # fmt: skip
        print(f"built {spec.name} ({target.stat().st_size} bytes, {seconds:.1f} s)")
    manifest = {"flashinfer": flashinfer_version, "arch": "9.0a", "input": "bf16", "kv_cache": "e4m3", "output": "bf16", "modules": built}
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
