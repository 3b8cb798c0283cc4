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
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

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
# per-run tables pandas 3.1 cannot align when the two categorical indexes' codes differ in width,
# nor time, whose latest value readers take (max: an order a categorical does not have)
CATEGORICAL = ("experiment", "impl", "system_options", "init", "task", "cluster", "dtype", "routing",
               "trace_sha256", "config_hash", "dedup", "dispatch_mode", "grad_sync", "placement", "phase", "pass",
               "metric", "unit", "git_commit", "torch_version", "device", "hostname", "clock", "launcher",
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
    """One long DataFrame over all runs found, with a ``run_dir`` column; the columns of
    :data:`CATEGORICAL` as categoricals (categories sorted). Read as Arrow tables, each
    label column dictionary-encoded per file (the strings are never one big column), joined
    once (:func:`results_table`)."""
    files = find_results(paths)
    if not files:
        raise FileNotFoundError(f"load_runs: no {RESULTS_FILE} under {paths}")
    table = pa.concat_tables([results_table(f) for f in files], promote_options="permissive").unify_dictionaries()
    # the Arrow buffers freed column by column as pandas takes them: not both copies at once
    df = table.to_pandas(integer_object_nulls=True, self_destruct=True, split_blocks=True)
    del table
    for c in df.columns:
        if isinstance(df[c].dtype, pd.CategoricalDtype):
            df[c] = df[c].cat.set_categories(sorted(df[c].cat.categories))
    return df


def results_table(f: Path) -> pa.Table:
    """One results file as an Arrow table of today's columns (a table written before a column
    existed gets it: :data:`occult.records.LATER_COLUMNS`, :func:`settings_as_columns`), with
    ``run_dir`` and the string columns of :data:`CATEGORICAL` dictionary-encoded."""
    t = pq.read_table(f)
    names = set(t.column_names)
    if not (set(LATER_COLUMNS) <= names and set(setting_columns()) <= names):     # an older table
        df = t.to_pandas()
        for column, default in LATER_COLUMNS.items():
            if column not in df:
                df[column] = default
        t = pa.Table.from_pandas(settings_as_columns(df), preserve_index=False)
    t = t.append_column("run_dir", pa.array([str(f.parent)] * t.num_rows, pa.string()))
    for i, name in enumerate(t.column_names):
        if name in CATEGORICAL and pa.types.is_string(t.schema.field(name).type) or \
                name in CATEGORICAL and pa.types.is_large_string(t.schema.field(name).type):
            t = t.set_column(i, name, pc.dictionary_encode(t.column(i)))
    return t


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
