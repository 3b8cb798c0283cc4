"""What ``run.py`` does with a composed config: validate -> launch ranks -> gather rows -> write.

Also what a sweep needs before its points (:func:`before_sweep`: the trained proxies its points
load that are not cached yet, announced with their expected time and pre-trained first, their
time recorded apart from the points' in ``sweep_cost.json``) and around each point: progress (points done of all, the point
running, the time left), resume (a point is skipped only when its folder holds results
of the same composed config; a folder with another config's results fails with the keys
that differ), and :class:`SweepSummary`, the Hydra callback that closes a multirun by
listing failed points (their ``error.txt``), so that a rerun of the same command resumes
where it stopped. The sweep's report is another callback named in config
(:class:`analysis.callbacks.SweepReport`); the runner does not import ``analysis``.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from .columns import setting_values
from .config import later_keys, read_conf, setting_columns
from .dist import WHOLE_MODEL_PRELOAD, RankFailed, broadcast_from_rank0, job_world, join_job_world, launch
from .ep import import_object, system_config
from .ep.measure import clock_name
from .errors import ConfigError
from .records import (config_diff, config_hash, has_results, hashed_config, make_frame, read_run_config,
                      record_sweep_cost, row, without_later, write_results, write_run_config)
from .spec import RunSpec
from .tasks.schema import task_config
from .validate import validate

log = logging.getLogger("occult")
ERROR_FILE = "error.txt"
# points of this process's multirun that failed; run.py exits non-zero when any did
FAILED_POINTS: list = []
# one-off set-up the running point's preparation did (pre-training a proxy), in words
SETUP_DONE: list = []
# validation notes already logged by this process
NOTED: set = set()
# the number of points of the running sweep (set by the sweeper, read for progress lines)
SWEEP_POINTS_ENV = "OCCULT_SWEEP_POINTS"
# override keys whose values decide which checkpoint a point's preparation loads (the model, its
# pre-training, the seed, the task and its routing source); points that differ only in other
# keys (system, cluster, workload, ...) load the same checkpoints
CHECKPOINT_KEYS = ("model", "pretrain", "seed", "task", "task.routers", "task.routing")


def build_spec(cfg: DictConfig, out_dir, digest: str) -> RunSpec:
    """The run's :class:`occult.spec.RunSpec` from the composed, validated config: typed
    model, cluster, pre-training, task and system configs (no system where the task runs
    none), the run folder and digest, and the model of ``task.routers`` where the task has
    one. Made once; a task's ``prepare`` adds what it resolves."""
    task = task_config(cfg.task)
    routers = task.routers_model_name()
    return RunSpec(model=OmegaConf.to_object(cfg.model), cluster=OmegaConf.to_object(cfg.cluster), task=task,
                   pretrain=OmegaConf.to_object(cfg.pretrain),
                   system=system_config(cfg.system) if task.uses_system else None,
                   out_dir=str(out_dir), run_digest=digest, seed=cfg.seed, experiment_name=cfg.experiment_name,
                   label=cfg.label,
                   routers_model=OmegaConf.to_object(read_conf("model", routers)) if routers else None)


def checkpoint_specs(spec: RunSpec) -> list:
    """The specs whose model's checkpoint the point's preparation loads: the model of
    ``task.routers`` where the task routes with another model's routers, else the run's own;
    none for a task without a ``prepare`` or one whose routing source is not a router
    (synthetic routing, a trace)."""
    t = spec.task
    if not t.prepare or t.columns(spec.cluster.world_size)["routing"] != "router":
        return []
    if t.routers_model_name():
        from .tasks.world import routers_spec
        return [routers_spec(spec)]
    return [spec]


def untrained_proxies(spec: RunSpec) -> list:
    """Of :func:`checkpoint_specs`, those of a trained proxy (``model.proxy``, ``init=trained``,
    no ``model.path``) whose checkpoint is not cached: what the point's preparation would
    pre-train (:func:`occult.tasks.model.prepare`)."""
    from .tasks.pretrain import is_trained
    return [s for s in checkpoint_specs(spec)
            if s.model.proxy and s.model.init == "trained" and not s.model.path and not is_trained(s)]


def checkpoint_identity(point) -> tuple:
    """The overrides of a sweep point (``key=value`` strings) in :data:`CHECKPOINT_KEYS`
    (or under ``model.`` / ``pretrain.``)."""
    def key(o: str) -> str:
        return o.split("=", 1)[0].lstrip("+~")
    return tuple(sorted(o for o in point if key(o) in CHECKPOINT_KEYS or key(o).split(".")[0] in ("model", "pretrain")))


def before_sweep(points, compose, sweep_dir) -> list:
    """Before a sweep's first point: composes one point per :func:`checkpoint_identity`
    (``compose(overrides)``: the point's config), finds the trained proxies they load that are
    not cached (:func:`untrained_proxies`), announces them all with their expected time and
    pre-trains them, each timed; the times go into ``<sweep_dir>/sweep_cost.json``
    (``setup``), apart from the points'. Returns ``[{"what", "seconds"}]``. A point that does
    not compose is left to fail at its turn."""
    from .tasks.pretrain import announce, ensure_trained, expected_minutes, proxy_dir

    todo: dict = {}
    first = {}
    for point in points:
        first.setdefault(checkpoint_identity(point), point)
    for point in first.values():
        try:
            cfg = compose(list(point))
            spec = build_spec(cfg, "", "")
            for s in untrained_proxies(spec):
                todo.setdefault(proxy_dir(s).name, s)
        except Exception as exc:  # noqa: BLE001 - the point reports its own error when it runs
            log.debug("before the sweep: %s did not compose (%s)", point, exc)
    done = []
    if not todo:
        log.info("before the sweep: every trained proxy its points load is cached (%d point(s) composed to "
                 "check)", len(first))
        return done
    expected = [expected_minutes(s) for s in todo.values()]
    log.warning("before the sweep: %d proxy checkpoint(s) its points load are not cached and are pre-trained now, "
                "apart from the points: %s", len(todo), "; ".join(
                    f"{s.model.name} ({'about %.0f min' % m if m is not None else 'time unknown'})"
                    for s, m in zip(todo.values(), expected)))
    for name, s in todo.items():
        log.warning(announce(s))
        t0 = time.perf_counter()
        try:
            ensure_trained(s)
        except Exception as exc:  # noqa: BLE001 - its points fail at their turn, with error.txt
            log.error("before the sweep: pre-training %s failed (%s); its points will fail at their turn",
                      s.model.name, cause_line(exc))
            continue
        done.append({"what": f"pre-trained {s.model.name} ({name})", "seconds": round(time.perf_counter() - t0, 1)})
        log.warning("before the sweep: %s in %s", done[-1]["what"], _minutes(done[-1]["seconds"]))
    record_sweep_cost(sweep_dir, setup=done)
    return done


def run_context(spec: RunSpec) -> dict:
    """The context columns of every row of this run, from the spec's typed fields: the task's
    shape (:meth:`occult.tasks.schema.TaskConf.columns`: a task without a column's field
    writes the value declared there) and the settings declared as columns
    (:func:`run_settings`); a task that runs no top-level system writes ``system`` "" (its
    rows name their own systems)."""
    m, c, t = spec.model, spec.cluster, spec.task
    world = job_world()
    if spec.system is not None:
        system = {"system": spec.system.name, "impl": spec.system.impl_for(c.world_size),
                  "system_options": spec.system.options_json()}
    else:
        system = {"system": "", "impl": "", "system_options": "{}"}
    columns = t.columns(c.world_size)
    return {"run_id": f"{spec.experiment_name}/{system['system'] or '-'}/{m.name}/{t.name}/{c.name}/{spec.run_digest}",
            "experiment": spec.experiment_name, "label": spec.label, **system, "model": m.name,
            "init": spec.checkpoint or "random", "task": t.name, "cluster": c.name,
            "world_size": c.world_size, "devices_per_node": c.devices_per_node, "num_experts": m.num_experts,
            "top_k": m.top_k, "hidden_size": m.hidden_size, "expert_ffn_size": m.expert_ffn_size, "dtype": m.dtype,
            **columns, "trace_sha256": run_trace_sha256(t), **run_settings(spec), "seed": spec.seed,
            "config_hash": spec.run_digest, "clock": t.clock or clock_name(c.backend), "launcher": world.kind if world is not None else "local"}


def run_settings(spec: RunSpec) -> dict:
    """The run's settings columns (:func:`occult.columns.setting_values`) from its typed task and
    system (a task that runs no top-level system: its system columns' ``absent`` values)."""
    return setting_values({"task": spec.task, "system": spec.system, "model": spec.model, "cluster": spec.cluster,
                           "pretrain": spec.pretrain}, setting_columns())


def run_trace_sha256(t) -> str:
    """sha256 of the routing trace a task replays (``task.routing=trace``), "" for none."""
    trace = t.replayed_trace()
    if not trace:
        return ""
    from .workloads import trace_file, trace_sha256
    return trace_sha256(trace) if trace_file(trace).is_file() else ""


# keys of the composed config that say where code lives, not what runs: left out of the hash,
# and of a stored config compared with it (``task.schema``: the task's name says which task;
# its class moved from occult.tasks.options into each task's module after results were written)
NOT_SETTINGS = ("task.schema",)


def run_hashed_config(cfg: DictConfig) -> dict:
    """The composed config as it is hashed (:func:`occult.records.hashed_config`, keys at
    their later value left out: :func:`occult.config.later_keys`); a task that runs no
    top-level system leaves ``system`` out (its compared systems are in the task)."""
    container = OmegaConf.to_container(cfg, resolve=True)
    if not task_config(cfg.task).uses_system:
        container.pop("system", None)
    return {k: v for k, v in without_later(hashed_config(container), later_keys()).items() if k not in NOT_SETTINGS}


def already_done(out_dir: Path, hashed: dict) -> bool:
    """True when ``out_dir`` holds the results of this very config (skip it); raises
    :class:`ConfigError` when it holds another config's results."""
    if not has_results(out_dir):
        return False
    stored = read_run_config(out_dir)
    how = (f"rerun with resume=false to replace them, or into another folder "
           f"(out_dir=... for a single run, hydra.sweep.dir=... for a sweep)")
    if stored is None:
        raise ConfigError(f"{out_dir} holds results without a record of their config (written by an older "
                          f"version); {how}")
    diff = config_diff({k: v for k, v in stored["config"].items() if k not in NOT_SETTINGS}, hashed, later_keys())
    if stored["config_hash"] == config_hash(hashed) or not diff:
        return True
    raise ConfigError(f"{out_dir} holds results of a different config ({'; '.join(diff)}); {how}")


def _decide(cfg: DictConfig, out_dir: Path, hashed: dict, overrides: tuple):
    """What this point does: ``"skip"`` (results of this config exist), ``"run"`` (and the
    validation notes), or ``("error", message)`` for a config that cannot run here."""
    try:
        if cfg.resume and already_done(out_dir, hashed):
            return "skip", []
        return "run", validate(cfg, overrides)
    except ConfigError as exc:
        return "error", str(exc)


def run(cfg: DictConfig, out_dir, overrides: tuple = ()) -> Path | None:
    """Runs one configuration; returns the results file (None when skipped, and on every
    rank but 0 of a launcher's world). ``overrides``: the run's command-line overrides."""
    out_dir = Path(out_dir)
    hashed = run_hashed_config(cfg)
    digest = config_hash(hashed)
    world = job_world()
    if world is not None:        # torchrun or a submitit job: rank 0 decides, the others follow
        join_job_world(cfg.cluster.backend, cfg.cluster.run_timeout_s)
        if world.rank != 0:
            log.setLevel(logging.WARNING)            # rank 0 tells the story
    leader = world is None or world.rank == 0
    decision, notes = _decide(cfg, out_dir, hashed, tuple(overrides)) if leader else (None, None)
    if world is not None:
        decision, notes = broadcast_from_rank0((decision, notes))
    if decision == "skip":
        log.info("results of this config exist in %s: skipped (resume=true)", out_dir)
        return None
    if decision == "error":
        raise ConfigError(notes)
    for note in notes:
        if note not in NOTED:            # once per process, not once per sweep point
            NOTED.add(note)
            log.warning(note)
    spec = build_spec(cfg, out_dir, digest)
    task = spec.task
    entry = import_object(task.entry)
    c = spec.cluster
    log.info("running %s model=%s task=%s on %d rank(s)%s", _systems_of(spec), spec.model.name, task.name,
             c.world_size, " (simulated in one process)" if task.one_process else "")
    t0 = time.perf_counter()
    # the rows name the system as composed: a prepare may point the ranks' copy at a file it
    # made in the run folder (a profiled similarity file), which is not an option the user set
    composed_system = spec.system
    if task.prepare:         # e.g. pre-training a missing proxy: once, on rank 0
        spec = import_object(task.prepare)(spec) if leader else None
        if world is not None:
            spec = broadcast_from_rank0(spec)
    # one-off set-up the preparation did (e.g. pre-training a proxy): not a point's usual cost
    SETUP_DONE.extend(spec.setup_done)
    # a task that simulates its world runs in one process (the world's layout is in its config)
    ranks, layout = (1, 0) if task.one_process else (c.world_size, c.devices_per_node)
    per_rank = launch(entry, ranks, (spec,), seed=spec.seed,
                      timeout_s=c.run_timeout_s, collective_timeout_s=c.collective_timeout_s,
                      threads=c.threads_per_rank, backend=c.backend, host_memory_cache=c.host_memory_cache,
                      devices_per_node=layout, single_rank_collectives=c.single_rank_collectives,
                      preload=WHOLE_MODEL_PRELOAD if task.whole_model else ())
    if not leader:               # rank 0 writes
        return None
    rows = [r for rank_rows in per_rank for r in rank_rows]
    # the point's wall time here, start-up and any pre-training of a missing proxy included
    rows.append(row("run_wall_time", time.perf_counter() - t0, "s"))
    df = make_frame(rows, run_context(spec.replace(system=composed_system)))
    write_run_config(out_dir, hashed)
    path = write_results(df, out_dir)
    (out_dir / ERROR_FILE).unlink(missing_ok=True)
    log.info("wrote %d rows to %s in %.1f s", len(df), path, time.perf_counter() - t0)
    return path


def _systems_of(spec: RunSpec) -> str:
    """``system=<name>``, or the compared systems of a task that runs no top-level one."""
    if spec.system is not None:
        return f"system={spec.system.name}"
    names = spec.task.compared_names()
    return f"systems={','.join(names)}" if names else "no system"


@dataclass
class Progress:
    """Progress of this process's sweep: points started, seconds of the points that ran."""

    started: int = 0
    ran_seconds: list = field(default_factory=list)
    skipped: int = 0
    set_up: int = 0

    def begin(self, overrides: str) -> None:
        self.started += 1
        total = os.environ.get(SWEEP_POINTS_ENV)
        done = self.started - 1
        left = ""
        if total and self.ran_seconds:
            remaining = int(total) - done
            per_point = sum(self.ran_seconds) / len(self.ran_seconds)
            left = f", about {_minutes(per_point * remaining * (1 - self.skipped / max(done, 1)))} left"
        elif total and self.set_up:
            left = ", time left: estimated after a point without one-off set-up"
        of = f"/{total}" if total else ""
        log.info("[point %d%s] %s (%d done%s)", self.started, of, overrides or "(no overrides)", done, left)

    def end(self, seconds: float, skipped: bool, set_up: bool = False) -> None:
        """A point ended; ``set_up``: it ran one-off set-up (pre-training a proxy), so its
        time says nothing of the points to come and is left out of the estimate."""
        if skipped:
            self.skipped += 1
        elif set_up:
            self.set_up += 1
        else:
            self.ran_seconds.append(seconds)


class SharedProgress(Progress):
    """:class:`Progress` of a sweep whose points several forked processes run at once
    (``hydra/launcher=occult_parallel``): the counts in shared memory, made before the
    processes fork; time left from the sweep's time so far per point ended (the points run
    side by side, so a point's own time overstates it)."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("fork")
        self._counts = ctx.Array("l", 4)      # started, ended, skipped, set up
        self._since = time.time()

    def begin(self, overrides: str) -> None:
        with self._counts.get_lock():
            self._counts[0] += 1
            started, ended, skipped, set_up = self._counts[:]
        total = os.environ.get(SWEEP_POINTS_ENV)
        left = ""
        if total and ended > skipped + set_up:
            per_point = (time.time() - self._since) / (ended - skipped)      # skipped points take no time
            left = f", about {_minutes(per_point * (int(total) - ended) * (1 - skipped / ended))} left"
        of = f"/{total}" if total else ""
        log.info("[point %d%s] %s (%d done%s)", started, of, overrides or "(no overrides)", ended, left)

    def end(self, seconds: float, skipped: bool, set_up: bool = False) -> None:
        with self._counts.get_lock():
            self._counts[1] += 1
            self._counts[2] += int(skipped)
            self._counts[3] += int(set_up and not skipped)


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


PROGRESS = Progress()


def _log_files() -> list:
    return [h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]


def log_chain(exc: BaseException, out_dir=None) -> None:
    """The full traceback of ``exc`` into the run's log file (and ``error.txt`` in
    ``out_dir``), not onto the screen."""
    text = "".join(traceback.format_exception(exc))
    record = logging.LogRecord("occult", logging.ERROR, __file__, 0, "%s", (text,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / ERROR_FILE).write_text(text)


def cause_line(exc: BaseException) -> str:
    """One line for a run that failed: its message's first line and, when the message holds
    a traceback (a rank's), that traceback's last line, the error itself."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    head = lines[0] if isinstance(exc, (ConfigError, RankFailed)) else f"{type(exc).__name__}: {lines[0]}"
    if len(lines) > 1 and lines[0].endswith(":") and "Traceback" in str(exc):
        return f"{head} {lines[-1]}"
    return head


def run_or_record_failure(cfg: DictConfig, out_dir, multirun: bool, overrides: str = "",
                          cli_overrides: tuple = ()) -> Path | None:
    """In a multirun, a failing point writes ``error.txt`` and the sweep goes on; a single
    run that fails exits with one line, its cause (the traceback goes to the run's log and
    ``error.txt``; ``HYDRA_FULL_ERROR=1`` puts it on the screen). ``overrides``: the
    point's overrides for the progress line; ``cli_overrides``: the command line's."""
    t0 = time.perf_counter()
    if multirun:
        PROGRESS.begin(overrides)
    SETUP_DONE.clear()
    try:
        path = run(cfg, out_dir, cli_overrides)
        if multirun:
            PROGRESS.end(time.perf_counter() - t0, skipped=path is None, set_up=bool(SETUP_DONE))
        return path
    except Exception as exc:
        if multirun:
            PROGRESS.end(time.perf_counter() - t0, skipped=False, set_up=bool(SETUP_DONE))
        log_chain(exc, out_dir)
        if not multirun:
            if os.environ.get("HYDRA_FULL_ERROR") == "1" and not isinstance(exc, ConfigError):
                raise
            where = ", ".join([*_log_files(), str(Path(out_dir) / ERROR_FILE)])
            raise SystemExit(f"error: {cause_line(exc)}" +
                             ("" if isinstance(exc, ConfigError) else f" (traceback: {where})"))
        FAILED_POINTS.append(str(out_dir))
        log.error("point failed (%s); see %s", cause_line(exc), Path(out_dir) / ERROR_FILE)
        return None


def failed_points(sweep_dir) -> list[Path]:
    return sorted(p.parent for p in Path(sweep_dir).rglob(ERROR_FILE))


class SweepSummary(Callback):
    """Closes a multirun: lists the points that failed (run.py then exits non-zero)."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if os.environ.get("RANK", "0") != "0":       # under torchrun: rank 0 lists the failures
            return
        failed = failed_points(sweep_dir)
        if failed:
            names = "\n  ".join(str(p) for p in failed)
            log.error(f"{len(failed)} sweep point(s) failed (see error.txt in each):\n  {names}\n"
                      "The other points' results are intact; rerun the same command with "
                      f"hydra.sweep.dir={sweep_dir} to run only what is missing.")
