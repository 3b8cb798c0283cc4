"""The load axis of a set of runs: received rows max / mean, the slowest rank of every timed
phase with its min / mean / max over ranks, and each all-to-all's bandwidth.

* ``recv_max_over_mean``: per layer, the dispatch's received rows (forward) max / mean over
  ranks, from the split sizes that went into the collectives (the field's MaxVio is this
  minus 1); a run's value is its mean over layers, ``recv_max_over_mean_worst`` the largest.
* :func:`phase_table`: per run, metric (``time`` spans, ``a2a_time`` collectives), phase and
  pass: each timed sample summed over layers per rank, then its min / mean / max over ranks
  and the slowest rank; medians over samples, and the rank slowest in most samples.
* :func:`bandwidth_table`: per run, phase and pass of every timed all-to-all, algbw and busbw
  as nccl-tests defines them for all-to-all (S = the bytes a rank sends, its own block
  included; with uneven splits S is each rank's own total; algbw = S / t, busbw = algbw x
  (n - 1) / n): the median over samples and layers of the mean over ranks, and of the
  slowest rank's (the least over ranks).

Nothing here starts ranks: it reads result tables.
"""
from __future__ import annotations

import pandas as pd

# the phase whose slowest rank a run's summary names, by preference: (metric, phase, pass)
HEADLINE_PHASES = [("time", "layer", "forward+backward"), ("time", "layer", "forward"),
                   ("time", "train_step", ""), ("time", "prefill", "forward"), ("time", "decode_step", "")]


def recv_balance(df: pd.DataFrame) -> pd.DataFrame:
    """Per run: ``recv_max_over_mean`` (mean over layers) and ``recv_max_over_mean_worst``."""
    sel = df[(df.metric == "recv_max_over_mean") & (df["rank"] == -1)]
    g = sel.groupby("run_id").value
    return pd.DataFrame({"recv_max_over_mean": g.mean(), "recv_max_over_mean_worst": g.max()})


def phase_table(df: pd.DataFrame, metrics=("time", "a2a_time")) -> pd.DataFrame:
    """Per run, metric, phase and pass: min / mean / max over ranks (ms, medians over samples)
    and ``slowest_rank`` (the rank slowest in most samples; ``slowest_share``, in how many)."""
    sel = df[df.metric.isin(list(metrics)) & (df["sample"] >= 0) & (df["rank"] >= 0)]
    if sel.empty:
        return pd.DataFrame()
    keys = ["run_id", "metric", "phase", "pass"]
    per_rank = sel.groupby(keys + ["sample", "rank"]).value.sum().reset_index()
    by_sample = per_rank.groupby(keys + ["sample"]).value
    spread = pd.DataFrame({"min_ms": by_sample.min(), "mean_ms": by_sample.mean(), "max_ms": by_sample.max()})
    spread["slowest"] = per_rank.loc[by_sample.idxmax(), "rank"].to_numpy()
    out = spread.groupby(keys)[["min_ms", "mean_ms", "max_ms"]].median()
    mode = spread.groupby(keys).slowest.agg(lambda s: s.value_counts().index[0])
    share = spread.groupby(keys).slowest.agg(lambda s: s.value_counts().iloc[0] / len(s))
    out["slowest_rank"], out["slowest_share"] = mode, share
    return out.reset_index()


def slowest_rank(df: pd.DataFrame) -> pd.Series:
    """Per run: the slowest rank of its headline phase (a layer's forward+backward, else its
    forward; a whole model's step), from :func:`phase_table`."""
    table = phase_table(df, ("time",))
    out = {}
    if table.empty:
        return pd.Series(dtype=float)
    for run_id, t in table.groupby("run_id"):
        for metric, phase, direction in HEADLINE_PHASES:
            hit = t[(t.metric == metric) & (t.phase == phase) & (t["pass"] == direction)]
            if not hit.empty:
                out[run_id] = int(hit.slowest_rank.iloc[0])
                break
    return pd.Series(out, dtype=float)


def bandwidth_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per run, phase and pass of the timed all-to-alls: ``algbw_GBps`` / ``busbw_GBps`` (median
    over samples and layers of the mean over ranks) and ``*_slowest_GBps`` (of the least over
    ranks), GB/s = 1e9 bytes/s."""
    sel = df[df.metric.isin(["algbw", "busbw"]) & (df["sample"] >= 0)]
    if sel.empty:
        return pd.DataFrame()
    keys = ["run_id", "phase", "pass"]
    per = sel.groupby(keys + ["metric", "layer", "sample"]).value.agg(["mean", "min"]).reset_index()
    med = per.groupby(keys + ["metric"])[["mean", "min"]].median().unstack("metric")
    out = pd.DataFrame({"algbw_GBps": med[("mean", "algbw")], "busbw_GBps": med[("mean", "busbw")],
                        "algbw_slowest_GBps": med[("min", "algbw")], "busbw_slowest_GBps": med[("min", "busbw")]})
    return out.reset_index()
