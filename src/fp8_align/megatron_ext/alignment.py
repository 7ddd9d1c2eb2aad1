"""Does the training side quantize the weights exactly as the generation side does?

`alignment_report` quantizes each decoder-layer weight matrix twice: as TransformerEngine's
blockwise recipe will during training (TE's own `Float8BlockQuantizer` where TE and CUDA are
available, `te_emulation` otherwise) and as generation does
(`fp8_align.quant.quantize_weight_blockwise` with the config's pow2 flag and `scale_rule`), then
reports per weight how many E4M3 codes and block scales agree bit for bit. Routed experts are compared per expert and projection
(`weight_matrices`); which matrices are FP8 at all (routers and BF16 layers are not) is
`fp8_align.layer_selection.decide_layer`, the rule the generation side applies.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Literal

import torch

from fp8_align.config import FP8Config, FP8ConfigError
from fp8_align.layer_selection import LayerDecision, decide_layer
from fp8_align.megatron_ext.te_emulation import TE_BLOCK_LEN, te_pow2_scales_from_env, te_quantize_weight_2d
from fp8_align.megatron_ext.validation import TrainingSetupError
from fp8_align.megatron_ext.weight_matrices import WeightMatrix, decoder_matrices, num_experts_in
from fp8_align.quant import quantize_weight_blockwise
from fp8_align.rounding import DEFAULT_SCALE_RULE, ScaleRule

TrainingQuantizerChoice = Literal["auto", "transformer_engine", "emulation"]


@dataclasses.dataclass(frozen=True)
class _TrainingQuantizer:
    """A training-side weight quantizer: quantize(w [N, K], pow2, amax_epsilon) -> (codes, scale_inv)."""

    description: str
    default_pow2_scales: bool  # what TE's recipe uses in this process
    amax_epsilon: float
    quantize: Callable[[torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]]


@dataclasses.dataclass(frozen=True)
class LayerAlignment:
    """Agreement for one weight matrix [N, K]. The three numbers are None when it stays BF16.

    name: the state-dict name; one expert's matrix of a fused tensor adds `[<expert>]`, a stacked
        gate/up half adds `[gate]` or `[up]`.
    codes_equal: fraction of the N*K E4M3 codes that are bitwise equal.
    scales_equal: fraction of the ceil(N/128)*ceil(K/128) FP32 block scales that are bitwise equal.
    max_scale_rel_diff: max over blocks of |s_train - s_gen| / s_gen (dimensionless).
    expert_index: the routed expert (as numbered in the name), None for other weights.
    reason: `layer_selection`'s reason for FP8 or BF16 (e.g. "MoE router (BF16 on both sides)").
    """

    name: str
    shape: tuple[int, int]
    layer_index: int
    kept_in_bf16: bool
    codes_equal: float | None
    scales_equal: float | None
    max_scale_rel_diff: float | None
    expert_index: int | None = None
    reason: str = ""

    @property
    def num_codes(self) -> int:
        """Number of weight elements."""
        return self.shape[0] * self.shape[1]

    @property
    def num_scales(self) -> int:
        """Number of 128x128 block scales."""
        return math.ceil(self.shape[0] / TE_BLOCK_LEN) * math.ceil(self.shape[1] / TE_BLOCK_LEN)


@dataclasses.dataclass(frozen=True)
class AlignmentReport:
    """Per-weight agreement plus the summary over every compared weight.

    training_quantizer: which implementation produced the training-side codes.
    training_pow2_scales / generation_pow2_scales: the weight-scale rounding each side used.
    skipped: names that are not weight matrices inside a decoder layer (embeddings, norms, lm_head).
    generation_scale_rule: the generation side's `FP8Config.scale_rule`.
    """

    layers: tuple[LayerAlignment, ...]
    training_quantizer: str
    training_pow2_scales: bool
    generation_pow2_scales: bool
    skipped: tuple[str, ...]
    generation_scale_rule: ScaleRule = DEFAULT_SCALE_RULE

    @property
    def compared(self) -> tuple[LayerAlignment, ...]:
        """The weights quantized on both sides (not kept in BF16)."""
        return tuple(layer for layer in self.layers if not layer.kept_in_bf16)

    @property
    def experts(self) -> tuple[LayerAlignment, ...]:
        """The routed-expert matrices (compared or BF16)."""
        return tuple(layer for layer in self.layers if layer.expert_index is not None)

    @property
    def codes_equal(self) -> float | None:
        """Fraction of all compared codes that are bitwise equal; None when nothing was compared."""
        return _weighted_mean([(layer.codes_equal, layer.num_codes) for layer in self.compared])

    @property
    def scales_equal(self) -> float | None:
        """Fraction of all compared block scales that are bitwise equal; None when nothing was compared."""
        return _weighted_mean([(layer.scales_equal, layer.num_scales) for layer in self.compared])

    @property
    def max_scale_rel_diff(self) -> float | None:
        """Largest relative scale difference over all compared weights; None when nothing was compared."""
        diffs = [layer.max_scale_rel_diff for layer in self.compared]
        return max(diffs) if diffs else None

    @property
    def bitwise_aligned(self) -> bool:
        """Every compared code and scale is bitwise equal (and at least one weight was compared)."""
        return self.codes_equal == 1.0 and self.scales_equal == 1.0

    def to_markdown(self) -> str:
        """A Markdown section: settings, summary line and one table row per weight."""
        expert_matrices = sum(layer.expert_index is not None for layer in self.compared)
        lines = [
            "## FP8 weight alignment: training vs generation",
            "",
            f"- training side: {self.training_quantizer}, {_rounding(self.training_pow2_scales)} scales",
            (
                f"- generation side: fp8_align.quant.quantize_weight_blockwise, "
                f"{_rounding(self.generation_pow2_scales)} scales, scale rule {self.generation_scale_rule}"
            ),
            (
                f"- {len(self.compared)} weights compared ({expert_matrices} of them routed-expert matrices), "
                f"{len(self.layers) - len(self.compared)} kept in BF16, "
                f"{len(self.skipped)} skipped (not weight matrices of decoder layers)"
            ),
        ]
        bf16_reasons = Counter(layer.reason for layer in self.layers if layer.kept_in_bf16)
        if bf16_reasons:
            lines.append("- BF16 by reason: " + ", ".join(f"{why}: {n}" for why, n in sorted(bf16_reasons.items())))
        if self.compared:
            lines.append(
                f"- **codes equal {self.codes_equal:.4%}, scales equal {self.scales_equal:.4%}, "
                f"max scale rel diff {self.max_scale_rel_diff:.3g}**"
            )
        lines += [
            "",
            "| weight | shape | expert | codes equal | scales equal | max scale rel diff |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for layer in self.layers:
            shape = f"{layer.shape[0]}x{layer.shape[1]}"
            expert = "" if layer.expert_index is None else layer.expert_index
            if layer.kept_in_bf16:
                lines.append(f"| {layer.name} | {shape} | {expert} | BF16 layer, not compared: {layer.reason} | | |")
            else:
                lines.append(
                    f"| {layer.name} | {shape} | {expert} | {layer.codes_equal:.4%} | {layer.scales_equal:.4%} "
                    f"| {layer.max_scale_rel_diff:.3g} |"
                )
        return "\n".join(lines) + "\n"


def alignment_report(
    weights: Mapping[str, torch.Tensor],
    cfg: FP8Config,
    *,
    num_layers: int | None = None,
    num_experts: int | None = None,
    gated_linear_unit: bool = True,
    training_quantizer: TrainingQuantizerChoice = "auto",
    training_pow2_scales: bool | None = None,
) -> AlignmentReport:
    """Compare training-side and generation-side block-FP8 quantization of the same weights.

    Args:
        weights: name -> tensor (HF or Megatron names). Inside decoder layers (`layers.<i>.`),
            2-D tensors and fused 3-D expert tensors are split into matrices
            (`weight_matrices.decoder_matrices`); everything else is skipped.
        cfg: the shared config; must train with the blockwise recipe and generate in FP8.
        num_layers: the model's decoder layers, for the BF16 last layers; default: one more than
            the largest layer index among the names.
        num_experts: routed experts per MoE layer, for recognising routers (output size = expert
            count, or 1 for a shared-expert gate); default: one more than the largest expert index
            among the names (pass it for an expert-parallel shard). None with no experts: dense.
        gated_linear_unit: Megatron expert linear_fc1 tensors hold [gate; up] (SwiGLU experts).
        training_quantizer: "transformer_engine" (needs TE and CUDA, else raises), "emulation"
            (`te_emulation`), or "auto" (TE when both are available, else the emulation).
        training_pow2_scales: the training-side rounding; default: what TE's recipe uses in this
            process (NVTE_FP8_BLOCK_SCALING_FP32_SCALES).
    Returns:
        AlignmentReport with one LayerAlignment per matrix, in name order. Matrices that
        `layer_selection.decide_layer` keeps in BF16 (layers the config keeps, routers, K not a
        multiple of 16, outside the text decoder) are listed with their reason, not compared.
    """
    if cfg.precision != "fp8" or cfg.fp8 is None or cfg.fp8_recipe != "blockwise":
        raise FP8ConfigError(
            "alignment_report compares blockwise FP8 on both sides; cfg has "
            f"precision={cfg.precision!r}, fp8={cfg.fp8!r}, fp8_recipe={cfg.fp8_recipe!r}"
        )
    matrices, skipped = decoder_matrices(weights, gated_linear_unit)
    if not matrices:
        raise ValueError("no weight matrices inside decoder layers ('...layers.<i>....') among the given names")
    depth = 1 + max(matrix.layer_index for matrix in matrices) if num_layers is None else num_layers
    experts = num_experts_in(matrices) if num_experts is None else num_experts
    trainer = _training_quantizer(training_quantizer)
    pow2 = trainer.default_pow2_scales if training_pow2_scales is None else training_pow2_scales
    layers = tuple(_compare(matrix, _decide(matrix, depth, experts, cfg), trainer, pow2, cfg) for matrix in matrices)
    return AlignmentReport(
        layers, trainer.description, pow2, cfg.use_weight_pow2_scale, tuple(skipped), cfg.scale_rule
    )


def _decide(matrix: WeightMatrix, depth: int, num_experts: int | None, cfg: FP8Config) -> LayerDecision:
    """The shared FP8/BF16 rule for `matrix` [N, K]: output size N, input size K."""
    rows, cols = matrix.weight.shape
    return decide_layer(
        matrix.module, depth, cfg, kind=matrix.kind, output_size=rows, input_size=cols, num_experts=num_experts
    )


def _compare(
    matrix: WeightMatrix, decision: LayerDecision, trainer: _TrainingQuantizer, pow2: bool, cfg: FP8Config
) -> LayerAlignment:
    """Quantize `matrix` on both sides (when `decision` says FP8) and measure the agreement."""
    weight = matrix.weight
    agreement: tuple[float | None, float | None, float | None] = (None, None, None)
    if decision.fp8:
        train_codes, train_scales = trainer.quantize(weight, pow2, trainer.amax_epsilon)
        gen_codes, gen_scales = quantize_weight_blockwise(
            weight, cfg.weight_block_size, cfg.use_weight_pow2_scale, scale_rule=cfg.scale_rule
        )
        agreement = _agreement(
            train_codes.to(gen_codes.device), train_scales.to(gen_scales.device), gen_codes, gen_scales
        )
    return LayerAlignment(
        matrix.name,
        tuple(weight.shape),
        matrix.layer_index,
        not decision.fp8,
        *agreement,
        expert_index=matrix.expert,
        reason=decision.reason,
    )


def _agreement(
    train_codes: torch.Tensor, train_scales: torch.Tensor, gen_codes: torch.Tensor, gen_scales: torch.Tensor
) -> tuple[float, float, float]:
    codes_equal = (train_codes.view(torch.uint8) == gen_codes.view(torch.uint8)).double().mean().item()
    scales_equal = (train_scales == gen_scales).double().mean().item()
    rel_diff = ((train_scales.double() - gen_scales.double()).abs() / gen_scales.double()).max().item()
    return codes_equal, scales_equal, rel_diff


def _training_quantizer(choice: TrainingQuantizerChoice) -> _TrainingQuantizer:
    if choice not in ("auto", "transformer_engine", "emulation"):
        raise ValueError(f"training_quantizer must be 'auto', 'transformer_engine' or 'emulation', got {choice!r}")
    te_usable = importlib.util.find_spec("transformer_engine") is not None and torch.cuda.is_available()
    if choice == "transformer_engine" and not te_usable:
        raise TrainingSetupError(
            "training_quantizer='transformer_engine' needs TransformerEngine and a CUDA GPU; "
            "use 'emulation' (fp8_align.megatron_ext.te_emulation) on this machine"
        )
    if choice == "emulation" or not te_usable:
        return _TrainingQuantizer(
            "te_emulation (pure-torch emulation of TE's Float8BlockQuantizer)",
            te_pow2_scales_from_env(),
            0.0,  # TE's Float8BlockScaling QParams.amax_epsilon
            te_quantize_weight_2d,
        )
    return _transformer_engine_quantizer()


def transformer_engine_quantize(
    x: torch.Tensor, pow2: bool, block_scaling_dim: int, amax_epsilon: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """TE's own `Float8BlockQuantizer` (rowwise, E4M3) on a 2-D tensor, moved to CUDA.

    Args:
        x: [N, K] bf16/fp16/fp32. pow2: TE's `force_pow_2_scales`.
        block_scaling_dim: 2 for 128x128 weight blocks, 1 for 1x128 activation groups.
    Returns:
        (codes [N, K] float8_e4m3fn, scale_inv float32 in the logical layout of `fp8_align.quant`:
        [ceil(N/128), ceil(K/128)] for blocks, [N, ceil(K/128)] for groups; TE's own storage is
        padded, and transposed for 1x128 groups).
    """
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    quantizer = Float8BlockQuantizer(
        fp8_dtype=tex.DType.kFloat8E4M3, rowwise=True, columnwise=False, amax_epsilon=amax_epsilon,
        force_pow_2_scales=pow2, block_scaling_dim=block_scaling_dim,
    )  # fmt: skip
    with torch.no_grad():
        quantized = quantizer(x.to("cuda"))
    n, k = x.shape
    codes = quantized._rowwise_data.view(torch.float8_e4m3fn)
    if block_scaling_dim == 2:
        return codes, quantized._rowwise_scale_inv[: math.ceil(n / TE_BLOCK_LEN), : math.ceil(k / TE_BLOCK_LEN)]
    return codes, quantized._rowwise_scale_inv[: math.ceil(k / TE_BLOCK_LEN), :n].t()


def _transformer_engine_quantizer() -> _TrainingQuantizer:
    import transformer_engine
    from transformer_engine.common.recipe import Float8BlockScaling

    qparams = Float8BlockScaling.fp8_quant_fwd_weight

    def quantize(weight: torch.Tensor, pow2: bool, amax_epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
        return transformer_engine_quantize(weight, pow2, 2, amax_epsilon)

    return _TrainingQuantizer(
        f"TransformerEngine {transformer_engine.__version__} Float8BlockQuantizer (128x128 blocks)",
        bool(qparams.power_2_scale),
        float(qparams.amax_epsilon),
        quantize,
    )


def _weighted_mean(values: list[tuple[float, int]]) -> float | None:
    total = sum(weight for _, weight in values)
    if total == 0:
        return None
    return sum(value * weight for value, weight in values) / total


def _rounding(pow2: bool) -> str:
    return "power-of-two" if pow2 else "FP32"
