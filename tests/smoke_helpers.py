"""The smoke run of every experiment in ``conf/experiment/`` (tests/test_experiments.py).

Each experiment's points are what its sweeper makes of its grids (``hydra.sweeper.params``,
:class:`hydra_plugins.occult_sweepers.grids_sweeper.GridsSweeper`); the smoke run takes the
first point of its first grid (every grid: ``--every-grid``) and launches it through
``run.py`` itself, as a one-point multirun of the experiment (``hydra.sweeper.params=null``
and the point's overrides on the command line): Hydra's composition, validation, the runner
and its ranks, with :data:`SHRINK` added. Every experiment runs in one process (``run.py``
is run again for each point, as ``python run.py`` would run it: its imports and the ranks'
fork server are paid once), in a folder of its own as the working directory, so that the
paths an experiment names under ``runs/`` (a placement artifact a later grid reads) stay in it.

    python tests/smoke_helpers.py OUT_DIR [--every-grid] [--report] [EXPERIMENT ...]

writes ``OUT_DIR/smoke.json``: per experiment, its points, their exit status, their run
folders and errors, and the seconds they took.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"

# The one shrink list of every smoke run: (key, value), filtered per point by :func:`shrunk`:
# a ``task.*`` key applies only to a task whose schema has the field; a number only where it is
# below the point's own (or the point's is null, no bound): a shrink never grows a run
# (``cluster.devices_per_node`` 1 leaves a one-node world, 0, as it is); and only what
# validation takes (a task's bounds and unread fields, a model's dense layers).
SHRINK = (
    ("model.init", "random"),           # a proxy's trained checkpoint would be pre-trained first
    ("model.hidden_size", 32),
    ("model.expert_ffn_size", 16),
    ("model.shared_expert_ffn_size", 16),
    ("model.dense_ffn_size", 32),
    ("model.num_layers", 2),
    ("cluster.devices_per_node", 1),
    ("cluster.world_size", 2),
    ("task.warmup", 0),
    ("task.iters", 1),
    ("task.tokens_per_rank", 32),
    ("task.total_tokens", 128),
    ("task.parity_tokens", 8),
    ("task.batch_size", 2),
    ("task.seq_len", 16),
    ("task.new_tokens", 2),
    ("task.steps", 1),
    ("task.source_tokens", 512),
    ("task.synthetic_tokens", 512),
    ("task.timing_iters", 1),
    ("task.time_limit_s", 0.2),
    ("task.swap_time_limit_s", 0.2),
    ("task.held_out_tokens", 64),
    ("pretrain.steps", 2),
    ("pretrain.batch_size", 2),
    ("pretrain.seq_len", 16),
    ("pretrain.eval_batches", 1),
)


def experiments() -> list[str]:
    """Every experiment: the YAML files of ``conf/experiment/``."""
    return sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def _compose(overrides: list, hydra: bool = False):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


def grid_points(experiment: str, every_grid: bool = False) -> list[list[str]]:
    """The first point of the experiment's first grid (of every grid: ``every_grid``), each
    as the override strings its sweeper launches."""
    from hydra.utils import instantiate

    class Context:
        config_loader = None

    cfg = _compose([f"experiment={experiment}"], hydra=True)
    sweeper = instantiate(cfg.hydra.sweeper)
    points = []
    for params in sweeper._grids().values():
        one = type(sweeper)(max_batch_size=None, params=dict(params))
        one.hydra_context, one.config = Context(), None
        (grid,) = one.split_arguments([], None)
        points.append(grid[0])
        if not every_grid:
            break
    return points


def _refusal(cfg):
    """What validation (:func:`occult.validate.validate`, as ``run.py`` runs it) says against
    ``cfg``: its one-line error, or None."""
    from occult.errors import ConfigError
    from occult.validate import validate

    try:
        validate(cfg)
    except ConfigError as exc:
        return str(exc)
    return None


def shrunk(experiment: str, point: list) -> list[str]:
    """The overrides of :data:`SHRINK` that apply to this point (its composed config), in
    order: a ``task.*`` one only where the task's schema has the field; a number only below
    the point's own value; and only one that validation takes with those before it (a task's
    bounds, the fields its values leave unread, a model's dense layers that need more layers
    than the shrunk count): validation refuses nothing the point itself did not."""
    from omegaconf import OmegaConf

    from occult.tasks.schema import task_schema

    cfg = _compose([f"experiment={experiment}", *(o for o in point if not o.startswith("hydra."))])
    fields = {f.name for f in dataclasses.fields(task_schema(cfg.task.schema))}
    candidates = []
    for key, value in SHRINK:
        group, _, name = key.partition(".")
        now = OmegaConf.select(cfg, key)
        if (group == "task" and name not in fields) or (isinstance(value, (int, float)) and now is not None and
                                                          not (isinstance(now, (int, float)) and value < now)):
            continue
        candidates.append((key, value))
    refused = _refusal(cfg)
    whole = cfg.copy()
    for key, value in candidates:
        OmegaConf.update(whole, key, value)
    if _refusal(whole) in (None, refused):          # the usual case: validation takes them all at once
        return [f"{key}={value}" for key, value in candidates]
    out = []
    for key, value in candidates:                   # else one by one, each with those taken before it
        trial = cfg.copy()
        OmegaConf.update(trial, key, value)
        if _refusal(trial) in (None, refused):
            cfg = trial
            out.append(f"{key}={value}")
    return out


def run_point(experiment: str, point: list, shrink: list, report: bool) -> int:
    """``python run.py experiment=<experiment> <point> <shrink>`` as a one-point multirun in the
    working directory; its exit status."""
    from occult import runner

    # the sweep folder runs/<experiment> whatever the experiment's own (a stamped one): the paths
    # a later grid reads (runs/${experiment_name}/...) are there, and the report reads them all
    overrides = [*point, *shrink, "hydra.sweeper.params=null", "hydra.sweep.dir=runs/${experiment_name}"]
    if not report:
        overrides.append("~hydra.callbacks.sweep_report")
    sys.argv = [str(ROOT / "run.py"), f"experiment={experiment}", *overrides]
    runner.FAILED_POINTS.clear()           # this process's earlier run.py's points are not this one's
    runner.PROGRESS = runner.Progress()
    try:
        runpy.run_path(str(ROOT / "run.py"), run_name="__main__")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    return 0


def smoke(out_dir: Path, names: list, every_grid: bool, report: bool) -> dict:
    """Runs each experiment's points in ``out_dir/<experiment>``; what happened, per experiment."""
    from occult.config import register
    from occult.dist import WHOLE_MODEL_PRELOAD, _rank_processes

    register()
    # the ranks' fork server, started as the first launch of whole-model ranks starts it (else
    # the first experiment, a layer one, would start it without their imports)
    _rank_processes(True, WHOLE_MODEL_PRELOAD)
    done = {}
    for name in names:
        where = out_dir / name
        where.mkdir(parents=True, exist_ok=True)
        os.chdir(where)
        t0 = time.perf_counter()
        points = grid_points(name, every_grid)
        runs = []
        for i, point in enumerate(points):
            shrink = shrunk(name, point)
            status = run_point(name, point, shrink, report=report and i == len(points) - 1)
            runs.append({"point": point, "shrink": shrink, "status": status})
        done[name] = {"points": runs, "seconds": time.perf_counter() - t0,
                      "results": sorted(str(p.parent) for p in where.rglob("results.parquet")),
                      "errors": {str(p.parent): p.read_text()[-3000:] for p in where.rglob("error.txt")},
                      "reports": sorted(str(p) for p in where.rglob("report.md")),
                      "metrics": metric_names(where)}
    return done


def metric_names(where: Path) -> list:
    """Every metric name in the results tables under ``where``."""
    import pandas as pd

    names = set()
    for p in where.rglob("results.parquet"):
        names.update(pd.read_parquet(p, columns=["metric"]).metric.unique())
    return sorted(names)


def schema_fields() -> set:
    """The field names of every schema a run is composed of (the cluster's, the model's, every
    system's and task's: :func:`occult.config.schemas`): no metric may have one of them, as a
    setting is a column of every row (:mod:`occult.columns`), never a metric row."""
    from occult.config import schemas

    return {f.name for classes in schemas().values() for cls in classes for f in dataclasses.fields(cls)}


def cpu_seconds() -> float:
    """CPU seconds of this process, its children and the ranks' fork server with the ranks it
    forked (which reaps them: their time is in its children's time)."""
    from multiprocessing import forkserver

    own = os.times()
    total = own.user + own.system + own.children_user + own.children_system
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    if pid:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("names", nargs="*", help="experiments (default: every one)")
    parser.add_argument("--every-grid", action="store_true", help="the first point of every grid")
    parser.add_argument("--report", action="store_true", help="and the experiment's report")
    args = parser.parse_intermixed_args()
    sys.path.insert(0, str(ROOT))
    out = args.out_dir.resolve()
    t0 = time.perf_counter()
    done = smoke(out, args.names or experiments(), args.every_grid, args.report)
    out.joinpath("smoke.json").write_text(json.dumps({"experiments": done, "wall_s": time.perf_counter() - t0,
                                                      "cpu_s": cpu_seconds()}, indent=1))


if __name__ == "__main__":
    main()
