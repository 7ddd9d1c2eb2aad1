"""Presenting a `bench-error` result document: rich table, JSON, markdown report and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.table import Table

#: Files `write_outputs` creates inside the output directory.
JSON_NAME = "bench_error.json"
MARKDOWN_NAME = "bench_error.md"
POSITION_PLOT_NAME = "error_by_position.png"
LAYER_PLOT_NAME = "layer_attribution.png"

_ALIGNMENT_STYLE = {"reference": "dim", "misaligned": "red", "aligned": "green"}


def results_table(doc: dict[str, Any]) -> Table:
    """One row per (generation, training side, sampling) pair with its mismatch metrics."""
    table = Table(title=f"token-probability error, vLLM generation vs training side: {doc['model']['description']}")
    numeric = ("tokens", "mult. prob. error", "KL k3", "max |Δlogp|")
    for header in ("generation", "training", "alignment", "sampling", *numeric):
        table.add_column(header, justify="right" if header in numeric else "left", no_wrap=True)
    for pair in doc["pairs"]:
        m = pair["metrics"]
        table.add_row(
            pair["generation"],
            pair["training"],
            f"[{_ALIGNMENT_STYLE[pair['alignment']]}]{pair['alignment']}[/]",
            pair["sampling"],
            str(m["num_tokens"]),
            f"{m['mult_prob_error']:.5f}",
            f"{m['kl_k3']:.2e}",
            f"{m['max_abs_log_ratio']:.4f}",
        )
    return table


def write_outputs(doc: dict[str, Any], out_dir: Path, plots: bool) -> list[Path]:
    """Write the JSON document, the markdown report and (when `plots`) the PNGs; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plot_files: list[str] = []
    if plots:
        plot_error_by_position(doc, out_dir / POSITION_PLOT_NAME)
        plot_files.append(POSITION_PLOT_NAME)
        if doc["layer_attribution"] is not None:
            plot_layer_attribution(doc, out_dir / LAYER_PLOT_NAME)
            plot_files.append(LAYER_PLOT_NAME)
    (out_dir / JSON_NAME).write_text(json.dumps(doc, indent=1) + "\n")
    (out_dir / MARKDOWN_NAME).write_text(markdown_report(doc, plot_files))
    return [out_dir / JSON_NAME, out_dir / MARKDOWN_NAME] + [out_dir / f for f in plot_files]


def markdown_report(doc: dict[str, Any], plot_files: list[str]) -> str:
    """The human-readable report: what was measured, on what, with which versions, and the numbers."""
    env, settings, model = doc["environment"], doc["settings"], doc["model"]
    lines = [
        "# fp8-align bench-error: token-probability error between generation and training",
        "",
        f"Created {doc['created']} by `{' '.join(doc['command']) or 'fp8-align bench-error'}`.",
        "",
        "## What was measured",
        "",
        f"- **Model**: {model['description']} ({model['num_hidden_layers']} decoder layers, hidden size "
        f"{model['hidden_size']}, vocabulary {model['vocab_size']}).",
        f"- **Device**: {env['device']} ({env['hardware']}); {env['platform']}.",
        f"- **Versions**: fp8_align {env['fp8_align']}, vLLM {', '.join(env['vllm'])}, torch {env['torch']}, "
        f"transformers {env['transformers']}, Python {env['python']}.",
        f"- **Generation side**: real vLLM engines, one per variant, each generating every prompt greedy "
        f"(temperature 0) and sampled (temperature {settings['sampling'][1]['temperature']}, seed "
        f"{settings['sampling'][1]['seed']}) in one run; vLLM keyword arguments "
        f"`{json.dumps(settings['vllm_llm_kwargs'])}`{_compilation_note(settings['vllm_llm_kwargs'])}; "
        f"{settings['concurrent_engines']} engine(s) at a time.",
        f"- **Generation log-probs**: {doc['generation_side']['logprobs']}; vLLM `logprobs_mode` = "
        f"{', '.join(doc['generation_side']['logprobs_mode'])} ({doc['generation_side']['logprobs_mode_note']}).",
        f"- **Training side (BF16)**: {doc['training_side']['bf16']}.",
        f"- **Training side (FP8)**: {doc['training_side']['fp8']}.",
        *[f"- **Training side `{side}`**: {text}." for side, text in doc["training_side"].items() if side not in ("bf16", "fp8")],
        f"- **Prompts**: {settings['num_prompts']} from `{settings['prompts']}`, up to {settings['max_new_tokens']} "
        f"new tokens, stopping at token ids {settings['stop_token_ids']}. Only completion tokens are scored.",
        "",
        "| variant | recipe | vLLM linear kernels | engine start (s) | generate (s) | generated tokens |",
        "|---|---|---|---:|---:|---:|",
    ]
    for v in doc["variants"]:
        kernels = ", ".join(f"{count} x {name}" for name, count in v["linear_kernels"].items())
        tokens = ", ".join(f"{n} {s}" for s, n in v["generated_tokens"].items())
        lines.append(
            f"| {v['name']} | {v['description']} | {kernels} | {v['engine_start_s']:.1f} | {v['generate_s']:.1f} | {tokens} |"
        )
    lines += [
        "",
        "## Results",
        "",
        "`mult. prob. error` = mean over scored tokens of exp(|logp_train - logp_gen|) (1.0 = identical);",
        "`KL k3` = mean of exp(r) - 1 - r with r = logp_train - logp_gen, an estimate of KL(gen || train) in nats;",
        "`max |Δlogp|` = largest per-token |r|. *misaligned*: FP8 generation scored by a BF16 training side;",
        "*aligned*: FP8 generation scored by the same block-FP8 recipe; *reference*: BF16 on both sides.",
        "",
        "| pair | alignment | sampling | tokens | mult. prob. error | KL k3 | max \\|Δlogp\\| | p99 \\|Δlogp\\| |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for pair in doc["pairs"]:
        m = pair["metrics"]
        lines.append(
            f"| {pair['pair']} | {pair['alignment']} | {pair['sampling']} | {m['num_tokens']} | "
            f"{m['mult_prob_error']:.5f} | {m['kl_k3']:.2e} | {m['max_abs_log_ratio']:.4f} | {m['abs_log_ratio_p99']:.4f} |"
        )
    attribution = doc["layer_attribution"]
    if attribution is not None:
        worst = sorted(attribution["layers"], key=lambda r: -r["mult_prob_error"])[:5]
        lines += [
            "",
            "## Per-layer attribution",
            "",
            f"HF forward with block FP8 ({attribution['variant']} settings) in one decoder layer only, against "
            f"{attribution['reference']}, on {attribution['num_sequences']} greedy completions "
            f"({attribution['num_tokens']} tokens) of the '{attribution['variant']}' engine. FP8 in every layer: "
            f"mult. prob. error {attribution['all_layers']['mult_prob_error']:.5f}. Layers with the largest error: "
            + ", ".join(f"{r['layer']} ({r['mult_prob_error']:.5f})" for r in worst)
            + ".",
        ]
    if plot_files:
        lines += ["", "## Plots", ""] + [f"![{name}]({name})" for name in plot_files]
    timings = doc["timings_s"]
    lines += [
        "",
        "## Timings",
        "",
        f"Model preparation {timings['model_prepare']:.1f} s; generation and scoring "
        f"{timings['generation_and_scoring']:.1f} s (engines overlap each other and the scoring); HF scoring "
        + ", ".join(f"{name} {s:.1f} s" for name, s in timings["scoring"].items())
        + f"; per-layer attribution {timings['layer_attribution']:.1f} s; total {timings['total']:.1f} s "
        "(excluding Python start-up and imports).",
        "",
    ]
    return "\n".join(lines)


def _compilation_note(llm_kwargs: dict[str, Any]) -> str:
    if llm_kwargs.get("compilation_config", {}).get("mode") == 0:
        return " (compilation mode 0: eager PyTorch, no torch.compile)"
    return " (vLLM's default torch.compile)"


def plot_error_by_position(doc: dict[str, Any], path: Path) -> None:
    """PNG: mult. prob. error against completion position (pooled in buckets), one panel per sampling setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = [s["name"] for s in doc["settings"]["sampling"]]
    fig, axes = plt.subplots(1, len(settings), figsize=(6 * len(settings), 4.2), sharey=True, squeeze=False)
    for ax, setting in zip(axes[0], settings):
        for pair in (p for p in doc["pairs"] if p["sampling"] == setting):
            buckets = pair["per_position_bucket"]
            points = [
                (start + buckets["bucket_size"] / 2, error)
                for start, error, count in zip(buckets["start"], buckets["mult_prob_error"], buckets["num_tokens"])
                if count > 0
            ]
            style = {"reference": ":", "misaligned": "-", "aligned": "--"}[pair["alignment"]]
            ax.plot([x for x, _ in points], [e for _, e in points], style, marker="o", markersize=3, linewidth=1.3,
                    label=f"{pair['pair']} ({pair['alignment']})")
        ax.set_title(f"{setting} generation")
        ax.set_xlabel(f"completion token position (buckets of {doc['pairs'][0]['per_position_bucket']['bucket_size']})")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mult. prob. error")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"token-probability error by position: {doc['model']['description']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_layer_attribution(doc: dict[str, Any], path: Path) -> None:
    """PNG: mult. prob. error caused by block FP8 in each decoder layer alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attribution = doc["layer_attribution"]
    layers = [r["layer"] for r in attribution["layers"]]
    errors = [r["mult_prob_error"] - 1.0 for r in attribution["layers"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(layers, errors, color="tab:blue")
    ax.axhline(attribution["all_layers"]["mult_prob_error"] - 1.0, color="tab:red", linestyle="--", label="FP8 in all layers")
    ax.set_xlabel("decoder layer in FP8 (all others BF16)")
    ax.set_ylabel("mult. prob. error - 1 vs all-BF16")
    ax.set_title(f"per-layer attribution ({attribution['variant']}, {attribution['num_tokens']} tokens)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
