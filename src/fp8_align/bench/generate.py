"""Run one vLLM engine in a fresh process and save what it generated.

`run_generation(spec, out_path)` starts `python -m fp8_align.bench.generate SPEC OUT` so each
engine gets a clean process (vLLM spawns its workers from there); `start_generation` does the
same without waiting, so several engines can run side by side. The spec is a JSON-able dict:

    model: str                      path of an HF checkpoint (BF16)
    fp8_config: dict | None         FP8Config fields; None runs stock BF16 vLLM
    prompts: list[list[int]]        prompt token ids
    max_tokens: int, logprobs: int (default 0: sampled token only), ignore_eos: bool (default True)
    stop_token_ids: list[int]       extra tokens that end a completion (default none)
    temperature: float, seed: int   the sampling setting when `sampling` is absent
    sampling: list[dict]            several settings in one engine run, each
                                    {"name": str, "temperature": float, "seed": int}; every
                                    prompt is generated once per setting, all in one batch
    inspect: bool                   also return each linear layer's state from the worker
    report_kernels: bool            also return each linear layer's method and kernel (no tensors)
    llm_kwargs: dict                extra `vllm.LLM` keyword arguments
    env: dict[str, str]             extra environment for the engine process

The output (torch.save) holds `outputs_by_sampling` ({setting name: per prompt `prompt_ids`,
`token_ids`, `logprobs` of the sampled tokens}), `outputs` (the outputs of the top-level
setting, present when `sampling` is absent), `layers` (when inspect), `linear_kernels` (when
report_kernels), `logprobs_mode`, `vllm_version`, `engine_start_s`, `generate_s`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

DEFAULT_LLM_KWARGS = {"gpu_memory_utilization": 0.1, "dtype": "bfloat16", "seed": 0}
#: Name of the single sampling setting built from the top-level `temperature` and `seed`.
DEFAULT_SAMPLING_NAME = "default"


class GenerationError(RuntimeError):
    """The engine process failed; the message carries the tail of its log."""


@dataclass
class GenerationJob:
    """An engine process started by `start_generation`; `wait()` returns its output dict."""

    process: subprocess.Popen[bytes]
    out_path: Path
    log_path: Path
    log_file: IO[str]
    timeout_s: float

    def wait(self) -> dict[str, Any]:
        """Block until the engine process exits; raise GenerationError on failure."""
        try:
            returncode = self.process.wait(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise GenerationError(f"vLLM engine process ran longer than {self.timeout_s:.0f} s; log {self.log_path}") from None
        finally:
            self.log_file.close()
        if returncode != 0 or not self.out_path.exists():
            tail = "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-40:])
            raise GenerationError(f"vLLM engine process exited with {returncode}; log {self.log_path}:\n{tail}")
        return torch.load(self.out_path, weights_only=False)


def start_generation(spec: dict[str, Any], out_path: str | os.PathLike[str], timeout_s: float = 900) -> GenerationJob:
    """Start `spec` in a new process (log next to `out_path`, suffix .log) and return at once."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.unlink(missing_ok=True)
    spec_path = out_path.with_suffix(".spec.json")
    log_path = out_path.with_suffix(".log")
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", **spec.get("env", {})}
    log_file = open(log_path, "w")
    process = subprocess.Popen(
        [sys.executable, "-m", "fp8_align.bench.generate", str(spec_path), str(out_path)],
        stdout=log_file, stderr=subprocess.STDOUT, env=env,
    )
    return GenerationJob(process, out_path, log_path, log_file, timeout_s)


def run_generation(spec: dict[str, Any], out_path: str | os.PathLike[str], timeout_s: float = 900) -> dict[str, Any]:
    """Run `spec` in a new process and return the loaded output dict (see module docstring)."""
    return start_generation(spec, out_path, timeout_s).wait()


def linear_kernels(model: torch.nn.Module) -> dict[str, dict[str, str]]:
    """Per linear module name: its quant method class and, for fp8_align layers, the GEMM kernel.

    Runs inside the vLLM worker (passed to `LLM.apply_model`); returns names only, no tensors.
    """
    kernels: dict[str, dict[str, str]] = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(module, "input_size"):
            continue
        kernel = getattr(module, "fp8_align_kernel", None)
        kernels[name] = {"method": type(method).__name__, "kernel": kernel.name if kernel is not None else "bf16"}
    return kernels


def _sampling_settings(spec: dict[str, Any]) -> list[dict[str, Any]]:
    if "sampling" in spec:
        names = [s["name"] for s in spec["sampling"]]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"spec['sampling'] needs at least one setting and unique names, got {names}")
        return list(spec["sampling"])
    return [{"name": DEFAULT_SAMPLING_NAME, "temperature": spec.get("temperature", 0.0), "seed": spec.get("seed", 0)}]


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
    settings = _sampling_settings(spec)
    prompts, params = [], []
    for setting in settings:
        sampling_params = SamplingParams(
            max_tokens=int(spec.get("max_tokens", 16)),
            temperature=float(setting["temperature"]),
            seed=int(setting["seed"]),
            logprobs=int(spec.get("logprobs", 0)),
            ignore_eos=bool(spec.get("ignore_eos", True)),
            stop_token_ids=[int(t) for t in spec.get("stop_token_ids", [])],
        )
        prompts += [TokensPrompt(prompt_token_ids=list(p)) for p in spec["prompts"]]
        params += [sampling_params] * len(spec["prompts"])
    start = time.perf_counter()
    results = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - start
    outputs_by_sampling: dict[str, list[dict[str, Any]]] = {s["name"]: [] for s in settings}
    for index, result in enumerate(results):
        completion = result.outputs[0]
        token_ids = list(completion.token_ids)
        logprobs = [step[tok].logprob for tok, step in zip(token_ids, completion.logprobs)]
        setting_index, prompt_index = divmod(index, len(spec["prompts"]))
        outputs_by_sampling[settings[setting_index]["name"]].append(
            {"prompt_ids": list(spec["prompts"][prompt_index]), "token_ids": token_ids, "logprobs": logprobs}
        )
    out: dict[str, Any] = {
        "outputs_by_sampling": outputs_by_sampling,
        "logprobs_mode": str(llm.model_config.logprobs_mode),
        "vllm_version": vllm.__version__,
        "engine_start_s": engine_start_s,
        "generate_s": generate_s,
    }
    if "sampling" not in spec:
        out["outputs"] = outputs_by_sampling[DEFAULT_SAMPLING_NAME]
    if spec.get("inspect"):
        from fp8_align.vllm_plugin.inspection import linear_layer_state

        out["layers"] = llm.apply_model(linear_layer_state)[0]
    if spec.get("report_kernels"):
        # This file runs as __main__; vLLM pickles functions by module name, so pass the copy
        # importable as fp8_align.bench.generate.
        from fp8_align.bench.generate import linear_kernels as importable_linear_kernels

        out["linear_kernels"] = llm.apply_model(importable_linear_kernels)[0]
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m fp8_align.bench.generate SPEC.json OUT.pt`."""
    spec_path, out_path = (argv if argv is not None else sys.argv[1:])[:2]
    result = _generate(json.loads(Path(spec_path).read_text()))
    torch.save(result, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
