"""NeMo RL's own log-prob units on fp8_align's bitwise models (CPU), each check file run by pytest in
a process of its own: its DTensor policy on a converted HF model (tests/nemo_rl_dtensor_checks.py)
and its Megatron policy on a bitwise megatron-core GPTModel (tests/nemo_rl_megatron_checks.py).

NeMo RL 0.6.0 at the vendored commit (7ea279a, tests/third_party/nemo_rl_dtensor) asserts
transformers < 5.12 when its policy package is imported, and its DTensor policy runs on
transformers 5.5.4 (its uv.lock); this venv has a newer one for vLLM 0.32. The checks therefore run
with `.cache/nemo_rl_site` (those pins, scripts/setup_cpu_env.sh) and the vendored tree first on the
path. What they check, and what is stood in for, is in their module docstring.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / ".cache" / "nemo_rl_site"
VENDORED = ROOT / "tests" / "third_party" / "nemo_rl_dtensor"
#: Per check file, the checks it holds: DTensor (two temperatures, the policy steps, the patch's
#: contract), Megatron (two temperatures x two length multiples, the unpatched gap, the contract).
CHECKS = {"nemo_rl_dtensor_checks.py": 4, "nemo_rl_megatron_checks.py": 6}


@pytest.mark.skipif(not (SITE / "transformers").is_dir(), reason="scripts/setup_cpu_env.sh installs NeMo RL's pins into .cache/nemo_rl_site")
@pytest.mark.parametrize("checks", sorted(CHECKS))
def test_nemo_rl_policy_checks_pass_on_its_own_pins(checks: str) -> None:
    # Without this process's torch.distributed rendezvous (a megatron-core test here may have set
    # MASTER_PORT and holds its store there): the child picks a free port of its own.
    inherited = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env = {**inherited, "PYTHONPATH": os.pathsep.join(filter(None, [str(SITE), str(VENDORED), str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-o", "addopts=", str(ROOT / "tests" / checks)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    report = run.stdout + run.stderr
    print(report[-3000:])
    assert run.returncode == 0, report[-6000:]
    assert f"{CHECKS[checks]} passed" in report, report[-3000:]
