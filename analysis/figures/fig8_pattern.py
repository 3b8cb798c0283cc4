"""Occult Fig. 8: the co-activation pattern before and after expert placement
(``report: fig8_pattern``): E x E heatmaps, experts ordered by device, of the OLMoE
proxy's traced routing, placements optimised on one half of the trace and scored on the
other (:mod:`occult.placement`).
"""
from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from occult.placement import coactivation, optimise, placement_summary
from occult.routing_traces import load_trace, trace_topk

from ..plots import save, style
from ..sections import Section, no_data
from ..traces import router_kind, traced_runs

FIG8_OPTIMISERS = ("greedy", "swap_search")
FIG8_LOAD_CAP = 1.25
FIG8_DEFAULT_DEVICES = 4


def _pick_trace(traces):
    """The OLMoE proxy's trace when there is one, else the first."""
    for run_dir, run in traces:
        if "olmoe" in str(run.model.iloc[0]):
            return run_dir, run
    return traces[0]


def build(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    """Occult Fig. 8: E x E co-activation heatmaps, experts ordered by device, before and after
    placement (optimised on one half of a trace, shown and scored on the other half)."""
    title = "Fig. 8: collaboration pattern before and after expert placement"
    traces = traced_runs(df)
    if not traces:
        return no_data(title, "routing traces (task.save_routing=true)")
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
    text = [f"Trace of run `{run.run_id.iloc[0]}`, layer {layer} (last MoE layer), {ids.shape[0]} tokens: placements are "
            f"optimised on the first half ({half} tokens) for {P} devices with load cap {FIG8_LOAD_CAP} "
            "(max/mean device load on the profiling half), then scored and drawn on the second half. "
            "Blocks on the diagonal are devices: co-activation inside them stays on one device. greedy is "
            "Occult's Algorithm 1 style grouping; swap_search minimises C_T directly "
            "(occult.placement). Paper: about 20 % lower C_T."]
    return [Section(title, text, [("fig8_placements", pd.DataFrame(rows))], figs)]
