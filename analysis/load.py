"""Loading results: any mix of single run folders and multirun folders -> one DataFrame."""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Union

import pandas as pd

from occult.records import LATER_COLUMNS, RESULTS_FILE


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
        df["run_dir"] = str(f.parent)
        frames.append(df)
    return pd.concat(frames, ignore_index=True)
