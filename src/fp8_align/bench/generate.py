"""Run one vLLM engine in a fresh process and save what it generated.

`run_generation(spec, out_path)` starts `python -m fp8_align.bench.generate SPEC OUT` so each
engine gets a clean process (vLLM spawns its workers from there). The spec is a JSON-able dict:

    model: str                      path of an HF checkpoint (BF16)
    fp8_config: dict | None         FP8Config fields; None runs stock BF16 vLLM
    prompts: list[list[int]]        prompt token ids
    max_tokens: int, temperature: float, seed: int, logprobs: int (default 0: sampled token only)
    inspect: bool                   also return each linear layer's state from the worker
    llm_kwargs: dict                extra `vllm.LLM` keyword arguments
    env: dict[str, str]             extra environment for the engine process

The output (torch.save) holds `outputs` (per prompt: `token_ids`, `logprobs` of the sampled
tokens), `layers` (when inspect), `vllm_version`, `engine_start_s`, `generate_s`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

DEFAULT_LLM_KWARGS = {"gpu_memory_utilization": 0.1, "dtype": "bfloat16", "seed": 0}


class GenerationError(RuntimeError):
    """The engine process failed; the message carries the tail of its log."""


def run_generation(spec: dict[str, Any], out_path: str | os.PathLike[str], timeout_s: float = 900) -> dict[str, Any]:
    """Run `spec` in a new process and return the loaded output dict (see module docstring)."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path = out_path.with_suffix(".spec.json")
    log_path = out_path.with_suffix(".log")
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", **spec.get("env", {})}
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "fp8_align.bench.generate", str(spec_path), str(out_path)],
            stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s, check=False,
        )
    if proc.returncode != 0 or not out_path.exists():
        tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-40:])
        raise GenerationError(f"vLLM engine process exited with {proc.returncode}; log {log_path}:\n{tail}")
    return torch.load(out_path, weights_only=False)


def _generate(spec: dict[str, Any]) -> dict[str, Any]:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from fp8_align.config import FP8Config
    from fp8_align.vllm_plugin import engine_kwargs

    kwargs: dict[str, Any] = {**DEFAULT_LLM_KWARGS, "skip_tokenizer_init": True, **spec.get("llm_kwargs", {})}
    if spec.get("fp8_config") is not None:
        kwargs.update(engine_kwargs(FP8Config.from_kwargs(**spec["fp8_config"])))
    start = time.perf_counter()
    llm = LLM(model=spec["model"], **kwargs)
    engine_start_s = time.perf_counter() - start
    params = SamplingParams(
        max_tokens=int(spec.get("max_tokens", 16)),
        temperature=float(spec.get("temperature", 0.0)),
        seed=int(spec.get("seed", 0)),
        logprobs=int(spec.get("logprobs", 0)),
        ignore_eos=bool(spec.get("ignore_eos", True)),
    )
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in spec["prompts"]]
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - start
    outputs = []
    for prompt, result in zip(spec["prompts"], results):
        completion = result.outputs[0]
        token_ids = list(completion.token_ids)
        logprobs = [step[tok].logprob for tok, step in zip(token_ids, completion.logprobs)]
        outputs.append({"prompt_ids": list(prompt), "token_ids": token_ids, "logprobs": logprobs})
    out: dict[str, Any] = {
        "outputs": outputs,
        "vllm_version": vllm.__version__,
        "engine_start_s": engine_start_s,
        "generate_s": generate_s,
    }
    if spec.get("inspect"):
        from fp8_align.vllm_plugin.inspection import linear_layer_state

        out["layers"] = llm.apply_model(linear_layer_state)[0]
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m fp8_align.bench.generate SPEC.json OUT.pt`."""
    spec_path, out_path = (argv if argv is not None else sys.argv[1:])[:2]
    result = _generate(json.loads(Path(spec_path).read_text()))
    torch.save(result, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
