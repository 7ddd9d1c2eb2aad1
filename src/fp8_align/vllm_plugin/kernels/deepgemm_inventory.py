"""Which DeepGEMM kernels an fp8_align engine needs, and whether a JIT cache already holds them.

An engine whose fp8_align layers run on DeepGEMM warms up one kernel per ([N, K], M) at start
(`DeepGemmBlockFp8Kernel.warm_up`, the M values vLLM's VLLM_DEEP_GEMM_WARMUP picks up to
max_num_batched_tokens). `dense_linear_shapes` lists the [N, K] of a dense decoder's FP8 linears
per tensor-parallel rank from its Hugging Face config.

DeepGEMM keys each cached kernel by its generated source, which fp8_align cannot compute ahead. So
whoever compiles a shape's whole warm-up set into a cache directory (`fp8-align prepare-deepgemm`,
or an engine once its warm-up of that shape finished) leaves a mark there:
`<cache>/fp8_align_prepared/<N>x<K>_<max tokens>_<setup>.json`, `<setup>` a digest of what the
kernels and the M values depend on (GPU model, vLLM version, VLLM_DEEP_GEMM_WARMUP; `cache_setup`).
A shape is ready for an engine when a mark of the engine's setup for at least its
max_num_batched_tokens is there (the M values for fewer tokens are a subset). `Warmup` records
what this process's warm-ups found, for the engine's summary line (`vllm_plugin.engine_plan`).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8_align.vllm_plugin.kernels.base import LayerShape

#: vLLM 0.22's max_num_batched_tokens for `LLM(...)` on GPUs of 70 GiB or more (H100, H200).
DEFAULT_MAX_BATCHED_TOKENS = 16384
#: The environment variable DeepGEMM reads its JIT cache directory from.
JIT_CACHE_ENV_VAR = "DG_JIT_CACHE_DIR"
#: Sub-directory of a DeepGEMM JIT cache holding fp8_align's marks.
MARKS_DIR = "fp8_align_prepared"
#: Config keys of architectures whose FP8 layers `dense_linear_shapes` does not describe.
_NOT_DENSE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "kv_lora_rank", "q_lora_rank")


@dataclass(frozen=True)
class LinearShape:
    """One FP8 linear per tensor-parallel rank: [n, k] weight codes made of stacked `shards`."""

    name: str
    n: int
    k: int
    shards: tuple[int, ...]

    @property
    def runs_on_deepgemm(self) -> bool:
        """K and every shard are multiples of 128 (`LayerShape.full_blocks`, the rule of `DeepGemmBlockFp8Kernel`)."""
        return LayerShape(self.n, self.k, self.shards).full_blocks


def dense_linear_shapes(config: Mapping[str, Any], tensor_parallel_size: int = 1) -> list[LinearShape]:
    """The merged linears of a dense decoder layer (Llama / Qwen / Mistral family) on one rank:
    qkv_proj, o_proj, gate_up_proj, down_proj, as vLLM stacks and splits them.

    `config` is the checkpoint's config.json. Mixture-of-Experts and MLA configs are refused: their
    expert GEMMs are not these kernels; pass their shapes explicitly (`--shapes`).
    """
    found = [key for key in _NOT_DENSE_KEYS if config.get(key)]
    if found:
        raise ValueError(f"{config.get('model_type', 'this model')} is not a dense decoder ({', '.join(found)} set): pass --shapes NxK[,NxK...]")
    tp = tensor_parallel_size
    hidden, inter, heads = config["hidden_size"], config["intermediate_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    if heads % tp or inter % tp or (kv_heads % tp and tp % kv_heads):
        raise ValueError(f"tensor_parallel_size {tp} does not split {heads} heads / {kv_heads} KV heads / intermediate {inter}")
    q, kv = heads // tp * head_dim, max(kv_heads // tp, 1) * head_dim
    shapes = [
        LinearShape("qkv_proj", q + 2 * kv, hidden, (q, kv, kv)),
        LinearShape("o_proj", hidden, q, (hidden,)),
        LinearShape("gate_up_proj", 2 * inter // tp, hidden, (inter // tp, inter // tp)),
        LinearShape("down_proj", hidden, inter // tp, (hidden,)),
    ]
    return list({(s.n, s.k): s for s in shapes}.values())


def parse_shapes(text: str) -> list[LinearShape]:
    """"6144x4096,4096x4096" -> one single-shard LinearShape per NxK."""
    shapes = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        n, sep, k = item.lower().partition("x")
        if not sep or not n.isdigit() or not k.isdigit():
            raise ValueError(f"shape {item!r} is not NxK (e.g. 6144x4096)")
        shapes.append(LinearShape(item, int(n), int(k), (int(n),)))
    if not shapes:
        raise ValueError("no shapes given")
    return shapes


def jit_cache_dir(vllm_cache_root: str | os.PathLike[str]) -> Path:
    """DeepGEMM's JIT cache directory as vLLM sets it up: DG_JIT_CACHE_DIR when set, else
    `<vllm_cache_root>/deep_gemm` (vLLM's `utils.deep_gemm._lazy_init`, 0.20-0.32), resolved."""
    return Path(os.environ.get(JIT_CACHE_ENV_VAR) or Path(vllm_cache_root) / "deep_gemm").resolve()


def cache_setup(gpu_name: str, vllm_version: str | None, warmup_mode: str) -> str:
    """12 hex digits naming what a shape's cached kernels and warm-up M values depend on: the GPU
    model (its SM count enters the M values and the kernels), the vLLM release (its DeepGEMM) and
    VLLM_DEEP_GEMM_WARMUP ("relax" or "full")."""
    text = json.dumps({"gpu": gpu_name, "vllm": vllm_version, "warmup": warmup_mode}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def mark_prepared(cache_dir: Path, setup: str, n: int, k: int, max_tokens: int) -> Path:
    """Record in `cache_dir` that the warm-up kernels of [n, k] up to `max_tokens` tokens are
    compiled there for `setup`; returns the mark's path. Written whole (temporary file, then
    rename), so tensor-parallel ranks marking the same shape at once leave one valid mark."""
    marks = cache_dir / MARKS_DIR
    marks.mkdir(parents=True, exist_ok=True)
    path = marks / f"{n}x{k}_{max_tokens}_{setup}.json"
    temporary = marks / f".{path.name}.{os.getpid()}"
    temporary.write_text(json.dumps({"n": n, "k": k, "max_tokens": max_tokens, "setup": setup}) + "\n")
    os.replace(temporary, path)
    return path


def is_prepared(cache_dir: Path, setup: str, n: int, k: int, max_tokens: int) -> bool:
    """True when `cache_dir` holds a mark of `setup` for [n, k] with at least `max_tokens` tokens."""
    marks = cache_dir / MARKS_DIR
    if not marks.is_dir():
        return False
    for path in marks.glob(f"{n}x{k}_*_{setup}.json"):
        tokens = path.stem.split("_")[1]
        if tokens.isdigit() and int(tokens) >= max_tokens:
            return True
    return False


@dataclass(frozen=True)
class Warmup:
    """One [n, k] DeepGEMM warm-up of this process: `kernels` M values run in `seconds`, with the
    JIT cache `cache_dir` marked `prepared` for them beforehand or not (then they were compiled)."""

    n: int
    k: int
    kernels: int
    prepared: bool
    seconds: float
    cache_dir: str


_warmups: dict[tuple[int, int], Warmup] = {}


def note_warmup(warmup: Warmup) -> None:
    """Record a finished warm-up of this process."""
    _warmups[(warmup.n, warmup.k)] = warmup


def was_warmed_up(n: int, k: int) -> bool:
    """True when [n, k] was warmed up in this process already (its kernels are loaded)."""
    return (n, k) in _warmups


def warmups() -> list[Warmup]:
    """This process's warm-ups, in the order they ran."""
    return list(_warmups.values())
