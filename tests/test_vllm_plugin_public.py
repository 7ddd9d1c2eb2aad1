"""The short public surface of `fp8_align.vllm_plugin`: the RL loop's calls load on first use."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import fp8_align.vllm_plugin as plugin

HOMES = {
    "refit_weights": "fp8_align.vllm_plugin.refit",
    "push_kv_scales": "fp8_align.vllm_plugin.kv.scales",
    "calibrate_kv_scales": "fp8_align.vllm_plugin.kv.calibration",
}

_FRESH_IMPORT = """
import sys
import fp8_align.vllm_plugin
homes = {homes!r}
loaded = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm.") or m in homes)
assert not loaded, loaded
from fp8_align.vllm_plugin import calibrate_kv_scales, push_kv_scales, refit_weights
assert all(m in sys.modules for m in homes), sorted(sys.modules)
"""


def test_importing_the_plugin_loads_neither_vllm_nor_the_rl_calls() -> None:
    """A fresh interpreter: `import fp8_align.vllm_plugin` (what vLLM's entry point does) leaves
    vLLM and the three calls' modules unloaded; importing the names loads their modules."""
    code = _FRESH_IMPORT.format(homes=sorted(HOMES.values()))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("name", sorted(HOMES))
def test_short_name_is_the_deep_object(name: str) -> None:
    assert getattr(plugin, name) is getattr(importlib.import_module(HOMES[name]), name)
    assert name in plugin.__all__ and name in dir(plugin)


def test_unknown_name_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'refit'"):
        plugin.__getattr__("refit")
