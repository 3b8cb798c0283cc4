"""The calibration fit: this machine's loopback all-to-all and expert matmul throughput,
as a projection profile.

    python run.py experiment=calibrate        # P = 2, 4, 8; writes runs/calibrate/sim_cpu_loopback.yaml
    python -m analysis.calibration runs/calibrate --out /tmp/cpu.yaml   # refit from those runs

For each world size P, P ranks (gloo on loopback, as every CPU run) run the
measurement of :mod:`occult.tasks.calibrate` (``task=calibrate``): equal-split all-to-alls at a few
message sizes, each after a burst of compute and a barrier, and the grouped
SwiGLU experts of task=layer's default width on the e = 64 / P local experts
at two row counts. Here a line ``time = latency + bytes / bandwidth`` is
fitted per P (per call the slowest rank, then the median over repetitions;
``bytes``: what one rank sends to the others in one call, the quantity
:mod:`analysis.pricing` uses), on relative residuals, with latency and
bandwidth kept positive; and ``time = e x per-expert overhead + FLOPs /
throughput`` gives the matmul throughput and the per-expert call overhead
(Python and small-GEMM cost, which a CPU pays per expert).

The P ranks share the host's cores, so bandwidth and throughput depend on P
(and on the machine's load): the profile keeps one fitted point per world
size (``calibration``). The same measurement runs inside a task=layer run
(``task.calibrate=true``), right before its timed iterations, so that an
experiment calibrates under the load its own runs see; :func:`fit_points`
turns either's rows into profile points. Nothing here starts ranks: it reads
result tables. A measured profile is written where its runs are (the report folder),
never over the tracked ``conf/profile/sim_cpu_loopback.yaml``: pass it by path
(``--profile runs/calibrate/sim_cpu_loopback.yaml``, ``system.profile=<path>``), or copy it
there to make it this checkout's default.
"""
from __future__ import annotations

import argparse
import os
import platform
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pandas as pd

from occult.records import device_name

PROFILE_FILE = "sim_cpu_loopback.yaml"      # the measured profile's file name in a run folder


def fit_line(x, y) -> tuple[float, float]:
    """``y = a + b x`` with a, b >= 0, least squares on relative residuals (each point
    weighted 1 / y, so that small and large messages count alike); returns (a, b)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    w = 1.0 / np.maximum(y, 1e-12)
    A = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(A, y * w, rcond=None)
    if a < 0:                                   # through the origin
        b = float(np.sum(x * y * w * w) / np.sum(x * x * w * w))
        a = 0.0
    if b <= 0:                                  # latency only
        a, b = float(np.median(y)), 0.0
    return float(a), float(b)


def fit_points(df: pd.DataFrame) -> list[dict]:
    """Profile points from calibration rows: one per world size (several runs of one P:
    the latest, by its rows' ``time``). Keys: world_size, latency_us, GBps, TFLOPs, points [(bytes, ms)]."""
    out = []
    cal = df[df.metric.str.startswith("calib_")]
    if cal.empty:
        return out
    for P, by_p in cal.groupby("world_size"):
        run = by_p[by_p.run_id == by_p.groupby("run_id").time.max().idxmax()]      # the latest run of P
        sizes = run[run.metric == "calib_bytes"].set_index("layer").value
        t = run[run.metric == "calib_a2a_time"]
        slowest = t.groupby(["layer", "sample"]).value.max().groupby("layer").median()
        x = sizes.reindex(slowest.index).to_numpy(float)
        lat_ms, ms_per_byte = fit_line(x, slowest.to_numpy(float))
        TFLOPs, call_us = _fit_experts(run)
        out.append({"world_size": int(P), "latency_us": lat_ms * 1e3,
                    "GBps": 1e-6 / ms_per_byte if ms_per_byte > 0 else float("inf"),
                    "TFLOPs": TFLOPs, "expert_call_us": call_us,
                    "points": [(int(b), float(m)) for b, m in zip(x, slowest.to_numpy(float))]})
    return out


def _fit_experts(run: pd.DataFrame) -> tuple[float, float]:
    """(TFLOP/s, per-expert overhead in us) from the grouped-expert timings of one run:
    ``time = e c + FLOPs / rate`` through its two row counts (slowest rank of each)."""
    n = run[run.metric == "calib_expert_rows"].set_index("layer").value
    e = float(run[run.metric == "calib_local_experts"].value.iloc[0])
    t_ms = run[run.metric == "calib_expert_time"].groupby("layer").value.max().reindex(n.index)
    D = float(run[run.metric == "calib_expert_hidden"].value.iloc[0])
    F = float(run[run.metric == "calib_expert_ffn"].value.iloc[0])
    flops = 6.0 * n.to_numpy(float) * D * F
    (t1, t2), (f1, f2) = t_ms.to_numpy(float) / 1e3, flops
    rate = (f2 - f1) / (t2 - t1) if t2 > t1 else f2 / t2
    call_s = max((t1 - f1 / rate) / e, 0.0)
    return rate / 1e12, call_s * 1e6


def profile_dict(points: list[dict], source: str) -> dict:
    """A ``sim_cpu_loopback`` profile (the fields :func:`occult.ep.profiles.profile_from_dict` reads)."""
    return {"name": "sim_cpu_loopback", "world_size": 0, "backend": "gloo",
            "dtype": "float32", "source": source,
            "calibration": [{"world_size": int(p["world_size"]),
                             **{k: float(p[k]) for k in ("latency_us", "GBps", "TFLOPs", "expert_call_us")}}
                            for p in points]}


def profile_yaml(points: list[dict]) -> str:
    """The calibration profile as YAML text (a ``conf/profile`` file the cost model reads)."""
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    lines = ["# This machine's loopback (gloo, P processes on one host), MEASURED by",
             "#   python run.py experiment=calibrate",
             f"# on {device_name()} ({platform.node()}, {os.cpu_count()} cores), {stamp}.",
             "# A projection profile (pass it by path, or copy it into conf/profile), not a cluster",
             "# to run on. Per world size P:",
             "# all-to-all latency and bandwidth fitted to bytes a rank sends to the others in one",
             "# call (each after compute, as in a layer), and the per-rank expert matmul throughput",
             "# and per-expert overhead with P ranks at once. Measured on a shared machine: rerun",
             "# the calibration before trusting it elsewhere.",
             "name: sim_cpu_loopback", "world_size: 0", "backend: gloo",
             "dtype: float32", f"source: measured by analysis.calibration on {platform.node()}, {stamp}",
             "calibration:"]
    for p in points:
        lines.append(f"  - {{world_size: {p['world_size']}, latency_us: {p['latency_us']:.1f}, "
                     f"GBps: {p['GBps']:.4f}, TFLOPs: {p['TFLOPs']:.5f}, "
                     f"expert_call_us: {p['expert_call_us']:.1f}}}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="run or sweep folders with calibration rows (task=calibrate)")
    ap.add_argument("--out", default=None, help=f"profile to write (default: <first path>/{PROFILE_FILE})")
    args = ap.parse_args()
    from analysis.load import load_runs

    points = fit_points(load_runs(args.paths))
    if not points:
        raise SystemExit(f"no calibration rows under {args.paths} (runs of task=calibrate)")
    for pt in points:
        print(f"P={pt['world_size']}: latency {pt['latency_us']:.0f} us, {pt['GBps']:.3f} GB/s, "
              f"{pt['TFLOPs'] * 1e3:.1f} GFLOP/s + {pt['expert_call_us']:.0f} us per expert per rank; " +
              ", ".join(f"{b / 1e6:.2f} MB {m:.2f} ms" for b, m in pt["points"]), flush=True)
    out = Path(args.out or Path(args.paths[0]) / PROFILE_FILE)
    out.write_text(profile_yaml(points))
    print(out)


if __name__ == "__main__":
    main()
