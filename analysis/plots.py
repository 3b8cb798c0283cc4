"""Figures, one style: fixed system colours across every figure, units on the axes,
written as PNG and PDF."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

SYSTEM_COLORS = {
    "reference": "#7f7f7f", "naive": "#1f77b4", "occult": "#d62728", "occult_placed": "#ff7f0e",
    "occult_prune_score": "#9467bd", "occult_prune_sim": "#8c564b", "deepspeed": "#2ca02c",
    "tutel": "#e377c2", "megablocks": "#17becf", "exflow": "#bcbd22",
}
PHASES = ["route", "dispatch", "experts", "combine"]


def palette(systems) -> dict:
    extra = iter(sns.color_palette("tab20", 20))
    return {s: SYSTEM_COLORS.get(s) or next(extra) for s in systems}


def save(fig, path_stem: Path) -> list[Path]:
    paths = [path_stem.with_suffix(".png"), path_stem.with_suffix(".pdf")]
    for p in paths:
        fig.savefig(p, bbox_inches="tight", dpi=130)
    plt.close(fig)
    return paths


def plot_phase_times(df: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Forward phase times (slowest rank, median over samples) per system, one panel per
    cluster and top-k."""
    sel = df[(df.metric == "time") & (df["pass"] == "forward") & df.phase.isin(PHASES) & (df["sample"] >= 0)]
    if sel.empty:
        return []
    keys = ["system", "cluster", "top_k", "phase", "sample"]
    slowest = sel.groupby(keys + ["rank"]).value.sum().groupby(keys).max().reset_index()
    sns.set_theme(style="whitegrid")
    g = sns.catplot(data=slowest, x="phase", y="value", hue="system", col="cluster", row="top_k",
                    kind="bar", order=PHASES, estimator="median", errorbar=("pi", 50),
                    palette=palette(slowest.system.unique()), height=2.8, aspect=1.3, sharey=False)
    g.set_axis_labels("phase", "time (ms, slowest rank)")
    g.figure.suptitle("MoE layer forward, per phase (measured on this machine)", y=1.02)
    return save(g.figure, Path(out_dir) / "phase_times")
