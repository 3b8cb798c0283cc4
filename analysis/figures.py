"""The paper's figures and tables, each from a results frame (``analysis.load.load_runs``).

Every builder is ``build(df, out_dir) -> list[Section]``: it picks the runs it
needs from ``df`` (and the routing traces in their folders), writes its
figures (PNG + PDF) into ``out_dir`` and returns report sections (text,
tables, figure paths). An experiment names its builders in its config
(``report: fig3_lcc`` or a comma-separated list, or dotted paths); the
multirun callback and ``python -m analysis.report`` run them.

Builders: ``fig1_latency``, ``fig3_lcc``, ``table1_ct_runtime``,
``fig8_pattern``, ``fig12_scaling`` (see :data:`BUILDERS`).

Every number comes from measured rows, from a routing trace, or from the
cost model (column ``source = projected``, hatched or dashed in figures). The
paper's own claims (docs/paper_claims.md) are quoted as text beside them, never mixed
into the data.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from occult.placement import coactivation, optimise, placement_summary
from occult.routing_traces import load_trace, trace_topk

from . import costmodel as cm
from .lcc import lcc_curve, token_counts, topk_from_logits, uniform_lcc_curve
from .plots import hatch_projected, palette, save, style, system_order
from .summary import (TASK_LATENCY, TASK_LATENCY_LABEL, a2a_total_ms, ratio_to, remote_bytes_per_rank,
                      run_table, task_latency)


@dataclass
class Section:
    """A part of report.md: a title, paragraphs, named tables and figures."""

    title: str
    text: list = field(default_factory=list)
    tables: list = field(default_factory=list)      # (name, DataFrame)
    figures: list = field(default_factory=list)     # paths (PNG and PDF)


def pearson(x, y) -> float:
    """Pearson correlation of two equally long sequences (nan below 3 points or without variance)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    if len(x) < 3 or x.std() == 0 or y.std() == 0:
        return float("nan")
    return float(np.corrcoef(x, y)[0, 1])


def linear_fit(x, y) -> tuple[float, float]:
    """Least-squares slope and intercept of y on x (nan below 2 points)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    ok = np.isfinite(x) & np.isfinite(y)
    if ok.sum() < 2 or np.ptp(x[ok]) == 0:
        return float("nan"), float("nan")
    slope, intercept = np.polyfit(x[ok], y[ok], 1)
    return float(slope), float(intercept)


def _trace_runs(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(run_dir, rows) of every run whose folder holds a routing trace."""
    return [(d, run) for d, run in df.groupby("run_dir") if (Path(d) / "routing.parquet").is_file()]


def router_kind(run: pd.DataFrame) -> str:
    """How a run's router got its weights, from its ``init`` column: ``trained router`` (a
    checkpoint: a pre-trained proxy or a real model) or ``random-init router``."""
    init = str(run["init"].iloc[0]) if "init" in run and len(run) else ""
    return "random-init router" if init in ("", "random") else "trained router"


def _no_data(title: str, what: str) -> list[Section]:
    return [Section(title, [f"Not drawn: these runs have no {what}."])]


# ---------------------------------------------------------------------------
# Fig. 3: largest connected component of the co-activation graph
# ---------------------------------------------------------------------------

LCC_TOP_K = (2, 4, 6, 8)
LCC_DRAWS = 16
LCC_FRACTIONS = (0.5, 0.9, 1.0)


def _tokens_to_reach(curve: pd.DataFrame, fraction: float, num_experts: int) -> str:
    """Median over draws of the fewest tokens whose LCC holds ``fraction`` of the experts."""
    need = fraction * num_experts
    firsts = []
    for _, d in curve.groupby("draw"):
        hit = d[d.lcc >= need - 1e-9].tokens
        firsts.append(hit.min() if not hit.empty else np.inf)
    med = float(np.median(firsts))
    return f"> {int(curve.tokens.max())}" if np.isinf(med) else f"{med:g}"


def lcc_curves(df: pd.DataFrame, draws: int = 0, seed: int = 0) -> tuple[pd.DataFrame, list[str]]:
    """LCC-vs-tokens curves of every traced run (last MoE layer), top-2/4/6/8 taken from
    the router's logits, beside uniform routing (``draws`` token orders; 0: LCC_DRAWS);
    plus notes on each trace."""
    draws = draws or LCC_DRAWS
    frames, notes = [], []
    for run_dir, run in _trace_runs(df):
        trace, logits = load_trace(run_dir)
        layer = int(trace.layer.max())
        E, K, model = int(run.num_experts.iloc[0]), int(run.top_k.iloc[0]), str(run.model.iloc[0])
        ids_model = trace_topk(trace, layer)[0].numpy()
        checkpoints = token_counts(len(ids_model))
        kind_of_router = router_kind(run)
        if layer in logits:
            agree = float((np.sort(topk_from_logits(logits[layer], K), 1) == np.sort(ids_model, 1)).all(1).mean())
            per_k = {k: topk_from_logits(logits[layer], k) for k in LCC_TOP_K if k <= E}
            notes.append(f"`{model}` ({kind_of_router}, top-{K} model), layer {layer}, {len(ids_model)} tokens from "
                         f"`{run_dir}`: top-k for k = {', '.join(map(str, per_k))} taken from its router's "
                         f"logits (the same router, only the number of experts taken changes; its own "
                         f"top-{K} agrees with the recorded routing on {agree:.1%} of tokens).")
        else:
            per_k = {K: ids_model}
            notes.append(f"`{model}`, layer {layer}: no router logits in the trace; its own top-{K} only.")
        for k, ids in per_k.items():
            for kind, curve in ((kind_of_router, lcc_curve(ids, E, checkpoints, draws, seed)),
                                ("uniform (simulated)", uniform_lcc_curve(E, k, checkpoints, draws, seed))):
                curve["model"], curve["top_k"], curve["routing"], curve["num_experts"] = model, k, kind, E
                frames.append(curve)
    return (pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()), notes


def fig3_lcc(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    """Occult Fig. 3: experts in the largest connected component vs tokens in the batch."""
    title = "Fig. 3: largest connected component of the co-activation graph"
    curves, notes = lcc_curves(df)
    if curves.empty:
        return _no_data(title, "routing traces (task.save_routing=true)")
    style()
    models = sorted(curves.model.unique())
    fig, axes = plt.subplots(1, len(models), figsize=(5.2 * len(models), 3.8), squeeze=False)
    colors = dict(zip(LCC_TOP_K, sns.color_palette("viridis", len(LCC_TOP_K))))
    for ax, model in zip(axes[0], models):
        sub = curves[curves.model == model]
        for (k, kind), c in sub.groupby(["top_k", "routing"]):
            stats = c.groupby("tokens").lcc.agg(["median", lambda s: s.quantile(0.25), lambda s: s.quantile(0.75)])
            stats.columns = ["median", "q25", "q75"]
            trained = not kind.startswith("uniform")
            ax.plot(stats.index, stats["median"], "-o" if trained else "--", ms=3, color=colors.get(k),
                    label=f"top-{k}, {kind}", lw=1.6 if trained else 1.0, alpha=1.0 if trained else 0.8)
            if trained:
                ax.fill_between(stats.index, stats.q25, stats.q75, color=colors.get(k), alpha=0.15)
        E = int(sub.num_experts.iloc[0])
        ax.axhline(E, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens in the batch")
        ax.set_ylabel(f"experts in the largest component (of E = {E})")
        ax.set_title(f"{model}, last MoE layer")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle("Co-activation graph connectivity (routing traces; uniform: simulated)", y=1.02)
    figs = save(fig, Path(out_dir) / "fig3_lcc")
    summary = []
    for (model, kind, k), c in curves.groupby(["model", "routing", "top_k"]):
        E = int(c.num_experts.iloc[0])
        med = c.groupby("tokens").lcc.median()
        row = {"model": model, "routing": kind, "top_k": k, "E": E}
        row.update({f"tokens to {int(f * 100)} % of E": _tokens_to_reach(c, f, E) for f in LCC_FRACTIONS})
        row.update({f"LCC @ {n} tokens": med.get(n, np.nan) for n in (1, 4, 16, 64)})
        summary.append(row)
    text = ["Nodes are experts; an edge joins two experts that one token chose together. A batch of n "
            f"tokens is the first n of a random order of the trace's tokens ({curves.draw.nunique()} orders; median, "
            "band: quartiles). Uniform routing: K distinct experts per token uniformly at random, "
            "simulated with the same batch sizes. 'tokens to x % of E': the first batch size among 1, 2, "
            "4, ... whose largest component holds that share of the experts (median over orders). "
            "Paper's point: the graph connects after a few tokens, "
            "so re-placing experts per batch cannot keep a batch's tokens on few devices."] + notes
    return [Section(title, text, [("fig3_lcc", pd.DataFrame(summary)),
                                  ("fig3_lcc_curves", curves.groupby(["model", "routing", "top_k", "tokens"])
                                   .lcc.median().reset_index())], figs)]


# ---------------------------------------------------------------------------
# Table 1: C_T against measured all-to-all and layer time
# ---------------------------------------------------------------------------

T1_Y = {"remote_MB_per_rank": "remote bytes sent per rank, fwd (MB)",
        "a2a_fwd_ms": "all-to-all, forward (ms)", "a2a_fwd_bwd_ms": "all-to-all, fwd+bwd (ms)",
        "layer_fwd_ms": "MoE layer, forward (ms)", "layer_fwd_bwd_ms": "MoE layer, fwd+bwd (ms)"}


def layer_table(df: pd.DataFrame) -> pd.DataFrame:
    """run_table of the task=layer runs with all-to-all totals and remote bytes per rank."""
    layer = df[df.task == "layer"]
    if layer.empty:
        return pd.DataFrame()
    t = run_table(layer).set_index("run_dir")
    t["a2a_fwd_ms"] = a2a_total_ms(layer, ("forward",))
    t["a2a_fwd_bwd_ms"] = a2a_total_ms(layer, ("forward", "backward"))
    t["remote_MB_per_rank"] = remote_bytes_per_rank(layer) / 1e6
    return t.reset_index()


def table1_ct_runtime(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    """Occult Table 1: C_T vs measured all-to-all and layer time; linear fit and Pearson r."""
    title = "Table 1: C_T against measured all-to-all and layer time"
    t = layer_table(df)
    if t.empty:
        return _no_data(title, "task=layer runs")
    fits = []
    for (system, cluster), g in t.groupby(["system", "cluster"]):
        for col, label in T1_Y.items():
            slope, icpt = linear_fit(g.ct_all, g[col])
            r = pearson(g.ct_all, g[col])
            fits.append({"system": system, "cluster": cluster, "y": label, "runs": int(g[col].notna().sum()),
                         "slope (y unit per device/token)": slope, "intercept (y unit)": icpt, "pearson_r": r,
                         "r2": r * r if np.isfinite(r) else np.nan})
    style()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    pal = palette(t.system.unique())
    for ax, col in zip(axes, ("a2a_fwd_bwd_ms", "layer_fwd_bwd_ms")):
        sns.scatterplot(data=t, x="ct_all", y=col, hue="system", style="routing", palette=pal,
                        hue_order=system_order(t.system.unique()), ax=ax, s=45)
        for system, g in t.groupby("system"):
            slope, icpt = linear_fit(g.ct_all, g[col])
            if np.isfinite(slope):
                xs = np.linspace(g.ct_all.min(), g.ct_all.max(), 20)
                ax.plot(xs, icpt + slope * xs, color=pal[system], lw=1,
                        label=f"{system} fit, r = {pearson(g.ct_all, g[col]):.3f}")
        ax.set_xlabel("C_T (devices per token, measured routing)")
        ax.set_ylabel(T1_Y[col] + ", slowest rank")
        ax.legend(fontsize=7)
    fig.suptitle("C_T vs time, task=layer (measured on this machine)", y=1.02)
    figs = save(fig, Path(out_dir) / "table1_ct_runtime")
    cols = ["system", "cluster", "top_k", "routing", "ct_all", "dispatch_rows_per_token", "remote_MB_per_rank",
            "a2a_fwd_ms", "a2a_fwd_bwd_ms", "layer_fwd_ms", "layer_fwd_bwd_ms"]
    runs = t[[c for c in cols if c in t]].sort_values(["system", "cluster", "routing", "top_k"])
    text = ["Each point is one task=layer run: C_T (`ct_all`, mean distinct devices per token over all "
            "ranks) from its routing; times are the slowest rank per sample, median over samples, "
            "measured here (all collectives of the pass summed). The fit is least squares per system "
            "and cluster; r is Pearson's correlation (the bytes row is the machine-independent anchor: "
            "what C_T predicts exactly). Paper: a strong linear relation. Where C_T is varied "
            "through top-k, the experts' work grows with K as well, so the layer-time fit includes that; "
            "the all-to-all fit is the one about communication."]
    return [Section(title, text, [("table1_fit", pd.DataFrame(fits)), ("table1_runs", runs)], figs)]


# ---------------------------------------------------------------------------
# Fig. 1: latency of every system on every model and task
# ---------------------------------------------------------------------------

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


def _task_panels(lat: pd.DataFrame, proj: pd.DataFrame, panel_inches: tuple):
    """The Fig. 1 layout: one column per task present, a measured row and, when there are
    projections, a projected row. Returns (tasks, systems, palette, rows, fig, axes)."""
    tasks = [t for t in TASK_LATENCY if t in set(lat.task)]
    systems = system_order(lat.system.unique())
    style()
    rows = 2 if not proj.empty else 1
    width, height = panel_inches
    fig, axes = plt.subplots(rows, len(tasks), figsize=(width * len(tasks), height * rows), squeeze=False)
    return tasks, systems, palette(systems), rows, fig, axes


def fig1_latency(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    """Occult Fig. 1: latency per system, model and task; ratios to naive; projected 4 x A6000."""
    title = "Fig. 1: latency of every system, model and task"
    traced = {d for d, _ in _trace_runs(df)}
    df = df[~df.run_dir.isin(traced)]
    lat = task_latency(df)
    if lat.empty:
        return _no_data(title, "whole-model runs (task=prefill/decode/train)")
    lat["ratio_to_naive"] = ratio_to(lat, "latency_ms")
    lat["source"] = cm.MEASURED
    profile = cm.load_profile(FIG1_PROFILE)
    proj = cm.projected_totals(cm.project_runs(df[df.task.isin(list(TASK_LATENCY))], profile, target="real"))
    if not proj.empty:
        proj["ratio_to_naive"] = ratio_to(proj, "moe_ms")
    tasks, systems, pal, rows, fig, axes = _task_panels(lat, proj, (4.6, 3.4))
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
        text.append(f"Projected ({FIG1_PROFILE}, the paper's 4 x RTX A6000; hatched): the cost model "
                    "(analysis.costmodel) applied to each run's measured per-peer rows, re-sized to the real "
                    "model's hidden size in bfloat16, expert FLOPs of the real D and F, the per-layer mean "
                    "repeated for the real model's MoE layers. It covers the expert-parallel part only "
                    "(all-to-alls and experts; attention and dense layers are the same for every system "
                    "and not modelled): adding that common part pulls every ratio toward 1, so whole-model "
                    "ratios lie between 1 and these. Profile "
                    f"numbers are spec-sheet figures with assumed efficiencies: {profile.source}.")
    else:
        text.append(f"No projection: {FIG1_PROFILE} needs runs at world size {profile.world_size}.")
    return [Section(title, text, tables, figs)]


# ---------------------------------------------------------------------------
# Fig. 1's batch axis: latency against sequences per rank, and the crossover
# ---------------------------------------------------------------------------


def _fastest(table: pd.DataFrame, value: str) -> pd.DataFrame:
    """Per (task, batch size): the system with the lowest ``value`` and by how much."""
    out = []
    for (task, batch), g in table.groupby(["task", "batch_size"]):
        g = g.dropna(subset=[value]).sort_values(value)
        if g.empty:
            continue
        second = g[value].iloc[1] / g[value].iloc[0] if len(g) > 1 else float("nan")
        out.append({"task": task, "batch_size": int(batch), "fastest": g.system.iloc[0],
                    "next_system_slower_by": second})
    return pd.DataFrame(out)


def crossover(fastest: pd.DataFrame, task: str, small: str = "reference", large: str = "occult") -> str:
    """Whether ``task``'s fastest system is ``small`` at the smallest batch and ``large`` at
    the largest (the paper's decoding crossover), in words."""
    sel = fastest[fastest.task == task].sort_values("batch_size")
    if sel.empty:
        return f"{task}: not run"
    first, last = sel.iloc[0], sel.iloc[-1]
    seen = first.fastest == small and last.fastest == large
    return (f"{task}: fastest at batch {first.batch_size} is {first.fastest}, at batch {last.batch_size} "
            f"{last.fastest}: the crossover ({small} at small batch, {large} at large) "
            f"{'appears' if seen else 'does not appear'}")


def fig1_batch(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    """Fig. 1's batch axis: each task's latency against the batch (sequences per rank) per
    system, measured here and projected on 4 x RTX A6000 (the reference too: its experts,
    all E on each device, nothing exchanged), and whether the decoding crossover appears."""
    title = "Fig. 1, batch axis: latency vs batch size, and the crossover"
    lat = task_latency(df)
    if lat.empty or lat.batch_size.nunique() < 2:
        return _no_data(title, "whole-model runs at two or more batch sizes")
    profile = cm.load_profile(FIG1_PROFILE)
    proj = cm.projected_totals(cm.project_runs(df[df.task.isin(list(TASK_LATENCY))], profile, target="real",
                                               single_device=True))
    tasks, systems, pal, rows, fig, axes = _task_panels(lat, proj, (4.4, 3.3))
    for j, task in enumerate(tasks):
        panels = [(axes[0][j], lat[lat.task == task], "latency_ms", "measured here (ms)")]
        if rows == 2:
            whole = " per decode (prompt + every step)" if task == "decode" else ""   # projections sum a run's calls
            panels.append((axes[1][j], proj[proj.task == task], "moe_ms", f"projected {FIG1_PROFILE},\nMoE ms{whole}"))
        for ax, data, col, label in panels:
            for system in systems:
                sel = data[data.system == system].sort_values("batch_size")
                if not sel.empty:
                    ax.plot(sel.batch_size, sel[col], marker="o", color=pal[system], label=system,
                            ls="--" if col == "moe_ms" else "-")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("batch (sequences per rank)")
            ax.set_ylabel(label)
            ax.set_title(f"{task}: {TASK_LATENCY_LABEL[task]}")
            if col == "moe_ms":
                ax.text(0.02, 0.95, "projected", transform=ax.transAxes, fontsize=7, va="top")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    figs = save(fig, Path(out_dir) / "fig1_batch")
    fastest = _fastest(lat, "latency_ms").assign(source=cm.MEASURED)
    tables = [("fig1_batch_measured", lat[["model", "task", "batch_size", "system", "impl", "latency_metric",
                                           "latency_ms", "tokens_per_s"]].sort_values(["task", "batch_size",
                                                                                       "system"]))]
    text = ["Measured: each task's latency (prefill: time to first token; decode: per-token latency; train: "
            "step time; slowest rank, median over samples) against the batch, on 4 ranks of this machine."]
    verdicts = [crossover(fastest, task) + " (measured)" for task in tasks]
    if not proj.empty:
        pfast = _fastest(proj, "moe_ms").assign(source=cm.PROJECTED)
        fastest = pd.concat([fastest, pfast], ignore_index=True)
        tables.append(("fig1_batch_projected", proj[["model", "task", "batch_size", "system", "target_model",
                                                     "a2a_ms_per_layer", "experts_ms_per_layer", "moe_ms",
                                                     "source", "profile"]].sort_values(["task", "batch_size",
                                                                                        "system"])))
        verdicts += [crossover(pfast, task) + f" (projected, {FIG1_PROFILE}, MoE layers)" for task in tasks]
        text.append(f"Projected ({FIG1_PROFILE}, the real OLMoE's width in bfloat16, MoE layers only): the cost "
                    "model on each run's measured per-peer rows, summed over the run's calls (decode: the "
                    "prompt and every generated token); the reference is its experts alone (all E on "
                    "each device, nothing exchanged). Expert time is a roofline of the profile's matmul rate "
                    "and memory bandwidth (each call reads the weights of at most min(local experts, rows) "
                    f"experts). Profile: {profile.source}.")
    tables.append(("fig1_batch_fastest", fastest))
    text.append("The paper reports a crossover in decoding: the single-device model best at small batch, Occult "
                "best at large batch (docs/paper_claims.md). Here: " + "; ".join(verdicts) + ".")
    return [Section(title, text, tables, figs)]


# ---------------------------------------------------------------------------
# Fig. 8: co-activation pattern before and after placement
# ---------------------------------------------------------------------------

FIG8_OPTIMISERS = ("greedy", "swap_search")
FIG8_LOAD_CAP = 1.25
FIG8_DEFAULT_DEVICES = 4


def _pick_trace(traces):
    """The OLMoE proxy's trace when there is one, else the first."""
    for run_dir, run in traces:
        if "olmoe" in str(run.model.iloc[0]):
            return run_dir, run
    return traces[0]


def fig8_pattern(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    """Occult Fig. 8: E x E co-activation heatmaps, experts ordered by device, before and after
    placement (optimised on one half of a trace, shown and scored on the other half)."""
    title = "Fig. 8: collaboration pattern before and after expert placement"
    traces = _trace_runs(df)
    if not traces:
        return _no_data(title, "routing traces (task.save_routing=true)")
    run_dir, run = _pick_trace(traces)
    trace, _ = load_trace(run_dir)
    layer = int(trace.layer.max())
    ids, _home = trace_topk(trace, layer)
    E, model = int(run.num_experts.iloc[0]), str(run.model.iloc[0])
    P = int(run.world_size.iloc[0]) if int(run.world_size.iloc[0]) > 1 else FIG8_DEFAULT_DEVICES
    half = ids.shape[0] // 2
    profile_ids, held_ids = ids[:half], ids[half:]
    placements = {"contiguous (original)": optimise("contiguous", profile_ids, E, P)}
    for name in FIG8_OPTIMISERS:
        placements[name] = optimise(name, profile_ids, E, P, load_cap=FIG8_LOAD_CAP, seed=0)
    rows = []
    base = placement_summary(held_ids, placements["contiguous (original)"])["ct_all"]
    for name, pl in placements.items():
        s = placement_summary(held_ids, pl)
        rows.append({"placement": name, "ct_all profiling": placement_summary(profile_ids, pl)["ct_all"],
                     "ct_all held-out": s["ct_all"], "C_T change vs original": s["ct_all"] / base - 1.0,
                     "intra_ratio held-out": s["intra_ratio"], "load max/mean held-out": s["load_max_over_mean"]})
    counts = coactivation(held_ids, E).double()
    counts.fill_diagonal_(0)
    share = (counts / held_ids.shape[0]).numpy()
    vmax = float(np.quantile(share[share > 0], 0.99)) if (share > 0).any() else 1.0
    style()
    fig, axes = plt.subplots(1, len(placements), figsize=(4.8 * len(placements), 4.4))
    e = E // P
    for ax, (name, pl), r in zip(np.atleast_1d(axes), placements.items(), rows):
        order = pl.global_order().numpy()
        im = ax.imshow(share[np.ix_(order, order)], cmap="magma_r", vmin=0, vmax=vmax, interpolation="nearest")
        for b in range(e, E, e):
            ax.axhline(b - 0.5, color="#1f77b4", lw=0.8)
            ax.axvline(b - 0.5, color="#1f77b4", lw=0.8)
        ax.set_title(f"{name}\nC_T = {r['ct_all held-out']:.2f} (held-out)", fontsize=9)
        ax.set_xlabel(f"expert (by device: {P} x {e})")
        ax.set_ylabel("expert (by device)")
        ax.grid(False)
    fig.colorbar(im, ax=axes, shrink=0.8, label="share of tokens choosing both experts")
    fig.suptitle(f"{model} ({router_kind(run)}), MoE layer {layer}: co-activation (held-out half of the trace)",
                 y=1.02)
    figs = save(fig, Path(out_dir) / "fig8_pattern")
    text = [f"Trace `{run_dir}`, layer {layer} (last MoE layer), {ids.shape[0]} tokens: placements are "
            f"optimised on the first half ({half} tokens) for {P} devices with load cap {FIG8_LOAD_CAP} "
            "(max/mean device load on the profiling half), then scored and drawn on the second half. "
            "Blocks on the diagonal are devices: co-activation inside them stays on one device. greedy is "
            "Occult's Algorithm 1 style grouping; swap_search minimises C_T directly "
            "(occult.placement). Paper: about 20 % lower C_T."]
    return [Section(title, text, [("fig8_placements", pd.DataFrame(rows))], figs)]


# ---------------------------------------------------------------------------
# Fig. 12: scaling
# ---------------------------------------------------------------------------

SCALING_PROFILES = ("sim_a6000x4", "sim_a6000x8", "sim_a6000x16", "sim_h100x8", "sim_h100x2node",
                    "sim_h100x8node")
SCALING_TARGET = "olmoe_layer"
# worlds larger than this run here for their per-peer bytes only: their ranks oversubscribe
# the cores too much for their times to mean anything
TIMED_MAX_WORLD = 8


def fig12_scaling(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    """Occult Fig. 12: scaling with the number of devices; measured here up to
    TIMED_MAX_WORLD ranks, projected by the cost model on the sim_* profiles."""
    title = "Fig. 12: scaling with the number of devices"
    t = layer_table(df)
    if t.empty:
        return _no_data(title, "task=layer runs")
    t["source"] = cm.MEASURED
    target = cm.target_model(SCALING_TARGET)
    layer_df = df[df.task == "layer"]
    projected, missing = [], []
    for name in SCALING_PROFILES:
        profile = cm.load_profile(name)
        tot = cm.projected_totals(cm.project_runs(layer_df, profile, target))
        if tot.empty:
            missing.append(f"{name} (needs task=layer runs at world_size {profile.world_size})")
            continue
        projected.append(tot)
    proj = pd.concat(projected, ignore_index=True) if projected else pd.DataFrame()
    style()
    pal = palette(t.system.unique())
    order = system_order(t.system.unique())
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    timed = t[t.world_size <= TIMED_MAX_WORLD]
    for system in order:
        g = timed[timed.system == system].groupby("world_size").layer_fwd_bwd_ms.median()
        axes[0].plot(g.index, g.values, "-o", color=pal[system], label=system)
        b = t[t.system == system].groupby("world_size").remote_MB_per_rank.median()
        axes[1].plot(b.index, b.values, "-o", color=pal[system], label=system)
    axes[0].set_title("MoE layer fwd+bwd\nmeasured here")
    axes[0].set_ylabel("time (ms, slowest rank)")
    axes[1].set_title("remote bytes sent per rank (dispatch + combine, fwd)\nmeasured")
    axes[1].set_ylabel("MB per rank per iteration")
    if not proj.empty:
        proj["family"] = proj.profile.str.extract(r"sim_([a-z]+\d+)", expand=False)
        for (system, family), g in proj.groupby(["system", "family"]):
            g = g.groupby("world_size").moe_ms.median()
            axes[2].plot(g.index, g.values, "--" if family == "a6000" else ":", marker="s", color=pal[system],
                         label=f"{system}, {family}")
        axes[2].text(0.99, 0.98, "projected (cost model)", transform=axes[2].transAxes, ha="right", va="top",
                     fontsize=8, style="italic")
    axes[2].set_title(f"MoE layer fwd+bwd at {SCALING_TARGET} width (bf16)\nprojected by the cost model")
    axes[2].set_ylabel("projected time (ms)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices (world size P)")
        ax.legend(fontsize=7)
    figs = save(fig, Path(out_dir) / "fig12_scaling")
    measured = t[["system", "world_size", "cluster", "top_k", "routing", "ct_all", "remote_MB_per_rank",
                  "a2a_fwd_bwd_ms", "layer_fwd_bwd_ms", "source"]].copy()
    measured.loc[measured.world_size > TIMED_MAX_WORLD, ["a2a_fwd_bwd_ms", "layer_fwd_bwd_ms"]] = np.nan
    tables = [("fig12_measured", measured.sort_values(["system", "world_size"]))]
    if not proj.empty:
        tables.append(("fig12_projected", proj[["system", "world_size", "profile", "target_model",
                                                "a2a_ms_per_layer", "experts_ms_per_layer", "moe_ms", "source"]]
                       .sort_values(["profile", "system"])))
    text = [f"Measured here: task=layer runs at P <= {TIMED_MAX_WORLD} (times) and every P (per-peer bytes; "
            f"runs above {TIMED_MAX_WORLD} ranks oversubscribe this machine's cores, so their times are left "
            "out). Projected (dashed: RTX A6000 over PCIe, dotted: H100): the cost model on each profile, "
            f"from the runs measured at that profile's world size, re-sized to {SCALING_TARGET}'s width "
            f"(D={target.hidden_size}, F={target.expert_ffn_size}) in bfloat16; forward and backward."]
    if missing:
        text.append("Not projected: " + "; ".join(missing) + ".")
    return [Section(title, text, tables, figs)]


# ---------------------------------------------------------------------------
# the cost model against this machine (added to every report that has the runs)
# ---------------------------------------------------------------------------

CHECK_TARGET = 0.25


def cpu_profile(df: pd.DataFrame):
    """The loopback profile: fitted from this sweep's calibration runs when it has them
    (same load as its runs), else conf/profile/sim_cpu_loopback.yaml; (profile, where)."""
    from .calibrate import fit_points, profile_dict
    points = fit_points(df[df.task == "calibrate"]) if "task" in df else []
    if points:
        return cm.profile_from_dict(profile_dict(points, "calibration runs of this sweep")), \
            "fitted to this sweep's calibration runs (task.name=calibrate)"
    try:
        p = cm.load_profile("sim_cpu_loopback")
        return p, f"conf/profile/sim_cpu_loopback.yaml ({p.source})"
    except FileNotFoundError:
        return None, ""


def costmodel_check(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    """Projected vs measured all-to-all and expert times of this sweep's task=layer runs."""
    title = "Cost model vs this machine"
    profile, where = cpu_profile(df)
    chk = cm.check_against_measured(df, profile)
    if chk.empty:
        return []
    chk["abs_error"] = chk.error.abs()
    agg = chk.assign(kind=np.where(chk.quantity == "a2a_total", "all-to-all, iteration total",
                                   np.where(chk.quantity.str.startswith("a2a"), "all-to-all, one collective",
                                            "experts, forward"))) \
        .groupby(["kind", "world_size"]).abs_error.agg(["count", "median", "max"]).reset_index() \
        .rename(columns={"count": "n", "median": "median |error|", "max": "max |error|"})
    style()
    fig, ax = plt.subplots(figsize=(5, 4.2))
    shown = chk.assign(**{"world size P": chk.world_size.astype(str),
                          "quantity": np.where(chk.quantity.str.startswith("a2a"), "all-to-all", "experts")})
    sns.scatterplot(data=shown, x="measured_ms", y="projected_ms", hue="world size P", style="quantity", ax=ax, s=30)
    lim = [max(chk[["measured_ms", "projected_ms"]].min().min(), 1e-3), chk[["measured_ms", "projected_ms"]].max().max()]
    xs = np.geomspace(*lim, 20)
    ax.plot(xs, xs, color="k", lw=0.8)
    ax.fill_between(xs, xs * (1 - CHECK_TARGET), xs * (1 + CHECK_TARGET), color="grey", alpha=0.15,
                    label=f"+-{CHECK_TARGET:.0%}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured (ms, slowest rank, median)")
    ax.set_ylabel("projected by the cost model (ms)")
    ax.legend(fontsize=7)
    figs = save(fig, Path(out_dir) / "costmodel_check")
    total = chk[chk.quantity == "a2a_total"]
    own = (chk.calibration == "own run").groupby(chk.run_dir).first()
    source = (f"{int(own.sum())} of {len(own)} run(s) measured their own loopback right before timing "
              "(task.calibrate=true: equal-split all-to-alls and expert matmuls, not the runs' own collectives) "
              "and are projected with that calibration")
    if (~own).any():
        source += f"; the others with the loopback profile {where}"
    text = [f"Loopback calibration: {source}. For every task=layer run with task.sync_collectives=true "
            "(a2a_time is then the transfer, after a barrier), the cost model projects each collective from "
            "the run's own per-peer bytes and the calibrated latency and bandwidth at the run's world size, "
            "and the expert time from the run's FLOPs and the calibrated matmul throughput. "
            f"Target: all-to-all error below {CHECK_TARGET:.0%}. Median |error| of the iteration's "
            f"all-to-all total: {total.abs_error.median():.1%} over {len(total)} run(s); of single "
            f"collectives: {chk[chk.quantity.str.startswith('a2a ')].abs_error.median():.1%}."]
    return [Section(title, text, [("costmodel_check_summary", agg),
                                  ("costmodel_check", chk.drop(columns=["abs_error"]))], figs)]


BUILDERS: dict[str, Callable] = {
    "fig1_latency": fig1_latency, "fig1_batch": fig1_batch, "fig3_lcc": fig3_lcc,
    "table1_ct_runtime": table1_ct_runtime,
    "fig8_pattern": fig8_pattern, "fig12_scaling": fig12_scaling, "costmodel_check": costmodel_check,
}


def resolve_builders(spec) -> list[Callable]:
    """``"fig3_lcc,table1_ct_runtime"`` (names in BUILDERS or dotted paths) -> functions."""
    names = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else list(spec or [])) if s.strip()]
    out = []
    for name in names:
        short = name.rsplit(".", 1)[-1] if name.startswith("analysis.figures.") else name
        if short in BUILDERS:
            out.append(BUILDERS[short])
        elif "." in name:
            module, _, attr = name.rpartition(".")
            try:
                out.append(getattr(importlib.import_module(module), attr))
            except (ImportError, AttributeError) as exc:
                raise ValueError(f"report={name!r}: cannot import it ({exc}); builders: {sorted(BUILDERS)}") from exc
        else:
            raise ValueError(f"report={name!r}: unknown figure builder; allowed: {sorted(BUILDERS)} "
                             "or a dotted path")
    return out
