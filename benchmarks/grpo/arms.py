"""The arms of the GRPO alignment experiment and the settings every arm of a run shares."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from fp8_align.config import FP8Config


@dataclass(frozen=True)
class Arm:
    """Where FP8 runs in one arm: generation linears (+ KV cache), the training forward, whether
    the loss uses token-level truncated importance sampling (TIS), and whether engine and trainer
    run bit-identical kernels (`FP8Config(on_policy="bitwise")`, CUDA only)."""

    name: str
    label: str
    generation_fp8: bool
    kv_cache_fp8: bool
    training_fp8: bool
    tis: bool
    bitwise: bool = False


ARMS: dict[str, Arm] = {
    arm.name: arm
    for arm in (
        Arm("bf16", "BF16 gen / BF16 train", False, False, False, False),
        Arm("fp8", "FP8 gen / BF16 train", True, False, False, False),
        Arm("fp8_tis", "FP8 gen / BF16 train + TIS", True, False, False, True),
        Arm("fp8_aligned_tis", "FP8 gen / FP8 train + TIS", True, False, True, True),
        Arm("fp8kv_aligned_tis", "FP8 gen + FP8 KV / FP8 train + TIS", True, True, True, True),
        Arm("fp8_bitwise", "FP8 gen / bitwise FP8 train", True, False, True, False, bitwise=True),
        Arm("fp8_bitwise_kv", "FP8 gen + FP8 KV / bitwise FP8 train", True, True, True, False, bitwise=True),
    )
}


def parse_arms(text: str) -> list[Arm]:
    """Comma-separated arm names ("all" = every arm) -> arms; ValueError names the unknown ones."""
    names = list(ARMS) if text == "all" else [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in ARMS]
    if unknown or not names:
        raise ValueError(f"unknown arms {unknown or text!r}; choose from {', '.join(ARMS)} or 'all'")
    return [ARMS[n] for n in names]


@dataclass(frozen=True)
class RunSettings:
    """What every arm of one run shares (same seeds, same data, same hyper-parameters)."""

    seed: int = 0
    steps: int = 100
    prompts_per_step: int = 64
    group_size: int = 8
    max_tokens: int = 24
    temperature: float = 1.0
    lr: float = 1e-5
    clip_eps: float = 0.2
    tis_cap: float = 2.0
    minibatches: int = 2
    grad_clip: float = 1.0
    max_tokens_per_forward: int = 4096
    operand_low: int = 10
    operand_high: int = 99
    validation_fraction: float = 0.25
    validation_size: int = 200
    validate_every: int = 10
    max_seconds: float = 480.0
    device: str = "cuda"
    #: the FP8 recipe of the FP8 arms (generation and, aligned, training); FP32 scales by default
    weight_pow2_scale: bool = False
    activation_pow2_scale: bool = False
    llm_kwargs: dict[str, Any] = field(default_factory=dict)

    def fp8_config(self, arm: Arm) -> FP8Config | None:
        """The engine's FP8Config for `arm` (None: stock BF16 engine)."""
        if not arm.generation_fp8:
            return None
        # CUTLASS/Triton block-FP8 GEMMs: DeepGEMM JIT-compiles for minutes on a cold GPU box; the
        # attention backend's own decode (FA3 on Hopper), as the arms were measured
        return FP8Config(
            use_deep_gemm=False,
            use_weight_pow2_scale=self.weight_pow2_scale,
            use_activation_pow2_scale=self.activation_pow2_scale,
            kv_cache_dtype="fp8" if arm.kv_cache_fp8 else "auto",
            kv_decode_kernel="backend",
            on_policy="bitwise" if arm.bitwise else "off",
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
