"""Occult Table 1: C_T against the measured all-to-all and layer time, with a linear fit
and Pearson's r per system and cluster (``report: table1_ct_runtime``), from the
task=layer runs.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from ..plots import palette, save, style, system_order
from ..sections import Section, no_data
from ..summary import layer_table


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


T1_Y = {"remote_MB_per_rank": "remote bytes sent per rank, fwd (MB)",
        "a2a_fwd_ms": "all-to-all, forward (ms)", "a2a_fwd_bwd_ms": "all-to-all, fwd+bwd (ms)",
        "layer_fwd_ms": "MoE layer, forward (ms)", "layer_fwd_bwd_ms": "MoE layer, fwd+bwd (ms)"}


def build(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    """Occult Table 1: C_T vs measured all-to-all and layer time; linear fit and Pearson r."""
    title = "Table 1: C_T against measured all-to-all and layer time"
    t = layer_table(df)
    if t.empty:
        return no_data(title, "task=layer runs")
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
