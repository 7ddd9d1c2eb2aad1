"""TRL 1.16's GRPOTrainer building its colocate engine in the bitwise mode, run in a process of its
own by tests/trl_checks.py (TRL's colocate engine sets up a torch distributed world in the process
that builds it): `python tests/trl_bitwise_engine_run.py OUT.json`.

`benchmarks/trl_scorer.TrlGRPOScorer` with `colocate_engine` converts a tiny Llama, patches TRL's
log-prob code and its engine (`patch_trl_engine`), and builds TRL's `GRPOTrainer`, whose own
`_init_vllm` starts the engine with TRL's own settings. On CPU the engine refuses the bitwise mode
at start; OUT records the problems it listed, so the check can see that none is one of TRL's
settings.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.trl_scorer import TrlGRPOScorer
from fp8_align import FP8Config
from fp8_align.vllm_plugin.on_policy import BitwiseModeError
from tests.model_factory import make_tiny_llama, make_tiny_tokenizer


def main(out_path: str) -> None:
    with tempfile.TemporaryDirectory(prefix="fp8_align_trl_bitwise_") as work:
        build_trainer(Path(work), out_path)


def build_trainer(work: Path, out_path: str) -> None:
    path = make_tiny_llama(work / "model")
    tokenizer = AutoTokenizer.from_pretrained(make_tiny_tokenizer(path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    engine = {"vllm_gpu_memory_utilization": 0.25, "vllm_max_model_length": 256, "per_device_train_batch_size": 4}
    try:
        TrlGRPOScorer(model, FP8Config(on_policy="bitwise", precision="fp8"), tokenizer, 1.0, colocate_engine=engine)
    except BitwiseModeError as error:
        problems = [line[4:] for line in str(error).splitlines() if line.startswith("  - ")]
        Path(out_path).write_text(json.dumps({"problems": problems}))
        return
    Path(out_path).write_text(json.dumps({"problems": None}))  # the engine started


if __name__ == "__main__":
    main(sys.argv[1])
