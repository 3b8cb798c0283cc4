"""Loading results: any mix of single run folders and multirun folders -> one DataFrame.

Tables written by older versions load as today's: a column added later holds the value their
runs had (:data:`occult.records.LATER_COLUMNS`), and the settings a table wrote elsewhere
read as their columns (:func:`settings_as_columns`).

The label columns of :data:`CATEGORICAL` load as pandas categoricals (categories sorted, so
that they sort as their strings do): a sweep of 1,100 simulated points writes 4.3 M rows,
whose repeated strings (run id, system options, metric, host, ...) took 3.4 GB as strings and
take about a third of that as codes, and every filter's copy shrinks alike. ``system``, ``label``
and ``model`` stay strings (report builders compute new strings from them), and so does
``run_id`` (see :data:`CATEGORICAL`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Union

import pandas as pd

from occult.config import setting_columns
from occult.records import LATER_COLUMNS, RESULTS_FILE

# settings that tables written before they were columns (up to 57d74c1) held as metric rows of
# rank 0: {column: (metric, decode the row's value)}; the gradient sync's schedule was its index
# in the order of occult.models.grad_sync.GRAD_SYNCS then, kept here as it was
OLD_GRAD_SYNCS = ("end", "overlap", "lina")
SETTING_ROWS = {"microbatches": ("microbatches", int),
                "grad_sync": ("grad_sync_mode", lambda index: OLD_GRAD_SYNCS[int(index)])}
# settings tables written before they were columns held in the system_options JSON (which holds
# every option of the run's system; a system without the option: absent)
SETTING_OPTIONS = ("a2a_ffn_overlap_degree", "budget", "dedup", "dispatch_mode", "topk_group")
# string columns loaded as categoricals: labels the readers compare, group by and print, never
# edit or join into new strings (see the module docstring); not run_id, every reader's key, whose
# per-run tables pandas 3.1 cannot align when the two categorical indexes' codes differ in width
CATEGORICAL = ("experiment", "impl", "system_options", "init", "task", "cluster", "dtype", "routing",
               "trace_sha256", "config_hash", "dedup", "dispatch_mode", "grad_sync", "placement", "phase", "pass",
               "metric", "unit", "git_commit", "torch_version", "device", "hostname", "time", "clock", "launcher",
               "run_dir")


def find_results(paths: Union[str, Path, Iterable]) -> list[Path]:
    """Every ``results.parquet`` at or below the given folders (or the files themselves)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    found = []
    for p in map(Path, paths):
        if p.is_file():
            found.append(p)
        elif p.is_dir():
            found.extend(sorted(p.rglob(RESULTS_FILE)))
        else:
            raise FileNotFoundError(f"load_runs: {p} does not exist")
    return found


def load_runs(paths) -> pd.DataFrame:
    """One long DataFrame over all runs found, with a ``run_dir`` column."""
    files = find_results(paths)
    if not files:
        raise FileNotFoundError(f"load_runs: no {RESULTS_FILE} under {paths}")
    frames = []
    for f in files:
        df = pd.read_parquet(f)
        for column, default in LATER_COLUMNS.items():     # tables written before the column existed
            if column not in df:
                df[column] = default
        df = settings_as_columns(df)
        df["run_dir"] = str(f.parent)
        frames.append(as_categories(df))
    return pd.concat(same_categories(frames), ignore_index=True)


def as_categories(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with its string columns of :data:`CATEGORICAL` as categoricals."""
    for c in CATEGORICAL:
        if c in df and not isinstance(df[c].dtype, pd.CategoricalDtype) and pd.api.types.is_string_dtype(df[c]):
            df[c] = df[c].astype("category")
    return df


def same_categories(frames: list) -> list:
    """``frames`` with each categorical column on one sorted set of categories, the union of
    theirs (pandas concatenates categoricals that differ in their categories as strings)."""
    union: dict = {}
    for f in frames:
        for c in f.columns:
            if isinstance(f[c].dtype, pd.CategoricalDtype):
                union.setdefault(c, set()).update(f[c].cat.categories)
    ordered = {c: sorted(values) for c, values in union.items()}
    for f in frames:
        for c, categories in ordered.items():
            if c in f and isinstance(f[c].dtype, pd.CategoricalDtype):
                f[c] = f[c].cat.set_categories(categories)
    return frames


def settings_as_columns(df: pd.DataFrame) -> pd.DataFrame:
    """One results table with every setting column (:func:`occult.config.setting_columns`):
    a table written before a setting was a column gets it from the metric rows it wrote of it
    (:data:`SETTING_ROWS`, per run; the rows are dropped, as no setting is a measurement), from
    its ``system_options`` (:data:`SETTING_OPTIONS`, per row), else the ``absent`` value of a
    run without the field. A table that has the columns is returned as it is."""
    missing = {name: absent for name, (_, absent) in setting_columns().items() if name not in df}
    if not missing:
        return df
    df = df.copy()
    old_rows = pd.Series(False, index=df.index)
    for name, absent in missing.items():
        if name in SETTING_ROWS:
            metric, decode = SETTING_ROWS[name]
            rows = df.metric == metric
            per_run = {run_id: decode(v) for run_id, v in df[rows].groupby("run_id").value.max().items()}
            df[name] = df.run_id.map({**dict.fromkeys(df.run_id.unique(), absent), **per_run})
            old_rows |= rows
        elif name in SETTING_OPTIONS:
            df[name] = df.system_options.map({o: json.loads(o or "{}").get(name, absent)
                                              for o in df.system_options.unique()})
        else:
            df[name] = absent
    return df[~old_rows].reset_index(drop=True)
