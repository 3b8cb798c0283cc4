"""The Hydra callback that writes a sweep's report (named in ``conf/config.yaml``).

At the end of every multirun, :class:`SweepReport` writes ``report.md`` (tables, figures)
into the sweep folder with the builders of the experiment's ``report`` field and their
knobs in ``report_options``, the one way an experiment attaches its report
(:mod:`analysis.figures`).

It also records what the sweep cost in ``sweep_cost.json`` beside the points
(:data:`occult.records.SWEEP_COST_FILE`, which the published report states): the points'
wall time (from the sweep's start to its last point: Hydra's composition of every point
included, any pre-training before the points not: :func:`occult.runner.before_sweep` records
that apart) and the report's, each with its peak memory: the resident memory of this process
and every process under it (the points' ranks, their fork server), summed, sampled every
:data:`SAMPLE_EVERY_S` seconds (:class:`TreeMemory`), and their CPU seconds (user and system,
the same processes': on a machine whose cores are shared, the part of the wall time that
was this sweep's own work). The whole command's wall time and
largest process (``/usr/bin/time -v``) are :mod:`analysis.results`'s to record.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("occult")
SAMPLE_EVERY_S = 0.5


def _rss_bytes(pid: int) -> int:
    """Resident bytes of process ``pid`` (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _children(pid: int) -> list:
    """The child processes of ``pid`` (``/proc/<pid>/task/<tid>/children``; [] when gone)."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except (OSError, ValueError):
        pass
    return out


def _tree(root: int):
    """Process ``root`` and every process under it (pids, Linux ``/proc``)."""
    todo = [root]
    while todo:
        pid = todo.pop()
        yield pid
        todo += _children(pid)


def tree_rss_bytes(root: int) -> int:
    """Resident bytes of process ``root`` and every process under it (Linux ``/proc``)."""
    return sum(_rss_bytes(pid) for pid in _tree(root))


def _cpu_seconds(pid: int) -> float:
    """CPU seconds of process ``pid``: user and system, its own and its reaped children's."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds of process ``root`` and every process under it, those that ended included
    where their parent reaped them (a rank: its fork server; a fork server: this process)."""
    return sum(_cpu_seconds(pid) for pid in _tree(root))


class TreeMemory:
    """The peak of :func:`tree_rss_bytes` of this process, sampled every ``every_s`` seconds
    in a thread between ``start()`` and ``stop()`` (bytes; -1 without ``/proc``)."""

    def __init__(self, every_s: float = SAMPLE_EVERY_S):
        self.every_s, self.peak = every_s, -1
        self.cpu_s = 0.0                 # CPU seconds of the tree between start() and stop()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="tree-memory")

    def _loop(self) -> None:
        while True:
            self.peak = max(self.peak, tree_rss_bytes(os.getpid()))
            if self._stop.wait(self.every_s):
                return

    def start(self) -> "TreeMemory":
        if Path("/proc/self/statm").is_file():
            self.cpu_s = -tree_cpu_seconds(os.getpid())
            self._thread.start()
        return self

    def stop(self) -> int:
        if self._thread.is_alive():
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, tree_rss_bytes(os.getpid()))
            self.cpu_s = round(self.cpu_s + tree_cpu_seconds(os.getpid()), 1)
        return self.peak


class SweepReport(Callback):
    """Writes the sweep's report when any point has results; records the sweep's cost."""

    def __init__(self) -> None:
        self.started = None          # (time, TreeMemory) of the running multirun

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        from occult.records import SWEEP_COST_FILE
        (Path(config.hydra.sweep.dir) / SWEEP_COST_FILE).unlink(missing_ok=True)     # this command's cost only
        self.started = (time.perf_counter(), TreeMemory().start())

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        from occult.records import SWEEP_COST_FILE, record_sweep_cost
        sweep_dir = Path(config.hydra.sweep.dir)
        if os.environ.get("RANK", "0") != "0":       # under torchrun every rank runs the sweep; rank 0 reports
            return
        cost = {}
        if self.started is not None:
            t0, memory = self.started
            setup = sum(s["seconds"] for s in _setup(sweep_dir / SWEEP_COST_FILE))
            cost = {"points_s": round(time.perf_counter() - t0 - setup, 1), "points_peak_rss": memory.stop(),
                    "points_cpu_s": memory.cpu_s}
            self.started = None
        if cost:                 # before the report, which states it (its own cost: in the published copy)
            record_sweep_cost(sweep_dir, **cost)
        if not any(sweep_dir.rglob("results.parquet")):
            return
        from .report import write_report
        knobs = config.get("report_options")
        options = OmegaConf.to_container(knobs, resolve=True) if knobs is not None else {}
        t0, memory = time.perf_counter(), TreeMemory().start()
        path = write_report([sweep_dir], sweep_dir, builders=config.get("report", ""), options=options)
        cost = {"report_s": round(time.perf_counter() - t0, 1), "report_peak_rss": memory.stop(),
                "report_cpu_s": memory.cpu_s}
        record_sweep_cost(sweep_dir, **cost)
        log.info("report: %s (%.0f s, peak %.2f GB)", path, cost["report_s"], cost["report_peak_rss"] / 1e9)


def _setup(path: Path) -> list:
    """The ``setup`` entries of a ``sweep_cost.json`` ([] without one)."""
    import json
    return json.loads(path.read_text()).get("setup", []) if path.is_file() else []
