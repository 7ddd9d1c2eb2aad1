"""Which layers the recipe runs in FP8: one structural rule for the generation and training sides.

Every linear layer and every routed-expert group inside the text decoder's layers is block FP8,
except:

- MoE routers (a linear whose output size is the expert count, or 1 for a shared-expert gate):
  Megatron never runs its router in FP8, so the generation side keeps them BF16 too;
- the decoder layers the config keeps in BF16 (`num_first_layers_in_bf16`,
  `num_last_layers_in_bf16`), MoE layers included;
- modules whose name contains one of the config's `quantization_ignored_layer_kws` (NeMo RL's
  substring list; a module merged from several checkpoint modules when all of their names do);
- modules outside the text decoder's `layers.<i>` (vision/audio towers, projectors, MTP and
  draft heads, and layers past `num_hidden_layers`);
- shapes no FP8 GEMM takes: K (the input size) not a multiple of 16 (FP8 rows must be 16-byte
  aligned for the tensor-core GEMMs).

No built-in projection-name list: `query_key_value` (GPT-NeoX), `c_attn` (GPT-2), `kv_a_proj_with_mqa`
(MLA) are FP8 because they are linears inside a decoder layer. Each decision carries a reason;
`planned` tells the reasons the recipe chose (precision, config, routers) from the ones it was
forced into (outside the decoder, shape, a module kind it cannot run in FP8), which
`FP8Config(strict=True)` turns into errors.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fp8_align.config import FP8Config, FP8ConfigError

#: The decoder-layer list of a module name: `layers.<i>` (Llama, Qwen, GPT-NeoX, ...), `h.<i>`
#: (GPT-2, Falcon, Bloom), `layer.<i>`.
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|layer)\.(\d+)\.")
#: Module-name parts that mark a container outside the text decoder stack.
NON_DECODER_CONTAINERS = frozenset(
    {"visual", "vision", "vision_tower", "vision_model", "audio", "audio_tower", "multi_modal_projector", "mtp", "draft"}
)
#: FP8 GEMM rows must be 16-byte aligned: K (input features) a multiple of this.
K_ALIGNMENT = 16

REASON_FP8 = "block FP8"
REASON_PRECISION = "precision is bf16"
REASON_CONFIG = "decoder layer kept in BF16 by the config"
REASON_ROUTER = "MoE router (BF16 on both sides)"
REASON_IGNORED_NAME = "name matches quantization_ignored_layer_kws"
REASON_OUTSIDE = "outside the text decoder layers"
REASON_SHAPE = "input size not a multiple of 16"
REASON_UNSUPPORTED = "module kind fp8_align does not run in FP8"
#: Reasons the recipe chooses; any other BF16 reason is unplanned (an error with strict=True).
PLANNED_BF16_REASONS = frozenset({REASON_PRECISION, REASON_CONFIG, REASON_ROUTER, REASON_IGNORED_NAME})


@dataclass(frozen=True)
class LayerDecision:
    """Whether the layer at `prefix` runs in FP8, and why (for logs, reports and strict mode).

    kind: "linear" or "experts" (one routed-expert group of an MoE layer).
    detail: extra words for the log (the sizes behind a shape decision, a module kind)."""

    prefix: str
    kind: str
    fp8: bool
    reason: str
    layer_index: int | None
    detail: str = ""

    @property
    def planned(self) -> bool:
        """True for FP8 and for BF16 the recipe chose; False for BF16 it was forced into."""
        return self.fp8 or self.reason in PLANNED_BF16_REASONS

    def describe(self) -> str:
        """'<prefix> (<kind>): <reason>[: detail]' for log lines and errors."""
        return f"{self.prefix} ({self.kind}): {self.reason}" + (f": {self.detail}" if self.detail else "")


def decoder_layer_index(prefix: str) -> int | None:
    """Decoder layer index in a module name such as 'model.layers.3.mlp.down_proj', or None."""
    match = _LAYER_INDEX.search(prefix)
    return int(match.group(1)) if match else None


def decide_layer(
    prefix: str,
    num_hidden_layers: int,
    cfg: FP8Config,
    *,
    kind: str = "linear",
    output_size: int | None = None,
    input_size: int | None = None,
    num_experts: int | None = None,
    merged_from: Sequence[str] = (),
) -> LayerDecision:
    """Decide FP8 vs BF16 for the linear (kind "linear") or routed-expert group (kind "experts")
    named `prefix` in a text decoder of `num_hidden_layers` layers.

    output_size / input_size: the layer's full output and input features (None: unknown, no
    router or shape check); num_experts: the model's routed-expert count (None: not an MoE);
    merged_from: the full names of the checkpoint modules merged into this one (vLLM's
    `packed_modules_mapping`, e.g. q/k/v_proj for qkv_proj), for `quantization_ignored_layer_kws`.
    Raises FP8ConfigError when the config keeps more BF16 layers than the model has, or when
    `quantization_ignored_layer_kws` matches some but not all of `merged_from`.
    """
    index = decoder_layer_index(prefix)

    def decision(fp8: bool, reason: str, detail: str = "") -> LayerDecision:
        return LayerDecision(prefix, kind, fp8, reason, index, detail)

    if cfg.precision != "fp8":
        return decision(False, REASON_PRECISION)
    container = next((part for part in prefix.split(".") if part in NON_DECODER_CONTAINERS), None)
    if container is not None:
        return decision(False, REASON_OUTSIDE, f"inside '{container}'")
    if index is None or index >= num_hidden_layers:
        where = "no decoder layer index in the name" if index is None else f"layer {index} >= num_hidden_layers {num_hidden_layers}"
        return decision(False, REASON_OUTSIDE, where)
    keyword = ignored_keyword(prefix, cfg.quantization_ignored_layer_kws, merged_from)
    if keyword is not None:
        return decision(False, REASON_IGNORED_NAME, repr(keyword))
    if kind == "linear" and is_router(output_size, num_experts):
        return decision(False, REASON_ROUTER, f"{output_size} outputs")
    if index in cfg.bf16_layer_indices(num_hidden_layers):
        return decision(False, REASON_CONFIG, f"layer {index}")
    if input_size is not None and input_size % K_ALIGNMENT:
        return decision(False, REASON_SHAPE, f"K={input_size}")
    return decision(True, REASON_FP8)


def ignored_keyword(prefix: str, keywords: Sequence[str], merged_from: Sequence[str] = ()) -> str | None:
    """The first of `keywords` found in the module's checkpoint names, or None.

    The names are `merged_from` (the checkpoint modules merged into this one) when given, else
    `prefix` itself; as in NeMo RL, which matches the checkpoint's module names, a keyword counts
    when it is a substring. Raises FP8ConfigError when the keywords match some merged names but not
    all (the merged module is one GEMM, so it cannot keep only part of itself in BF16)."""
    names = list(merged_from) or [prefix]
    found = [next((keyword for keyword in keywords if keyword in name), None) for name in names]
    if all(keyword is None for keyword in found):
        return None
    if any(keyword is None for keyword in found):
        matched = [name for name, keyword in zip(names, found) if keyword is not None]
        raise FP8ConfigError(
            f"quantization_ignored_layer_kws={list(keywords)!r} matches {', '.join(matched)} but not all of "
            f"{', '.join(names)}, which vLLM merges into {prefix} (one GEMM, one precision): "
            "name all of them or none."
        )
    return found[0]


def is_router(output_size: int | None, num_experts: int | None) -> bool:
    """A linear inside an MoE decoder whose outputs are one logit per routed expert (the router),
    or a single gate value (a shared-expert gate, as in Qwen2-MoE)."""
    return num_experts is not None and output_size is not None and output_size in (num_experts, 1)


def num_routed_experts(hf_text_config: object) -> int | None:
    """The routed-expert count of a Hugging Face text config (Qwen-MoE `num_experts`, DeepSeek
    `n_routed_experts`, Mixtral `num_local_experts`), or None for a dense model."""
    for field in ("num_experts", "n_routed_experts", "num_local_experts"):
        value = getattr(hf_text_config, field, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def summarize_decisions(decisions: Iterable[LayerDecision]) -> str:
    """One line: FP8 and BF16 counts of linears and expert groups, BF16 ones by reason."""
    decisions = list(decisions)
    parts = []
    for kind, label in (("linear", "linears"), ("experts", "expert groups")):
        of_kind = [d for d in decisions if d.kind == kind]
        if not of_kind:
            continue
        bf16 = Counter(d.reason for d in of_kind if not d.fp8)
        why = ", ".join(f"{reason}: {count}" for reason, count in sorted(bf16.items()))
        parts.append(f"{label} {sum(d.fp8 for d in of_kind)} FP8, {sum(bf16.values())} BF16" + (f" ({why})" if why else ""))
    return "; ".join(parts) if parts else "no linear layers"
