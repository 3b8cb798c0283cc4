"""The expert-placement study's pure parts: judging a placement on held-out routing, the
jobs, the results table and the artifacts. Which optimisers run at which load caps is the
task's config (``task.optimisers``, ``task.load_caps``, conf/task/placement_study.yaml) (the ranks' part is
:mod:`occult.tasks.placement_study`, the figure :mod:`analysis.figures.placement_study`).

Shapes: T tokens, K top-k, E experts, P devices.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import pandas as pd
import torch

# the table's figures per (optimiser, cap, layer), with their units
UNITS = {"ct_all": "devices/token", "ct_remote": "devices/token", "intra_ratio": "ratio",
         "load_max_over_mean": "ratio", "busiest_rows_vs_contiguous": "ratio",
         "busiest_sfd_rows_vs_contiguous": "ratio", "solve_s": "s", "ct_all_profiling": "devices/token",
         "load_max_over_mean_profiling": "ratio"}


def cap_label(cap: Optional[float]) -> str:
    """``none`` or the cap as written (``1.25``)."""
    return "none" if cap is None else f"{cap:g}"


def sfd_rows_per_device(topk_ids_TK: torch.Tensor, placement) -> torch.Tensor:
    """Occult rows each device receives: tokens with at least one expert there, [P]."""
    from ..ep.accounting import device_hits
    return device_hits(topk_ids_TK, placement).sum(0)


def judge(placement, profile_ids: torch.Tensor, held_ids: torch.Tensor, held_home: torch.Tensor) -> dict:
    """Held-out C_T (all, remote), intra ratio, load balance and busiest device rows; the
    profiling C_T and load balance."""
    from ..ep import ct_all, ct_remote, intra_ratio
    from . import device_load, load_max_over_mean

    return {"ct_all": ct_all(held_ids, placement), "ct_remote": ct_remote(held_ids, placement, held_home),
            "intra_ratio": intra_ratio(held_ids, placement),
            "load_max_over_mean": load_max_over_mean(held_ids, placement),
            "busiest_rows": int(device_load(held_ids, placement).max()),
            "busiest_sfd_rows": int(sfd_rows_per_device(held_ids, placement).max()),
            "ct_all_profiling": ct_all(profile_ids, placement),
            "load_max_over_mean_profiling": load_max_over_mean(profile_ids, placement)}


def study_jobs(layers: list, optimisers, load_caps) -> list:
    """(optimiser, cap, layer) of every job; optimiser outermost, so that handing job i to
    rank i % P spreads each optimiser's (slow swap_search) jobs evenly."""
    return [(name, cap, layer) for name in optimisers for cap in load_caps for layer in layers]


def _study_order(optimisers, load_caps):
    """A sort key that puts (optimiser, cap label, layer) columns in the study's order."""
    order = {name: i for i, name in enumerate(optimisers)}
    caps = {cap_label(c): i for i, c in enumerate(load_caps)}
    return lambda s: s.map(order) if s.name == "optimiser" else s.map(caps) if s.name == "load_cap" else s


def placement_frame(results: list, optimisers, load_caps) -> pd.DataFrame:
    """The ``placement.csv`` table from the job results (busiest rows relative to the
    contiguous placement of the same layer), in the study's order."""
    df = pd.DataFrame([{k: v for k, v in r.items() if k != "groups"} for r in results])
    base = df[(df.optimiser == "contiguous") & (df.load_cap == "none")].set_index("layer")
    df["busiest_rows_vs_contiguous"] = df.busiest_rows / df.layer.map(base.busiest_rows)
    df["busiest_sfd_rows_vs_contiguous"] = df.busiest_sfd_rows / df.layer.map(base.busiest_sfd_rows)
    df = df.sort_values(["optimiser", "load_cap", "layer"], key=_study_order(optimisers, load_caps))
    df = df.reset_index(drop=True)
    cols = ["optimiser", "load_cap", "layer", "ct_all", "ct_remote", "intra_ratio", "load_max_over_mean",
            "busiest_rows_vs_contiguous", "solve_s", "busiest_sfd_rows_vs_contiguous", "ct_all_profiling",
            "load_max_over_mean_profiling"]
    return df[cols]


def best_per_cap(results: list, load_caps) -> dict:
    """{cap label: {layer: result}}: per layer, the lowest profiling C_T among placements
    within the cap on the profiling set (the most balanced one if none is)."""
    best: dict = {}
    for cap in load_caps:
        label = cap_label(cap)
        for r in (r for r in results if r["load_cap"] == label):
            ok = cap is None or r["load_max_over_mean_profiling"] <= cap + 1e-9
            key = (not ok, r["ct_all_profiling"] if ok else r["load_max_over_mean_profiling"],
                   r["load_max_over_mean_profiling"])
            cur = best.setdefault(label, {}).get(r["layer"])
            if cur is None or key < cur[0]:
                best[label][r["layer"]] = (key, r)
    return {label: {layer: kr[1] for layer, kr in per.items()} for label, per in best.items()}


def save_artifacts(results: list, out_dir: Path, meta: dict, load_caps) -> list:
    """One placement artifact per cap (best placement per layer); returns the paths."""
    from ..ep import Placement
    from .artifacts import save_placements

    paths = []
    for label, per_layer in best_per_cap(results, load_caps).items():
        path = out_dir / f"placements_cap-{label}.json"
        save_placements(path, {layer: Placement.from_groups(r["groups"]) for layer, r in per_layer.items()},
                        {**meta, "load_cap": None if label == "none" else float(label),
                         "layers": {str(layer): {"optimiser": r["optimiser"], "ct_all_heldout": r["ct_all"],
                                                 "ct_all_profiling": r["ct_all_profiling"],
                                                 "load_max_over_mean_heldout": r["load_max_over_mean"]}
                                    for layer, r in sorted(per_layer.items())}})
        paths.append(path)
    return paths


def study_rows(df: pd.DataFrame) -> list:
    """Result rows of the study: one per figure, ``phase`` = ``<optimiser>@<cap>``."""
    from ..records import row

    return [row(metric, getattr(r, metric), unit, layer=int(r.layer), phase=f"{r.optimiser}@{r.load_cap}")
            for r in df.itertuples() for metric, unit in UNITS.items()]


def frame_from_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """The study's table back from its result rows (one run): one row per (optimiser,
    cap, layer), in the study's order (that of the rows, which :func:`study_rows` wrote in it)."""
    sel = rows[rows.metric.isin(list(UNITS)) & rows.phase.str.contains("@")]
    wide = sel.pivot_table(index=["phase", "layer"], columns="metric", values="value").reset_index()
    wide[["optimiser", "load_cap"]] = wide.phase.str.split("@", expand=True)
    first = {phase: i for i, phase in enumerate(dict.fromkeys(sel.phase))}
    wide = wide.assign(order=wide.phase.map(first)).sort_values(["order", "layer"])
    return wide[["optimiser", "load_cap", "layer", *UNITS]].reset_index(drop=True)
