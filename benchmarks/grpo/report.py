"""Figure and summary table of a GRPO alignment run from its per-arm JSON documents."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


def load_runs(paths: list[Path]) -> list[dict[str, Any]]:
    """Every `grpo_*.json` arm document under `paths` (files or directories), sorted by arm and seed."""
    files = [f for p in paths for f in (sorted(p.glob("grpo_*.json")) if p.is_dir() else [p])]
    if not files:
        raise FileNotFoundError(f"no grpo_*.json arm documents under {', '.join(map(str, paths))}")
    docs = [json.loads(f.read_text()) for f in files]
    return sorted(docs, key=lambda d: (d["arm"], d["settings"]["seed"]))


def _smoothed(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def summary_rows(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per arm document: the validation curve {step: accuracy}, mean reward over the last
    10 steps, mean and median token mult. prob. error (the mean is dominated by rare spikes),
    mean KL k3, mean TIS clip fraction, mean seconds per step by phase."""
    rows = []
    for doc in docs:
        steps = doc["steps"]
        errors = [s["mismatch"]["mult_prob_error"] for s in steps]
        phases = sorted({k for s in steps for k in s["seconds"]})
        rows.append({
            "arm": doc["arm"], "label": doc["label"], "seed": doc["settings"]["seed"], "steps": len(steps),
            "validation": {v["step"]: v["accuracy"] for v in doc["validation"]},
            "reward_last10": statistics.fmean(s["reward_mean"] for s in steps[-10:]) if steps else None,
            "mult_prob_error_mean": statistics.fmean(errors) if errors else None,
            "mult_prob_error_median": statistics.median(errors) if errors else None,
            "kl_k3_mean": statistics.fmean(s["mismatch"]["kl_k3"] for s in steps) if steps else None,
            "tis_clip_fraction_mean": statistics.fmean(s["tis_clip_fraction"] for s in steps) if steps else None,
            "seconds_per_step": {k: statistics.fmean(s["seconds"].get(k, 0.0) for s in steps) for k in phases},
            "stopped": doc.get("stopped"),
        })  # fmt: skip
    return rows


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """The summary rows as a markdown table (validation accuracy at every measured step)."""

    def fmt(value: Any, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    lines = [
        "| arm | seed | steps | validation accuracy (step: acc) | reward (last 10) | mult. prob. error mean / median | KL k3 | TIS clip | s/step (rollout / train / push / total) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        sec = r["seconds_per_step"]
        split = " / ".join(fmt(sec.get(k), ".2f") for k in ("rollout", "train", "weight_push", "total"))
        curve = ", ".join(f"{step}: {acc:.3f}" for step, acc in r["validation"].items())
        lines.append(
            f"| {r['label']} | {r['seed']} | {r['steps']} | {curve} | {fmt(r['reward_last10'], '.3f')} | "
            f"{fmt(r['mult_prob_error_mean'], '.3f')} / {fmt(r['mult_prob_error_median'], '.3f')} | "
            f"{fmt(r['kl_k3_mean'], '.2e')} | {fmt(r['tis_clip_fraction_mean'], '.4f')} | {split} |"
        )
    return "\n".join(lines)


def plot_runs(docs: list[dict[str, Any]], path: Path, smooth: int = 5) -> None:
    """One figure, all arms (seed 0 solid, other seeds dashed): validation accuracy, training
    reward (moving mean of `smooth` steps), the token mult. prob. error per step (log scale),
    and, per arm, the median over seeds of the per-step 90th percentile of |Δlogp|."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(21, 4.8))
    colors: dict[str, Any] = {}
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        color = colors.setdefault(doc["arm"], f"C{len(colors)}")
        first_seed = min(d["settings"]["seed"] for d in docs if d["arm"] == doc["arm"])
        style = "-" if doc["settings"]["seed"] == first_seed else "--"
        label = doc["label"] if style == "-" else None
        by_arm.setdefault(doc["arm"], []).append(doc)
        val = doc["validation"]
        axes[0].plot([v["step"] for v in val], [v["accuracy"] for v in val], style, marker="o", ms=3, color=color, label=label)
        steps = [s["step"] for s in doc["steps"]]
        axes[1].plot(steps, _smoothed([s["reward_mean"] for s in doc["steps"]], smooth), style, color=color)
        axes[2].plot(steps, [s["mismatch"]["mult_prob_error"] for s in doc["steps"]], style, color=color, lw=0.8)
    for arm, arm_docs in by_arm.items():
        length = min(len(d["steps"]) for d in arm_docs)
        p90 = [statistics.median(d["steps"][i]["mismatch"]["abs_log_ratio_p90"] for d in arm_docs) for i in range(length)]
        axes[3].plot(range(length), p90, color=colors[arm], label=f"{arm_docs[0]['label']} ({len(arm_docs)} seeds)")
    axes[0].set(title="validation accuracy (greedy, held out)", xlabel="step", ylabel="exact match")
    axes[1].set(title=f"training reward (mean of {smooth} steps)", xlabel="step", ylabel="mean reward")
    axes[2].set(title="engine vs trainer: token mult. prob. error", xlabel="step", ylabel="mean exp(|Δlogp|)", yscale="log")
    axes[3].set(title="engine vs trainer: p90 of |Δlogp| (median over seeds)", xlabel="step", ylabel="nats")
    axes[0].legend(fontsize=7, title="solid: first seed, dashed: others", title_fontsize=7)
    axes[3].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
