"""Occult's expert-placement study (``report: placement_study``; the ranks' part is
:mod:`occult.tasks.placement_study`, which also writes the placement artifacts
``placements_cap-<cap>.json`` into its run folder), from the run's rows: per world size,
``placement_p<P>.csv`` (one row per optimiser, load cap and layer with the held-out
``ct_all, ct_remote, intra_ratio, load_max_over_mean, busiest_rows_vs_contiguous``,
``busiest_sfd_rows_vs_contiguous``, ``solve_s`` and the profiling figures),
``placement_p<P>.md`` (averaged over layers) and ``placement_front_p<P>.png/pdf`` (held-out
C_T against load balance, one point per optimiser and cap).

Shapes: T tokens, K top-k, E experts, P devices.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from occult.placement.study import frame_from_rows

from ..plots import plt, save
from ..sections import Section


def plot_front(df: pd.DataFrame, out_dir: Path, name: str = "placement_front") -> list:
    """Held-out C_T (mean over layers) against load balance, per (optimiser, cap), in the
    order the study ran them (``task.optimisers``, ``task.load_caps``)."""
    mean = df.groupby(["optimiser", "load_cap"], sort=False)[["ct_all", "load_max_over_mean"]].mean().reset_index()
    caps_run = mean.load_cap.nunique()
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    markers = {"none": "o", "1.25": "s", "1.15": "^", "1.1": "D"}
    for i, optimiser in enumerate(dict.fromkeys(mean.optimiser)):
        sel = mean[mean.optimiser == optimiser]
        # caps that gave the same placement quality share one point and one label
        points = sel.groupby([sel.load_max_over_mean.round(6), sel.ct_all.round(6)], sort=False).load_cap.apply(list)
        for j, ((x, y), caps) in enumerate(points.items()):
            ax.scatter(x, y, color=f"C{i}", marker=markers.get(caps[0], "o"), s=40, label=optimiser if j == 0 else None)
            text = "any cap" if len(caps) == caps_run else "/".join(caps)
            ax.annotate(text, (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax.set_xlabel("held-out device load, max / mean")
    ax.set_ylabel("held-out C_T (devices/token, mean over layers)")
    ax.set_title("Expert placement: C_T vs load balance (labels: load cap)")
    ax.legend(fontsize=7)
    return save(fig, out_dir / name)


def build(df: pd.DataFrame, out_dir) -> list:
    """Report builder (``experiment=placement_study``): per world size, the study's table
    (``placement_p<P>.csv``: one row per optimiser, cap and layer; ``.md``: averaged over
    layers) and the C_T-vs-load front (``placement_front_p<P>.png/pdf``), from the rows of
    its ``task=placement_study`` runs."""
    title = "Expert placement: held-out C_T and load balance per optimiser and load cap"
    runs = df[df.task == "placement_study"]
    if runs.empty:
        return [Section(title, ["Not drawn: no task=placement_study runs."])]
    out_dir, sections = Path(out_dir), []
    for (P, _), run in runs.groupby(["world_size", "run_id"], sort=False):
        table = frame_from_rows(run)
        table.to_csv(out_dir / f"placement_p{P}.csv", index=False)
        (out_dir / f"placement_p{P}.md").write_text(placement_markdown(table) + "\n")
        figs = plot_front(table, out_dir, f"placement_front_p{P}")
        mean = table.groupby(["optimiser", "load_cap"], sort=False).mean(numeric_only=True).drop(columns="layer")
        text = [f"P = {P}, model {run.model.iloc[0]}: placements fitted on the profiling set, judged on held-out "
                "text (mean over MoE layers); the run folder holds one placement artifact per cap "
                "(placements_cap-<cap>.json, for system=occult_placed)."]
        sections.append(Section(f"{title} (P = {P})", text, [(f"placement_p{P}", mean.reset_index())], figs))
    return sections


def placement_markdown(df: pd.DataFrame) -> str:
    """The study averaged over layers, as a Markdown table."""
    mean = df.groupby(["optimiser", "load_cap"], sort=False).mean(numeric_only=True).drop(columns="layer")
    return mean.reset_index().to_markdown(index=False, floatfmt=".4g")
