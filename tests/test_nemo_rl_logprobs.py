"""NeMo RL's DTensor policy on a converted model (CPU): tests/nemo_rl_dtensor_checks.py, run by
pytest in a process of its own.

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
CHECKS = ROOT / "tests" / "nemo_rl_dtensor_checks.py"
#: The checks the file holds (two temperatures, the policy steps, the patch's contract).
EXPECTED_PASSED = 4


@pytest.mark.skipif(not (SITE / "transformers").is_dir(), reason="scripts/setup_cpu_env.sh installs NeMo RL's pins into .cache/nemo_rl_site")
def test_nemo_rl_dtensor_policy_checks_pass_on_its_own_pins() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(SITE), str(VENDORED), str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-o", "addopts=", str(CHECKS)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    report = run.stdout + run.stderr
    print(report[-3000:])
    assert run.returncode == 0, report[-6000:]
    assert f"{EXPECTED_PASSED} passed" in report, report[-3000:]
