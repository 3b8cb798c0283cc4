"""Figures, one style: fixed system colours across every figure, units on the axes,
projected values hatched and labelled, written as PNG and PDF.

Every registered system (:func:`occult.config.registered_dirs`: ``conf/`` and a user's
folders) has a colour and a marker (:func:`system_styles`): the paper's systems keep the
colours of :data:`SYSTEM_COLORS`; any other system's are derived from its name (a digest
picks a start in :data:`EXTRA_COLORS` and :data:`MARKERS`; a colour another system holds is
skipped), so a new system needs no line here.
"""
from __future__ import annotations

import hashlib
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
# colours for the systems without one above: the tab20 family's shades that SYSTEM_COLORS does not use
EXTRA_COLORS = ("#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5",
                "#5254a3", "#8ca252", "#bd9e39", "#ad494a", "#a55194", "#6b6ecf", "#b5cf6b", "#e7ba52",
                "#d6616b", "#ce6dbd", "#3182bd", "#e6550d", "#31a354", "#756bb1", "#636363", "#fd8d3c")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")
SOURCE_HATCH = {"measured": "", "projected": "//"}
PHASES = ["route", "dispatch", "experts", "combine"]


def style() -> None:
    """The one theme every figure uses."""
    sns.set_theme(style="whitegrid", context="paper", font_scale=1.1)


def _digest(name: str) -> int:
    """A number from a system's name, the same in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")


def system_styles(systems=()) -> dict:
    """``{system: (colour, marker)}`` of every registered system and of ``systems`` (names
    in results, registered or not). The paper's systems: :data:`SYSTEM_COLORS` and a marker
    by their place in :data:`SYSTEM_ORDER`; the others, by name order: the first colour of
    :data:`EXTRA_COLORS` from their digest's start that no other system holds (a colour
    again once all are held), and the marker their digest picks."""
    from occult.config import registered_dirs, system_yamls

    styles = {s: (SYSTEM_COLORS[s], MARKERS[i % len(MARKERS)]) for i, s in enumerate(SYSTEM_ORDER)}
    held = set(SYSTEM_COLORS.values())
    for s in sorted((set(system_yamls(registered_dirs())) | set(systems)) - set(styles)):
        d = _digest(s)
        ring = [EXTRA_COLORS[(d + k) % len(EXTRA_COLORS)] for k in range(len(EXTRA_COLORS))]
        colour = next((c for c in ring if c not in held), ring[0])
        held.add(colour)
        styles[s] = (colour, MARKERS[d % len(MARKERS)])
    return styles


def palette(systems) -> dict:
    """``{system: colour}`` for ``systems`` (:func:`system_styles`)."""
    styles = system_styles(systems)
    return {s: styles[s][0] for s in systems}


def markers(systems) -> dict:
    """``{system: marker}`` for ``systems`` (:func:`system_styles`)."""
    styles = system_styles(systems)
    return {s: styles[s][1] for s in systems}


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
