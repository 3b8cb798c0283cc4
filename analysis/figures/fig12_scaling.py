"""Occult Fig. 12: scaling with the number of devices (``report: fig12_scaling``):
task=layer runs measured here up to TIMED_MAX_WORLD ranks (bytes at every P), projected
by the cost model on the sim_* profiles (dashed, labelled projected).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from occult.ep.profiles import load_profile

from ..plots import markers, palette, save, style, system_order
from ..projection import MEASURED, project_runs, projected_totals, target_model
from ..sections import Section, no_data
from ..summary import layer_table

SCALING_PROFILES = ("sim_a6000x4", "sim_a6000x8", "sim_a6000x16", "sim_h100x8", "sim_h100x2node",
                    "sim_h100x8node")
SCALING_TARGET = "olmoe_layer"
# worlds larger than this run here for their per-peer bytes only: their ranks oversubscribe
# the cores too much for their times to mean anything
TIMED_MAX_WORLD = 8


def build(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    """Occult Fig. 12: scaling with the number of devices; measured here up to
    TIMED_MAX_WORLD ranks, projected by the cost model on the sim_* profiles."""
    title = "Fig. 12: scaling with the number of devices"
    t = layer_table(df)
    if t.empty:
        return no_data(title, "task=layer runs")
    t["source"] = MEASURED
    target = target_model(SCALING_TARGET)
    layer_df = df[df.task == "layer"]
    projected, missing = [], []
    for name in SCALING_PROFILES:
        profile = load_profile(name)
        tot = projected_totals(project_runs(layer_df, profile, target))
        if tot.empty:
            missing.append(f"{name} (needs task=layer runs at world size {profile.sizes()})")
            continue
        projected.append(tot)
    proj = pd.concat(projected, ignore_index=True) if projected else pd.DataFrame()
    style()
    pal, mark = palette(t.system.unique()), markers(t.system.unique())
    order = system_order(t.system.unique())
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    timed = t[t.world_size <= TIMED_MAX_WORLD]
    for system in order:
        g = timed[timed.system == system].groupby("world_size").layer_fwd_bwd_ms.median()
        axes[0].plot(g.index, g.values, "-", marker=mark[system], color=pal[system], label=system)
        b = t[t.system == system].groupby("world_size").remote_MB_per_rank.median()
        axes[1].plot(b.index, b.values, "-", marker=mark[system], color=pal[system], label=system)
    axes[0].set_title("MoE layer fwd+bwd\nmeasured here")
    axes[0].set_ylabel("time (ms, slowest rank)")
    axes[1].set_title("remote bytes sent per rank (dispatch + combine, fwd)\nmeasured")
    axes[1].set_ylabel("MB per rank per iteration")
    if not proj.empty:
        proj["family"] = proj.profile.str.extract(r"sim_([a-z]+\d+)", expand=False)
        for (system, family), g in proj.groupby(["system", "family"]):
            g = g.groupby("world_size").moe_ms.median()
            axes[2].plot(g.index, g.values, "--" if family == "a6000" else ":", marker=mark[system], color=pal[system],
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
