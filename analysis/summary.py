"""Summaries of the long results table: one row per run, ratios between systems.

Every run's row carries the load axis (:mod:`analysis.balance`): the dispatch's received
rows max / mean over ranks and the slowest rank of its headline phase.

Times: a step lasts as long as its slowest rank, so each timed sample is
first reduced to the maximum over ranks, then summarised by the median over
samples. Ratios compare systems measured in the same sweep with everything
else equal.

A run is its ``run_id`` (unique per composed config; a world that compares several
systems gives each its own): every summary here is one row, or one value, per
``run_id``. ``run_dir``, the folder its results came from, is provenance only (several
runs may share one).
"""
from __future__ import annotations

import json

import pandas as pd

RUN_KEYS = ["experiment", "model", "task", "cluster", "world_size", "devices_per_node", "num_experts", "top_k",
            "hidden_size", "expert_ffn_size", "tokens_per_rank", "routing", "placement", "migration", "batch_size",
            "seq_len", "seed"]
SYSTEM_KEYS = ["system", "impl"]
# what tells two configs of one system apart, and where a run's files are (not keys)
RUN_DESCRIPTION = ["label", "system_options", "clock", "run_dir"]


def options_that_differ(options: pd.Series, by: pd.Series | None = None, columns=()) -> pd.Series:
    """Per row of a table, its ``system_options`` (JSON) reduced to the options in which the
    table's rows differ, as ``key=value, ...`` ("" for a row with none of them): what tells its
    rows apart, where the full JSON repeats every default of every system. ``by`` (e.g. the
    ``system`` column): compare only rows of the same value (one system's options against its
    own other configs, not against another system's); ``columns``: options the table shows as
    columns of their own (left out)."""
    parsed = pd.Series([json.loads(o) if isinstance(o, str) and o else {} for o in options], index=options.index)
    groups = [parsed] if by is None else [parsed[by == v] for v in pd.unique(by)]
    out = pd.Series("", index=options.index, dtype=object)
    for group in groups:
        keys = sorted({k for d in group for k in d})
        differ = [k for k in keys if k not in columns and len({json.dumps(d.get(k), sort_keys=True) for d in group}) > 1]
        for i, d in group.items():
            out[i] = ", ".join(f"{k}={json.dumps(d[k]) if not isinstance(d[k], str) else d[k]}"
                               for k in differ if k in d)
    return out


# a task's keys that name it rather than set it (the ``task`` column shows which task ran)
NOT_TASK_SETTINGS = ("task.name", "task.schema")


def settings_that_differ(table: pd.DataFrame) -> pd.Series:
    """Per row, the ``task.*`` keys of its run's stored config (``run_config.json`` in its
    ``run_dir``) in which the rows of the same task differ and that no column of the table
    shows, as ``key=value, ...`` (e.g. ``task.steps=0`` against ``task.steps=100``); a key
    only some rows of a task have is not compared (another schema's field), and "" for a row
    whose folder holds no stored config."""
    from occult.records import flatten, read_run_config

    out = pd.Series("", index=table.index, dtype=object)
    if "run_dir" not in table:
        return out
    stored = {d: (read_run_config(d) or {}).get("config", {}) for d in pd.unique(table.run_dir.dropna())}
    configs = pd.Series([flatten(stored.get(d, {})) for d in table.run_dir], index=table.index)
    tasks = table.task if "task" in table else pd.Series("", index=table.index)
    for task in pd.unique(tasks):
        group = configs[tasks == task]
        shared = set.intersection(*(set(c) for c in group))
        keys = sorted(k for k in shared if k.startswith("task.") and k not in NOT_TASK_SETTINGS
                      and k[len("task."):] not in table)
        differ = [k for k in keys if len({json.dumps(c[k], sort_keys=True, default=str) for c in group}) > 1]
        for i, c in group.items():
            out[i] = ", ".join(f"{k}={c[k]}" for k in differ)
    return out


def slowest_rank_ms(df: pd.DataFrame, metric: str, phase: str, direction: str) -> pd.Series:
    """Median over samples of the slowest rank's time, per run (indexed by run_id)."""
    sel = df[(df.metric == metric) & (df.phase == phase) & (df["pass"] == direction) & (df["sample"] >= 0)]
    if sel.empty:
        return pd.Series(dtype=float)
    per_sample = sel.groupby(["run_id", "sample", "rank"]).value.sum().groupby(["run_id", "sample"]).max()
    return per_sample.groupby("run_id").median()


def global_value(df: pd.DataFrame, metric: str, phase: str = "", direction: str = "") -> pd.Series:
    """The all-ranks value (rank = -1) of a metric, averaged over layers, per run."""
    sel = df[(df.metric == metric) & (df["rank"] == -1) & (df.phase == phase) & (df["pass"] == direction)]
    return sel.groupby("run_id").value.mean()


def sent_bytes(df: pd.DataFrame, phase: str, direction: str, remote_only: bool = True) -> pd.Series:
    """Bytes sent by all ranks in one phase and pass (per iteration), per run."""
    sel = df[(df.metric == "bytes") & (df.phase == phase) & (df["pass"] == direction)]
    if remote_only:
        sel = sel[sel.src_rank != sel.dst_rank]
    return sel.groupby("run_id").value.sum()


def run_table(df: pd.DataFrame) -> pd.DataFrame:
    """One row per run: routing metrics, rows, bytes and phase times (ms, slowest rank)."""
    described = [c for c in RUN_DESCRIPTION if c in df]
    runs = df.groupby("run_id", sort=False)[RUN_KEYS + SYSTEM_KEYS + described].first()
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
    from .balance import recv_balance, slowest_rank
    cols.update(recv_balance(df).to_dict("series"))           # the load axis (analysis.balance)
    cols["slowest_rank"] = slowest_rank(df)
    for name, series in cols.items():
        runs[name] = series
    return runs.reset_index()


def with_ratios(table: pd.DataFrame, baseline: str = "naive",
                columns=("dispatch_remote_MB", "layer_fwd_ms", "layer_fwd_bwd_ms")) -> pd.DataFrame:
    """Adds ``<col>_vs_<baseline>``: each run's value over the baseline system's
    value in the run with the same keys (NaN when the baseline did not run)."""
    out = table.copy()
    for col in columns:
        if col in table:
            out[f"{col}_vs_{baseline}"] = ratio_to(table, col, baseline)
    return out


# whole-model tasks: the headline latency of each task (metric, phase), over all ranks
TASK_LATENCY = {"prefill": ("ttft", "prefill"), "decode": ("token_latency", "decode"),
                "train": ("step_time", "train")}
TASK_LATENCY_LABEL = {"prefill": "time to first token", "decode": "per-token latency",
                      "train": "training step"}


def task_latency(df: pd.DataFrame) -> pd.DataFrame:
    """One row per whole-model run: its task's latency (ms, median over samples of the
    all-ranks value, i.e. the slowest rank) and tokens/s (median)."""
    out = []
    described = [c for c in RUN_DESCRIPTION if c in df]
    for run_id, run in df[df.task.isin(list(TASK_LATENCY))].groupby("run_id", sort=False):
        metric, phase = TASK_LATENCY[run.task.iloc[0]]
        lat = run[(run.metric == metric) & (run.phase == phase) & (run["rank"] == -1)].value
        tps = run[(run.metric == "tokens_per_s") & (run.phase == phase) & (run["rank"] == -1)].value
        if lat.empty:
            continue
        out.append({**{k: run[k].iloc[0] for k in RUN_KEYS + SYSTEM_KEYS + described}, "run_id": run_id,
                    "latency_metric": metric, "latency_ms": lat.median(),
                    "tokens_per_s": tps.median() if not tps.empty else float("nan")})
    table = pd.DataFrame(out)
    if not table.empty:                                       # the load axis (analysis.balance)
        from .balance import recv_balance, slowest_rank
        runs = df[df.run_id.isin(table.run_id)]
        bal = recv_balance(runs)
        for col in bal:
            table[col] = table.run_id.map(bal[col])
        table["slowest_rank"] = table.run_id.map(slowest_rank(runs))
    return table


def a2a_total_ms(df: pd.DataFrame, directions=("forward",)) -> pd.Series:
    """All collectives of a timed iteration in the given passes, summed per rank, slowest
    rank per sample, median over samples: ms per run (indexed by run_id)."""
    sel = df[(df.metric == "a2a_time") & df["pass"].isin(list(directions)) & (df["sample"] >= 0)]
    if sel.empty:
        return pd.Series(dtype=float)
    per_sample = sel.groupby(["run_id", "sample", "rank"]).value.sum().groupby(["run_id", "sample"]).max()
    return per_sample.groupby("run_id").median()


def remote_bytes_per_rank(df: pd.DataFrame, phases=("dispatch", "combine"), direction: str = "forward") -> pd.Series:
    """The most remote bytes one rank sends in the given phases of one pass (per iteration), per run."""
    sel = df[(df.metric == "bytes") & df.phase.isin(list(phases)) & (df["pass"] == direction)
             & (df.src_rank != df.dst_rank)]
    return sel.groupby(["run_id", "src_rank"]).value.sum().groupby("run_id").max()


def layer_table(df: pd.DataFrame) -> pd.DataFrame:
    """:func:`run_table` of the task=layer runs with all-to-all totals (forward, and
    forward + backward) and the most remote bytes one rank sends (MB)."""
    layer = df[df.task == "layer"]
    if layer.empty:
        return pd.DataFrame()
    t = run_table(layer).set_index("run_id")
    t["a2a_fwd_ms"] = a2a_total_ms(layer, ("forward",))
    t["a2a_fwd_bwd_ms"] = a2a_total_ms(layer, ("forward", "backward"))
    t["remote_MB_per_rank"] = remote_bytes_per_rank(layer) / 1e6
    return t.reset_index()


def baseline_value(table: pd.DataFrame, column: str, baseline="naive", keys=None) -> pd.Series:
    """Per row of ``table``, the baseline system's ``column`` in the rows with the same
    ``keys`` (default: RUN_KEYS present in the table); NaN where the baseline is missing.
    Several baseline runs with the same keys: their median. ``baseline``: a system name,
    or per row the name of its baseline (a Series aligned with ``table``)."""
    keys = [k for k in (keys or RUN_KEYS) if k in table]
    base = table[table.system == baseline].groupby(keys, dropna=False)[column].median()
    ref = table.set_index(keys).index.map(lambda k: base.get(k, float("nan")))
    return pd.Series(ref.to_numpy(dtype=float), index=table.index)


def ratio_to(table: pd.DataFrame, column: str, baseline: str = "naive", keys=None) -> pd.Series:
    """``column`` over the baseline system's value in the row with the same ``keys``
    (:func:`baseline_value`)."""
    return table[column] / baseline_value(table, column, baseline, keys)
