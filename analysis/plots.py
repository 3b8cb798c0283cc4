"""Figures, one style: fixed system colours across every figure, units on the axes,
projected values hatched and labelled, written as PNG and PDF."""
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
    "allgather": "#aec7e8", "hierarchical": "#393b79", "pipelined": "#637939", "shadow": "#e7969c",
    "expert_fetch": "#843c39",
}
# the order systems appear in legends and on axes (others follow, alphabetically)
SYSTEM_ORDER = ["reference", "naive", "deepspeed", "tutel", "megablocks", "exflow", "allgather", "hierarchical",
                "pipelined", "shadow", "expert_fetch", "occult", "occult_placed", "occult_prune_score",
                "occult_prune_sim"]
SOURCE_HATCH = {"measured": "", "projected": "//"}
PHASES = ["route", "dispatch", "experts", "combine"]


def style() -> None:
    """The one theme every figure uses."""
    sns.set_theme(style="whitegrid", context="paper", font_scale=1.1)


def palette(systems) -> dict:
    extra = iter(sns.color_palette("tab20", 20))
    return {s: SYSTEM_COLORS.get(s) or next(extra) for s in systems}


def system_order(systems) -> list:
    """Systems in the fixed legend order."""
    systems = list(dict.fromkeys(systems))
    known = [s for s in SYSTEM_ORDER if s in systems]
    return known + sorted(s for s in systems if s not in SYSTEM_ORDER)


def save(fig, path_stem: Path) -> list[Path]:
    """Writes ``<stem>.png`` and ``<stem>.pdf``; returns both paths."""
    path_stem = Path(path_stem)
    paths = [path_stem.with_suffix(".png"), path_stem.with_suffix(".pdf")]
    for p in paths:
        fig.savefig(p, bbox_inches="tight", dpi=130)
    plt.close(fig)
    return paths


def hatch_projected(ax, label: str = "projected (cost model)") -> None:
    """Hatches every bar of ``ax`` and notes on the axes that its values are projected."""
    for patch in ax.patches:
        patch.set_hatch(SOURCE_HATCH["projected"])
        patch.set_edgecolor("white")
    ax.text(0.99, 0.98, label, transform=ax.transAxes, ha="right", va="top", fontsize=8,
            style="italic", bbox=dict(facecolor="white", alpha=0.8, edgecolor="none"))


def plot_phase_times(df: pd.DataFrame, out_dir: Path) -> list[Path]:
    """Forward phase times (slowest rank, median over samples) per system, one panel per
    cluster and top-k (task=layer runs)."""
    sel = df[(df.task == "layer") & (df.metric == "time") & (df["pass"] == "forward") & df.phase.isin(PHASES)
             & (df["sample"] >= 0)]
    if sel.empty:
        return []
    keys = ["system", "cluster", "top_k", "phase", "sample"]
    slowest = sel.groupby(keys + ["rank"]).value.sum().groupby(keys).max().reset_index()
    style()
    g = sns.catplot(data=slowest, x="phase", y="value", hue="system", col="cluster", row="top_k",
                    kind="bar", order=PHASES, hue_order=system_order(slowest.system.unique()),
                    estimator="median", errorbar=("pi", 50),
                    palette=palette(slowest.system.unique()), height=2.8, aspect=1.3, sharey=False)
    g.set_axis_labels("phase", "time (ms, slowest rank)")
    g.figure.suptitle("MoE layer forward, per phase (measured on this machine)", y=1.02)
    return save(g.figure, Path(out_dir) / "phase_times")
