"""The tidy results table: one row per measurement, long format, with units and provenance.

Columns: the run's context (run_id, experiment, label, system, impl,
system_options, model, init, task, cluster, world_size, devices_per_node, num_experts, top_k,
hidden_size, expert_ffn_size, dtype, tokens_per_rank, routing, trace_sha256 (of a replayed
routing trace, "" for none), batch_size, seq_len, seed, config_hash), the run's settings (the
schema fields declared as columns, :mod:`occult.columns`, each with the value a run without
the field writes: ``system.dispatch_mode``, ``task.grad_sync``, ``task.microbatches``,
``task.migration`` (Luffy's sequence migration), ``task.placement`` (contiguous, eplb or an
artifact)), the measurement (layer, rank, phase, pass, metric, value, unit, sample, src_rank,
dst_rank, expert) and provenance (git_commit, torch_version, device, hostname, time, clock,
launcher). A setting is a column, never a metric row.

``run_id`` is unique per composed config: readable fields and ``config_hash``, a
digest of the composed config (:func:`config_hash`); ``system_options`` is the
system's typed options as canonical JSON; ``init`` says where the weights came from
(a checkpoint folder, or ``random``); ``label`` is what an experiment calls the point
("" when it does not say).

``rank = -1`` marks a value over all ranks; ``sample = -1`` one that is not a
timed sample; ``src_rank`` / ``dst_rank = -1`` one that is not per peer pair.
"""
from __future__ import annotations

import hashlib
import json
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
                       "src_rank", "dst_rank", "expert"]
# the run's context; the run's settings follow it (the context's other keys: make_frame)
CONTEXT_COLUMNS = ["run_id", "experiment", "label", "system", "impl", "system_options", "model", "init", "task",
                   "cluster", "world_size", "devices_per_node", "num_experts", "top_k", "hidden_size", "expert_ffn_size",
                   "dtype", "tokens_per_rank", "routing", "trace_sha256", "batch_size", "seq_len", "seed", "config_hash"]
PROVENANCE_COLUMNS = ["git_commit", "torch_version", "device", "hostname", "time", "clock", "launcher"]
COLUMNS = CONTEXT_COLUMNS + MEASUREMENT_COLUMNS + PROVENANCE_COLUMNS
RESULTS_FILE = "results.parquet"
RUN_CONFIG_FILE = "run_config.json"      # the composed config the results belong to (resume checks it)
# keys of the composed config that do not change a run's results (left out of its hash)
NOT_HASHED = ("resume", "out_dir", "report", "report_options", "cluster.run_timeout_s", "cluster.collective_timeout_s")
# keys recorded with the config (run_config.json) but neither hashed nor compared on resume: the
# systems a capability query selected name a sweep's points, never what one point computes (a
# system added later must not make every finished point refuse to resume)
RECORDED_ONLY = ("selected_systems",)
# tables written before a column existed: the value their runs had (``dtype``: the harness's
# default element type; runs in bfloat16 then were the GPU check's); the settings' columns
# read as what such a table held of them elsewhere (:func:`analysis.load.settings_as_columns`)
LATER_COLUMNS = {"devices_per_node": 0, "dtype": "float32", "trace_sha256": "", "expert": -1}


def _compared(hashed: dict) -> dict:
    """``hashed`` without the :data:`RECORDED_ONLY` keys: what a digest and a resume compare."""
    return {k: v for k, v in hashed.items() if not any(k == n or k.startswith(n + ".") for n in RECORDED_ONLY)}


def row(metric: str, value: float, unit: str, *, layer: int = -1, rank: int = -1, phase: str = "",
        direction: str = "", sample: int = -1, src_rank: int = -1, dst_rank: int = -1, expert: int = -1) -> dict:
    """One measurement (``direction`` fills the ``pass`` column: forward / backward; ``expert``:
    the logical expert of a per-expert value, -1 for others)."""
    return {"layer": layer, "rank": rank, "phase": phase, "pass": direction, "metric": metric,
            "value": float(value), "unit": unit, "sample": sample, "src_rank": src_rank,
            "dst_rank": dst_rank, "expert": expert}


def git_commit() -> str:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=here, capture_output=True,
                             text=True, timeout=5)
        # docs/results holds what runs publish, not code a run depends on (make results publishes
        # one experiment before it runs the next)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                                ":(exclude,top)docs/results"], cwd=here,
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
    from .ep.measure import CLOCK
    return {"git_commit": git_commit(), "torch_version": torch.__version__, "device": device_name(),
            "hostname": socket.gethostname(),
            "time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "clock": CLOCK, "launcher": "local"}


def flatten(d: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists stay values)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def hashed_config(cfg_container: dict) -> dict:
    """The composed config (resolved, plain containers) flattened, without the keys that do
    not change results (:data:`NOT_HASHED`); a run hashes it :func:`without_later` keys
    (:func:`occult.runner.run_hashed_config`)."""
    flat = flatten({k: v for k, v in cfg_container.items() if k != "hydra"})
    return {k: v for k, v in flat.items() if not any(k == n or k.startswith(n + ".") for n in NOT_HASHED)}


def without_later(hashed: dict, later: dict) -> dict:
    """``hashed`` without the keys at their ``later`` value (``later``: ``{key: the value
    configs held before the key existed}``, :func:`occult.config.later_keys`): a config
    written before a key existed and one at its later value hash alike."""
    return {k: v for k, v in hashed.items() if not (k in later and v == later[k])}


def config_hash(hashed: dict) -> str:
    """A short digest of :func:`hashed_config` (canonical JSON, sorted keys)."""
    text = json.dumps(_compared(hashed), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def config_diff(stored: dict, current: dict, later: dict) -> list:
    """Keys whose values differ between two hashed configs, as ``key: a -> b`` (a key at its
    ``later`` value counts as absent: a config stored before the key existed held it;
    :func:`without_later`)."""
    stored, current = without_later(_compared(stored), later), without_later(_compared(current), later)
    keys = sorted(set(stored) | set(current))
    missing = "<absent>"
    return [f"{k}: {stored.get(k, missing)!r} -> {current.get(k, missing)!r}" for k in keys
            if stored.get(k, missing) != current.get(k, missing)]


def write_run_config(out_dir, hashed: dict) -> Path:
    """Writes the hashed config next to the results (atomically)."""
    path = Path(out_dir) / RUN_CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps({"config_hash": config_hash(hashed), "config": hashed}, sort_keys=True, indent=1,
                      default=str)
    _atomic_write(path, lambda p: Path(p).write_text(text))
    return path


def read_run_config(out_dir) -> "dict | None":
    """``{"config_hash", "config"}`` stored with a run's results (None when absent)."""
    path = Path(out_dir) / RUN_CONFIG_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def make_frame(rows: list, context: dict) -> pd.DataFrame:
    """Rows plus the run's context and provenance, in the schema's column order: the
    context's keys beyond :data:`CONTEXT_COLUMNS`, the run's settings
    (:func:`occult.runner.run_context`), follow those, by name. A row may carry its own value
    of a context column or setting (e.g. one of several systems a run compares); the run's
    value fills the rest. Columns added to the schema later (:data:`LATER_COLUMNS`) default
    to the value older runs had."""
    settings = sorted(k for k in context if k not in COLUMNS)
    order = CONTEXT_COLUMNS + settings + MEASUREMENT_COLUMNS + PROVENANCE_COLUMNS
    own = [c for c in CONTEXT_COLUMNS + settings if any(c in r for r in rows)]
    df = pd.DataFrame(rows, columns=MEASUREMENT_COLUMNS + own)
    for key, value in {**provenance(), **LATER_COLUMNS, **context}.items():
        own_value = key in own or key in MEASUREMENT_COLUMNS     # the rows' own values, defaults filling gaps
        df[key] = df[key].where(df[key].notna(), value) if own_value else value
    missing = [c for c in order if c not in df.columns]
    if missing:
        raise ValueError(f"results: context lacks columns {missing}")
    return df[order + [c for c in df.columns if c not in order]]


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
    is written last and marks a complete run. Both from one Arrow table (Arrow's CSV writer:
    a quarter of pandas' time on a simulated world's tens of thousands of rows; strings
    quoted, booleans ``true`` / ``false``)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pandas(df, preserve_index=False)
    _atomic_write(out / "results.csv", lambda p: pacsv.write_csv(table, p))
    _atomic_write(out / RESULTS_FILE, lambda p: pq.write_table(table, p))
    return out / RESULTS_FILE


def has_results(out_dir) -> bool:
    return (Path(out_dir) / RESULTS_FILE).is_file()


# a sweep folder's record of what it cost: set-up before the points (pre-training), the points,
# the report (occult.runner.before_sweep writes the first, analysis.callbacks.SweepReport the others)
SWEEP_COST_FILE = "sweep_cost.json"


def record_sweep_cost(sweep_dir, **parts) -> Path:
    """Adds ``parts`` to ``<sweep_dir>/sweep_cost.json`` (:data:`SWEEP_COST_FILE`), atomically."""
    import json
    path = Path(sweep_dir) / SWEEP_COST_FILE
    old = json.loads(path.read_text()) if path.is_file() else {}
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path, lambda p: Path(p).write_text(json.dumps({**old, **parts}, indent=1) + "\n"))
    return path
