"""The loopback calibration's report (``report: calibration``, ``experiment=calibrate``):
the profile fitted to the sweep's ``task=calibrate`` runs (:mod:`analysis.calibration`),
written into the report folder as ``sim_cpu_loopback.yaml``, and named there so that it
can be passed by path. The tracked ``conf/profile/sim_cpu_loopback.yaml`` is never
overwritten: copy the new file over it to make it this checkout's default.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from ..calibration import PROFILE_FILE, fit_points, profile_yaml
from ..sections import Section


def build(df: pd.DataFrame, out_dir) -> list:
    """Report builder: fits the calibration rows of the runs and writes the profile into
    the report folder."""
    points = fit_points(df)
    title = "Loopback calibration (cost-model profile of this machine)"
    if not points:
        return [Section(title, ["Not fitted: these runs have no calibration rows (task=calibrate)."])]
    path = Path(out_dir) / PROFILE_FILE
    path.write_text(profile_yaml(points))
    table = pd.DataFrame([{k: p[k] for k in ("world_size", "latency_us", "GBps", "TFLOPs", "expert_call_us")}
                          for p in points])
    text = [f"Written: `{path}` (the tracked conf/profile/sim_cpu_loopback.yaml is left as it was). "
            f"Use it by path: `python -m analysis.project RUNS --profile {path}`, or `system.profile={path}` "
            "for the systems that decide by a profile; copy it to conf/profile/sim_cpu_loopback.yaml to make "
            "it this checkout's default. Per world size P: all-to-all latency and bandwidth fitted to the "
            "bytes a rank sends per call, and the expert matmul rate with P ranks at once."]
    return [Section(title, text, [("calibration", table)])]
