"""Summaries of the long results table: one row per run, ratios between systems.

Times: a step lasts as long as its slowest rank, so each timed sample is
first reduced to the maximum over ranks, then summarised by the median over
samples. Ratios compare systems measured in the same sweep with everything
else equal.
"""
from __future__ import annotations

import pandas as pd

RUN_KEYS = ["experiment", "model", "task", "cluster", "world_size", "num_experts", "top_k",
            "hidden_size", "expert_ffn_size", "tokens_per_rank", "routing", "batch_size", "seq_len", "seed"]
SYSTEM_KEYS = ["system", "impl"]


def slowest_rank_ms(df: pd.DataFrame, metric: str, phase: str, direction: str) -> pd.Series:
    """Median over samples of the slowest rank's time, per run (indexed by run_dir)."""
    sel = df[(df.metric == metric) & (df.phase == phase) & (df["pass"] == direction) & (df["sample"] >= 0)]
    if sel.empty:
        return pd.Series(dtype=float)
    per_sample = sel.groupby(["run_dir", "sample", "rank"]).value.sum().groupby(["run_dir", "sample"]).max()
    return per_sample.groupby("run_dir").median()


def global_value(df: pd.DataFrame, metric: str, phase: str = "", direction: str = "") -> pd.Series:
    """The all-ranks value (rank = -1) of a metric, averaged over layers, per run."""
    sel = df[(df.metric == metric) & (df["rank"] == -1) & (df.phase == phase) & (df["pass"] == direction)]
    return sel.groupby("run_dir").value.mean()


def sent_bytes(df: pd.DataFrame, phase: str, direction: str, remote_only: bool = True) -> pd.Series:
    """Bytes sent by all ranks in one phase and pass (per iteration), per run."""
    sel = df[(df.metric == "bytes") & (df.phase == phase) & (df["pass"] == direction)]
    if remote_only:
        sel = sel[sel.src_rank != sel.dst_rank]
    return sel.groupby("run_dir").value.sum()


def run_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run: routing metrics, rows, bytes and phase times (ms, slowest rank)."""
    runs = df.groupby("run_dir")[RUN_KEYS + SYSTEM_KEYS].first()
    cols = {
        "ct_all": global_value(df, "ct_all"),
        "ct_remote": global_value(df, "ct_remote"),
        "intra_ratio": global_value(df, "intra_ratio"),
        "dispatch_rows_per_token": global_value(df, "rows_per_token", "dispatch", "forward"),
        "dispatch_remote_MB": sent_bytes(df, "dispatch", "forward") / 1e6,
        "a2a_dispatch_fwd_ms": slowest_rank_ms(df, "a2a_time", "dispatch", "forward"),
        "a2a_combine_fwd_ms": slowest_rank_ms(df, "a2a_time", "combine", "forward"),
        "a2a_dispatch_bwd_ms": slowest_rank_ms(df, "a2a_time", "dispatch", "backward"),
        "a2a_combine_bwd_ms": slowest_rank_ms(df, "a2a_time", "combine", "backward"),
        "experts_ms": slowest_rank_ms(df, "time", "experts", "forward"),
        "layer_fwd_ms": slowest_rank_ms(df, "time", "layer", "forward"),
        "layer_fwd_bwd_ms": slowest_rank_ms(df, "time", "layer", "forward+backward"),
    }
    for name, series in cols.items():
        runs[name] = series
    return runs.reset_index()


def with_ratios(table: pd.DataFrame, baseline: str = "naive",
                columns=("dispatch_remote_MB", "layer_fwd_ms", "layer_fwd_bwd_ms")) -> pd.DataFrame:
    """Adds ``<col>_vs_<baseline>``: each run's value over the baseline system's
    value in the run with the same keys (NaN when the baseline did not run)."""
    out = table.copy()
    base = table[table.system == baseline].set_index(RUN_KEYS)
    for col in columns:
        if col not in table:
            continue
        ref = out.set_index(RUN_KEYS).index.map(lambda k: base[col].get(k, float("nan")))
        out[f"{col}_vs_{baseline}"] = out[col].to_numpy() / pd.Series(ref, index=out.index).to_numpy()
    return out
