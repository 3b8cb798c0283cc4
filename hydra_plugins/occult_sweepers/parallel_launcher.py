"""``hydra/launcher=occult_parallel``: a sweep's points ``n_jobs`` at a time, each point in a
process forked from the sweep's (Hydra's basic launcher runs them one after another).

    python run.py -m task=simulate ... hydra/launcher=occult_parallel hydra.launcher.n_jobs=2

For sweeps of many cheap one-process points (``experiment=scale_study``: about 1,200
simulated worlds of a second each), where the points, not their work, cost the time: the
basic launcher runs a point's rank while the sweep's own process waits, so one of two cores
idles. Only points of a one-process task that measures no collective time may run side by side
(``one_process`` tasks: ``simulate``, ``place``, ``placement_load``): a timed point beside
another would measure both. A sweep with any other task, or ``n_jobs`` below 1, is refused in
one line before any point runs; ``n_jobs`` above the cores this process may use runs as many as
there are cores; ``n_jobs=1`` is the basic launcher.

Each worker composes and runs its points as the basic launcher does (``run_job``), in the
sweep's order; a point whose task writes a file later points read (``writes_artifact``:
``task=place``'s placements, read by ``occult_placed`` points) ends before any later point
starts but another writer. The progress lines count over all workers
(:class:`occult.runner.SharedProgress`), a failed point is reported to the sweep's process
(``run.py`` exits non-zero), the other points go on; a worker that dies stops the sweep in one
line, the points that ended written.
"""
import logging
import multiprocessing
import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

from omegaconf import DictConfig, open_dict

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn, configure_log, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction

from .grids_sweeper import point_shape

log = logging.getLogger(__name__)


@dataclass
class ParallelLauncherConf:
    _target_: str = "hydra_plugins.occult_sweepers.parallel_launcher.ParallelLauncher"
    n_jobs: int = 2                 # points at a time (1: one after another, as the basic launcher)


ConfigStore.instance().store(group="hydra/launcher", name="occult_parallel", node=ParallelLauncherConf,
                             provider="occult")

def usable_cores() -> int:
    """The cores this process may run on (its affinity, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# the launcher whose points the forked workers run (set before they fork; read in _run_point)
_ACTIVE: Optional["ParallelLauncher"] = None


class ParallelLauncher(Launcher):
    """Runs a batch of points ``n_jobs`` at a time in forked processes (see the module docstring)."""

    def __init__(self, n_jobs: int = 2) -> None:
        super().__init__()
        self.n_jobs = n_jobs
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def jobs(self) -> int:
        """Points at a time: ``n_jobs``, at most the cores this process may use (points side by
        side on shared cores would slow each other)."""
        return max(1, min(self.n_jobs, usable_cores()))

    def compose(self, overrides, idx: int) -> DictConfig:
        """A point's config, as the basic launcher composes it."""
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(cfg):
            cfg.hydra.job.id = idx
            cfg.hydra.job.num = idx
        return cfg

    def check(self, job_overrides: Sequence[Sequence[str]]) -> set:
        """Refuses, in one line, ``n_jobs`` below 1, or side by side points of a
        task that is not one-process (composes one point per :func:`point_shape`); returns the
        shapes whose task writes a file later points read (``writes_artifact``: a placement)."""
        from occult.errors import ConfigError
        from occult.tasks.schema import task_config

        if self.n_jobs < 1:
            raise ConfigError(f"hydra.launcher.n_jobs={self.n_jobs}: allowed values are 1 or more (points at a "
                              f"time, at most this machine's {usable_cores()} cores are used)")
        if self.jobs() == 1:
            return set()
        first, barriers = {}, set()
        for point in job_overrides:
            first.setdefault(point_shape(point), point)
        for shape, point in first.items():
            task = task_config(self.compose(point, 0).task)
            if not task.one_process:
                raise ConfigError(f"hydra.launcher.n_jobs={self.n_jobs}: task={task.name} starts ranks and times "
                                  f"them, so its points cannot run side by side; allowed: hydra.launcher.n_jobs=1, "
                                  f"or a sweep of one-process tasks (simulate, place, placement_load)")
            if task.writes_artifact:
                barriers.add(shape)
        return barriers

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        global _ACTIVE
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        barriers = self.check(job_overrides)
        jobs = [(initial_job_idx + i, list(o)) for i, o in enumerate(job_overrides)]
        waits = {idx for idx, o in jobs if point_shape(o) in barriers}
        workers = min(self.jobs(), len(jobs))
        if self.jobs() < self.n_jobs:
            log.info(f"hydra.launcher.n_jobs={self.n_jobs}: {self.jobs()} at a time, this machine's cores")
        log.info(f"Launching {len(jobs)} jobs locally, {workers} at a time")
        if workers <= 1:
            return [_run(self, idx, overrides)[0] for idx, overrides in jobs]
        from occult import runner

        if not isinstance(runner.PROGRESS, runner.SharedProgress):
            runner.PROGRESS = runner.SharedProgress()
        _ACTIVE = self
        returns, failed = run_forked(jobs, workers, waits)
        runner.FAILED_POINTS.extend(failed)
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return [returns[idx] for idx, _ in jobs]


def run_forked(jobs: list, workers: int, barriers: set = frozenset()) -> tuple:
    """``jobs`` ([(idx, overrides)]) in order on ``workers`` forked processes (not daemons: a
    point starts its ranks' processes), each taking the next job when done; no job starts
    while a job of ``barriers`` (idx: a point that writes a file later points read) runs.
    Returns ({idx: JobReturn}, the failed points' folders). A worker that dies mid-point (a
    crash, not an error, which the point records) stops the sweep with a one-line error."""
    import queue

    ctx = multiprocessing.get_context("fork")
    todo, done = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(todo, done), name=f"occult-point-{i}") for i in range(workers)]
    for p in procs:
        p.start()
    order, returns, failed, running = Handout(jobs, workers, barriers), {}, [], {}

    def hand_out() -> None:
        for job in order.next_jobs():
            todo.put(job)
    try:
        hand_out()
        while len(returns) < len(jobs):
            try:
                kind, pid, idx, *rest = done.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead or not any(p.is_alive() for p in procs):
                    lost = sorted(order.handed) or sorted(idx for idx, _ in order.pending)
                    raise RuntimeError(f"a point's process died ({', '.join(f'pid {p.pid}, exit code {p.exitcode}' for p in dead) or 'every worker ended'}) "
                                       f"with point(s) #{', #'.join(map(str, lost))} not ended; the points that ended "
                                       f"are written: rerun the same command to run the rest")
                continue
            if kind == "start":
                running[pid] = idx
                continue
            returns[idx] = rest[0]
            failed += rest[1]
            running.pop(pid, None)
            order.ended(idx)
            hand_out()
    finally:
        for _ in procs:
            todo.put(None)
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    return returns, failed


class Handout:
    """Which jobs may start: in order, at most ``workers`` at once, none while a job of
    ``barriers`` (its idx) runs (it writes a file a later point reads)."""

    def __init__(self, jobs: list, workers: int, barriers=frozenset()) -> None:
        self.pending = deque(jobs)
        self.workers = workers
        self.barriers = set(barriers)
        self.handed: set = set()

    def next_jobs(self) -> list:
        """The jobs to start now (removed from the pending ones): a job that writes starts beside
        earlier ones (it reads none of their files); any other waits for the writers running."""
        out = []
        while self.pending and len(self.handed) < self.workers:
            job = self.pending[0]
            if self.handed & self.barriers and job[0] not in self.barriers:
                break
            self.pending.popleft()
            self.handed.add(job[0])
            out.append(job)
        return out

    def ended(self, idx: int) -> None:
        self.handed.discard(idx)


def _worker(todo, done) -> None:
    """A forked process's loop: runs jobs of ``todo`` until its ``None``, reporting to ``done``."""
    import torch
    torch.set_num_threads(1)        # forked from a process whose thread pool may have started (pre-training)
    while True:
        job = todo.get()
        if job is None:
            return
        done.put(("start", os.getpid(), job[0]))
        ret, failed = _run(_ACTIVE, *job)
        done.put(("end", os.getpid(), job[0], ret, failed))


def _run(launcher: ParallelLauncher, idx: int, overrides: list) -> tuple:
    """One point, composed and run (``run_job``): (its JobReturn, the failed points it added)."""
    from occult import runner

    log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
    before = len(runner.FAILED_POINTS)
    ret = run_job(hydra_context=launcher.hydra_context, task_function=launcher.task_function,
                  config=launcher.compose(overrides, idx), job_dir_key="hydra.sweep.dir",
                  job_subdir_key="hydra.sweep.subdir")
    configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)
    return ret, runner.FAILED_POINTS[before:]
