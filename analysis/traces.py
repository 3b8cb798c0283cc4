"""Runs that left a routing trace (``task.save_routing=true``) in their folder, for the
routing figures (Figs. 3 and 8)."""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from occult.routing_traces import ROUTING_FILE


def traced_runs(df: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(folder, rows) of every run (by ``run_id``) whose folder holds a routing trace."""
    out = []
    for _, run in df.groupby("run_id", sort=False):
        folder = str(run.run_dir.iloc[0])
        if (Path(folder) / ROUTING_FILE).is_file():
            out.append((folder, run))
    return out


def router_kind(run: pd.DataFrame) -> str:
    """How a run's router got its weights, from its ``init`` column: ``trained router`` (a
    checkpoint: a pre-trained proxy or a real model) or ``random-init router``."""
    init = str(run["init"].iloc[0]) if "init" in run and len(run) else ""
    return "random-init router" if init in ("", "random") else "trained router"
