"""The cost model against this machine (``report: costmodel_check``, for the
experiments that name it): for every task=layer run with ``task.sync_collectives=true``
(``a2a_time`` is then the transfer, after a barrier), each collective, their per-iteration
total and the experts projected from the run's own per-peer bytes and FLOPs on the
loopback calibration, beside what the run measured, with the error.

A run that calibrated its own world right before timing (``task.calibrate=true``) is
projected with that calibration (same load as its measurements); any other with the
sweep's calibration runs (``task=calibrate``) or, without them, conf/profile/sim_cpu_loopback.yaml.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from occult.ep.profiles import Profile, load_profile, profile_from_dict

from ..calibration import fit_points, profile_dict
from ..plots import save, style
from ..projection import project_run
from ..sections import Section
from ..summary import slowest_rank_ms

CHECK_TARGET = 0.25


def cpu_profile(df: pd.DataFrame):
    """The loopback profile: fitted from this sweep's calibration runs when it has them
    (same load as its runs), else conf/profile/sim_cpu_loopback.yaml; (profile, where)."""
    points = fit_points(df[df.task == "calibrate"]) if "task" in df else []
    if points:
        return profile_from_dict(profile_dict(points, "calibration runs of this sweep")), \
            "fitted to this sweep's calibration runs (task.name=calibrate)"
    try:
        p = load_profile("sim_cpu_loopback")
        return p, f"conf/profile/sim_cpu_loopback.yaml ({p.source})"
    except FileNotFoundError:
        return None, ""


def build(df: pd.DataFrame, out_dir: Path) -> list[Section]:
    """Projected vs measured all-to-all and expert times of this sweep's task=layer runs."""
    title = "Cost model vs this machine"
    profile, where = cpu_profile(df)
    chk = check_against_measured(df, profile)
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
    own = (chk.calibration == "own run").groupby(chk.run_id).first()
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
    return [Section(title, text, [("costmodel_check_summary", agg)], figs,
                    data=[("costmodel_check", chk.drop(columns=["abs_error"]))])]


def own_profile(run: pd.DataFrame) -> Optional[Profile]:
    """The loopback profile fitted to the calibration a run made of its own world right
    before its timed iterations (``task.calibrate=true``), or None."""
    if not run.metric.str.startswith("calib_").any():
        return None
    points = fit_points(run)
    return profile_from_dict(profile_dict(points, "this run's own calibration")) if points else None


def check_against_measured(df: pd.DataFrame, profile: Optional[Profile]) -> pd.DataFrame:
    """Projected vs measured all-to-all (per phase and pass) and expert times of the
    ``task=layer`` runs that timed collectives apart (``task.sync_collectives=true``:
    they have ``a2a_wait`` rows, so ``a2a_time`` is the transfer, not the wait).

    A run that calibrated its own world first (``task.calibrate=true``) is projected
    with that calibration (same load as its measurements; column ``calibration`` =
    ``own run``), any other with ``profile`` (``sweep``; runs are skipped when it is None).
    One row per (run, quantity): ``measured_ms`` (slowest rank, median over samples),
    ``projected_ms``, ``error`` = projected / measured - 1. Quantity ``a2a_total`` is the
    sum over the iteration's collectives.
    """
    rows = []
    for run_id, run in df[df.task == "layer"].groupby("run_id", sort=False):
        P = int(run.world_size.iloc[0])
        if P < 2 or not (run.metric == "a2a_wait").any():
            continue
        run_profile, calibration = own_profile(run), "own run"
        if run_profile is None:
            run_profile, calibration = profile, "sweep"
        if run_profile is None or (run_profile.calibration and P not in run_profile.calibration):
            continue
        proj = project_run(run, run_profile)
        ctx = {"run_id": run_id, "system": run.system.iloc[0], "world_size": P,
               "top_k": int(run.top_k.iloc[0]), "routing": run.routing.iloc[0], "calibration": calibration}
        meas_total, proj_total = 0.0, 0.0
        for _, p in proj[proj.component.str.startswith("a2a:")].iterrows():
            phase = p.component.split(":", 1)[1]
            m = slowest_rank_ms(run, "a2a_time", phase, p["pass"]).get(run_id, np.nan)
            meas_total += m
            proj_total += p.ms
            rows.append({**ctx, "quantity": f"a2a {phase} {p['pass']}", "measured_ms": m, "projected_ms": p.ms})
        rows.append({**ctx, "quantity": "a2a_total", "measured_ms": meas_total, "projected_ms": proj_total})
        exp = proj[(proj.component == "experts") & (proj["pass"] == "forward")].ms.sum()
        m = slowest_rank_ms(run, "time", "experts", "forward").get(run_id, np.nan)
        rows.append({**ctx, "quantity": "experts forward", "measured_ms": m, "projected_ms": exp})
    out = pd.DataFrame(rows)
    if not out.empty:
        out["error"] = out.projected_ms / out.measured_ms - 1.0
    return out
