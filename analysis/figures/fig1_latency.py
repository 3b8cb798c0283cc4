"""Occult Fig. 1: the latency of every system on every model and task (``report:
fig1_latency``): measured here, ratios to naive EP, the cost model's projection for the
paper's 4 x RTX A6000 (hatched, labelled projected) and the paper's claims beside
(docs/paper_claims.md), quoted, never mixed into the data.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from occult.ep.profiles import load_profile

from ..plots import hatch_projected, palette, save, style, system_order
from ..projection import MEASURED, project_runs, projected_totals
from ..sections import Section, no_data
from ..summary import TASK_LATENCY, TASK_LATENCY_LABEL, ratio_to, task_latency
from ..traces import traced_runs

FIG1_PROFILE = "sim_a6000x4"
# the papers' claims (docs/paper_claims.md): (comparison, other system,
# task or None for every task, paper's speedup of Occult)
PAPER_CLAIMS = [
    ("Occult vs Tutel, prefill", "tutel", "prefill", "2.7-8.7x"),
    ("Occult vs MegaBlocks, prefill", "megablocks", "prefill", "0.66-1.7x"),
    ("Occult vs MegaBlocks, training (paper: batch 8)", "megablocks", "train", "1.54x"),
    ("Occult vs DeepSpeed-MoE, training", "deepspeed", "train", "about 9x"),
    ("Occult vs the best other system, any task", None, None, "more than 1.5x"),
]
OTHER_SYSTEMS = ("deepspeed", "tutel", "megablocks", "exflow")


def _speedups(table: pd.DataFrame, value: str, other, task) -> list[float]:
    """other / occult for every (model, task, cluster) where both ran; ``other=None``:
    the fastest of the other systems."""
    keys = ["model", "task", "cluster", "batch_size", "seq_len"]
    sel = table if task is None else table[table.task == task]
    out = []
    for _, g in sel.groupby([k for k in keys if k in sel]):
        occ = g[g.system == "occult"][value]
        oth = g[g.system.isin(OTHER_SYSTEMS if other is None else [other])][value]
        if not occ.empty and not oth.empty:
            out.append(float(oth.min() / occ.iloc[0]))
    return out


def _range(values: list[float]) -> str:
    """``"a-b x"`` over the values (one value when they agree to two decimals)."""
    if not values:
        return "not run"
    lo, hi = f"{min(values):.2f}", f"{max(values):.2f}"
    return f"{lo}x" if lo == hi else f"{lo}-{hi}x"


def _drop_legend(ax) -> None:
    """Removes an axes' own legend (the figure carries one for all panels)."""
    if ax.get_legend() is not None:
        ax.get_legend().remove()


def _two_line_model_ticks(ax, proxy: str = "\n(proxy)") -> None:
    """``olmoe_proxy`` -> ``olmoe`` + ``proxy`` on a categorical x axis, so that names do not overlap."""
    labels = [t.get_text() for t in ax.get_xticklabels()]
    if labels:
        ax.set_xticks(ax.get_xticks(), [s.replace("_proxy", proxy) for s in labels])


def task_panels(lat: pd.DataFrame, proj: pd.DataFrame, panel_inches: tuple):
    """The Fig. 1 layout: one column per task present, a measured row and, when there are
    projections, a projected row. Returns (tasks, systems, palette, rows, fig, axes)."""
    tasks = [t for t in TASK_LATENCY if t in set(lat.task)]
    systems = system_order(lat.system.unique())
    style()
    rows = 2 if not proj.empty else 1
    width, height = panel_inches
    fig, axes = plt.subplots(rows, len(tasks), figsize=(width * len(tasks), height * rows), squeeze=False)
    return tasks, systems, palette(systems), rows, fig, axes


def build(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    """Occult Fig. 1: latency per system, model and task; ratios to naive; projected 4 x A6000."""
    title = "Fig. 1: latency of every system, model and task"
    traced = {run.run_id.iloc[0] for _, run in traced_runs(df)}
    df = df[~df.run_id.isin(traced)]
    lat = task_latency(df)
    if lat.empty:
        return no_data(title, "whole-model runs (task=prefill/decode/train)")
    lat["ratio_to_naive"] = ratio_to(lat, "latency_ms")
    lat["source"] = MEASURED
    profile = load_profile(FIG1_PROFILE)
    proj = projected_totals(project_runs(df[df.task.isin(list(TASK_LATENCY))], profile, target="real"))
    if not proj.empty:
        proj["ratio_to_naive"] = ratio_to(proj, "moe_ms")
    tasks, systems, pal, rows, fig, axes = task_panels(lat, proj, (4.6, 3.4))
    for j, task in enumerate(tasks):
        ax = axes[0][j]
        sns.barplot(data=lat[lat.task == task], x="model", y="latency_ms", hue="system", hue_order=systems,
                    palette=pal, ax=ax)
        ax.set_title(f"{task}: {TASK_LATENCY_LABEL[task]} (measured here)")
        ax.set_ylabel("latency (ms)")
        ax.set_xlabel("")
        _two_line_model_ticks(ax)
        _drop_legend(ax)
        if rows == 2:
            ax2 = axes[1][j]
            sub = proj[proj.task == task]
            if not sub.empty:
                sns.barplot(data=sub, x="model", y="moe_ms", hue="system", hue_order=systems, palette=pal, ax=ax2)
                hatch_projected(ax2, f"projected: {FIG1_PROFILE}")
                _drop_legend(ax2)
            ax2.set_title(f"{task}: MoE layers of the real model, projected")
            ax2.set_ylabel("projected time (ms)")
            ax2.set_xlabel("real model (routing and rows from its proxy's run)", fontsize=8)
            _two_line_model_ticks(ax2, proxy="")
    handles = [plt.Rectangle((0, 0), 1, 1, color=pal[s]) for s in systems]
    fig.subplots_adjust(hspace=0.45, wspace=0.3)
    fig.legend(handles, systems, loc="upper center", ncol=len(systems), bbox_to_anchor=(0.5, 1.0))
    figs = save(fig, Path(out_dir) / "fig1_latency")
    claims = []
    for label, other, task, paper in PAPER_CLAIMS:
        claims.append({"comparison": label, "paper (docs/paper_claims.md)": paper,
                       "measured here": _range(_speedups(lat, "latency_ms", other, task)),
                       f"projected, {FIG1_PROFILE} (MoE layers)":
                           _range(_speedups(proj, "moe_ms", other, task)) if not proj.empty else "not projected"})
    measured = lat[["model", "task", "cluster", "system", "impl", "latency_metric", "latency_ms", "tokens_per_s",
                    "ratio_to_naive", "source"]].sort_values(["model", "task", "system"])
    tables = [("fig1_measured", measured), ("fig1_claims", pd.DataFrame(claims))]
    text = ["Measured: each task's latency on this machine (prefill: time to first token; decode: per-token "
            "latency; train: step time), slowest rank, median over samples; ratio to naive EP in the same "
            "sweep. Speedup = the other system's time / Occult's (above 1: Occult faster). Runs that "
            "saved a routing trace (for Figs. 3 and 8) are left out. At proxy width on CPU ranks that share "
            "cores, compute (attention, experts, each system's index work) dominates and the all-to-alls "
            "move little, so measured ratios are this machine's, not the paper's."]
    if not proj.empty:
        shown = proj[["model", "task", "system", "target_model", "target_moe_layers", "a2a_ms_per_layer",
                      "experts_ms_per_layer", "moe_ms", "ratio_to_naive", "source", "profile"]]
        tables.insert(1, ("fig1_projected", shown.sort_values(["model", "task", "system"])))
        text.append(f"Projected on {FIG1_PROFILE} (the paper's 4 x RTX A6000; hatched): the cost model "
                    "(analysis.projection) applied to each run's measured per-peer rows, re-sized to the real "
                    "model's hidden size in bfloat16, expert FLOPs of the real D and F, the per-layer mean "
                    "repeated for the real model's MoE layers. It covers the expert-parallel part only "
                    "(all-to-alls and experts; attention and dense layers are the same for every system "
                    "and not modelled): adding that common part pulls every ratio toward 1, so whole-model "
                    "ratios lie between 1 and these. Profile "
                    f"numbers are spec-sheet figures with assumed efficiencies: {profile.source}.")
    else:
        text.append(f"No projection: {FIG1_PROFILE} needs runs at world size {profile.sizes()}.")
    return [Section(title, text, tables, figs)]
