"""The tidy results table: one row per measurement, long format, with units and provenance.

Columns (see DESIGN.md): the run's context (run_id, experiment, system, impl,
model, task, cluster, world_size, num_experts, top_k, hidden_size,
expert_ffn_size, tokens_per_rank, routing, batch_size, seq_len, seed), the
measurement (layer, rank, phase, pass, metric, value, unit, sample, src_rank,
dst_rank) and provenance (git_commit, torch_version, device, hostname, time).

``rank = -1`` marks a value over all ranks; ``sample = -1`` one that is not a
timed sample; ``src_rank`` / ``dst_rank = -1`` one that is not per peer pair.
"""
from __future__ import annotations

import os
import platform
import socket
import subprocess
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
import torch

MEASUREMENT_COLUMNS = ["layer", "rank", "phase", "pass", "metric", "value", "unit", "sample",
                       "src_rank", "dst_rank"]
CONTEXT_COLUMNS = ["run_id", "experiment", "system", "impl", "model", "task", "cluster", "world_size",
                   "num_experts", "top_k", "hidden_size", "expert_ffn_size", "tokens_per_rank",
                   "routing", "batch_size", "seq_len", "seed"]
PROVENANCE_COLUMNS = ["git_commit", "torch_version", "device", "hostname", "time"]
COLUMNS = CONTEXT_COLUMNS + MEASUREMENT_COLUMNS + PROVENANCE_COLUMNS
RESULTS_FILE = "results.parquet"


def row(metric: str, value: float, unit: str, *, layer: int = -1, rank: int = -1, phase: str = "",
        direction: str = "", sample: int = -1, src_rank: int = -1, dst_rank: int = -1) -> dict:
    """One measurement (``direction`` fills the ``pass`` column: forward / backward)."""
    return {"layer": layer, "rank": rank, "phase": phase, "pass": direction, "metric": metric,
            "value": float(value), "unit": unit, "sample": sample, "src_rank": src_rank,
            "dst_rank": dst_rank}


def git_commit() -> str:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"cpu: {line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return f"cpu: {platform.processor() or platform.machine()} x{os.cpu_count()}"


def provenance() -> dict:
    return {"git_commit": git_commit(), "torch_version": torch.__version__, "device": device_name(),
            "hostname": socket.gethostname(),
            "time": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def make_frame(rows: list, context: dict) -> pd.DataFrame:
    """Rows plus the run's context and provenance, in the schema's column order."""
    df = pd.DataFrame(rows, columns=MEASUREMENT_COLUMNS)
    for key, value in {**context, **provenance()}.items():
        df[key] = value
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise ValueError(f"results: context lacks columns {missing}")
    return df[COLUMNS + [c for c in df.columns if c not in COLUMNS]]


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_results(df: pd.DataFrame, out_dir) -> Path:
    """Writes ``results.csv`` then ``results.parquet`` atomically; the parquet file
    is written last and marks a complete run."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _atomic_write(out / "results.csv", lambda p: df.to_csv(p, index=False))
    _atomic_write(out / RESULTS_FILE, lambda p: df.to_parquet(p, index=False))
    return out / RESULTS_FILE


def has_results(out_dir) -> bool:
    return (Path(out_dir) / RESULTS_FILE).is_file()
