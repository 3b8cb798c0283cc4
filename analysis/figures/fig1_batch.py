"""Fig. 1's batch axis (``report: fig1_batch``): each task's latency against the batch
(sequences per rank) per system, measured here and projected on 4 x RTX A6000, and
whether the paper's decoding crossover (the single-device model best at small batch,
Occult at large) appears.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from occult.ep.profiles import load_profile

from ..plots import markers, save
from ..projection import MEASURED, PROJECTED, project_runs, projected_totals
from ..sections import Section, no_data
from ..summary import TASK_LATENCY, TASK_LATENCY_LABEL, task_latency
from .fig1_latency import FIG1_PROFILE, task_panels


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


def build(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    """Fig. 1's batch axis: each task's latency against the batch (sequences per rank) per
    system, measured here and projected on 4 x RTX A6000 (the reference too: its experts,
    all E on each device, nothing exchanged), and whether the decoding crossover appears."""
    title = "Fig. 1, batch axis: latency vs batch size, and the crossover"
    lat = task_latency(df)
    if lat.empty or lat.batch_size.nunique() < 2:
        return no_data(title, "whole-model runs at two or more batch sizes")
    profile = load_profile(FIG1_PROFILE)
    proj = projected_totals(project_runs(df[df.task.isin(list(TASK_LATENCY))], profile, target="real",
                                               single_device=True))
    tasks, systems, pal, rows, fig, axes = task_panels(lat, proj, (4.4, 3.3))
    mark = markers(systems)
    for j, task in enumerate(tasks):
        panels = [(axes[0][j], lat[lat.task == task], "latency_ms", "measured here (ms)")]
        if rows == 2:
            whole = " per decode (prompt + every step)" if task == "decode" else ""   # projections sum a run's calls
            panels.append((axes[1][j], proj[proj.task == task], "moe_ms", f"projected {FIG1_PROFILE},\nMoE ms{whole}"))
        for ax, data, col, label in panels:
            for system in systems:
                sel = data[data.system == system].sort_values("batch_size")
                if not sel.empty:
                    ax.plot(sel.batch_size, sel[col], marker=mark[system], color=pal[system], label=system,
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
    fastest = _fastest(lat, "latency_ms").assign(source=MEASURED)
    tables = [("fig1_batch_measured", lat[["model", "task", "batch_size", "system", "impl", "latency_metric",
                                           "latency_ms", "tokens_per_s"]].sort_values(["task", "batch_size",
                                                                                       "system"]))]
    text = ["Measured: each task's latency (prefill: time to first token; decode: per-token latency; train: "
            "step time; slowest rank, median over samples) against the batch, on 4 ranks of this machine."]
    verdicts = [crossover(fastest, task) + " (measured)" for task in tasks]
    if not proj.empty:
        pfast = _fastest(proj, "moe_ms").assign(source=PROJECTED)
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
