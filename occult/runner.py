"""What ``run.py`` does with a composed config: validate -> launch ranks -> gather rows -> write.

Also the Hydra callback that closes a multirun: it lists failed points (their
``error.txt``) and fails the sweep after every other point has written its
results, so a rerun of the same command resumes where it stopped.
"""
from __future__ import annotations

import logging
import time
import traceback
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from .dist import launch
from .records import has_results, make_frame, row, write_results
from .validate import import_object, system_class, validate

log = logging.getLogger("occult")
ERROR_FILE = "error.txt"
# points of this process's multirun that failed; run.py exits non-zero when any did
FAILED_POINTS: list = []


def run_context(cfg: DictConfig, impl: str) -> dict:
    """The context columns of every row of this run."""
    m, t, c = cfg.model, cfg.task, cfg.cluster
    return {"run_id": f"{cfg.experiment_name}/{cfg.system.name}/{m.name}/{t.name}/{c.name}/k{m.top_k}/s{cfg.seed}",
            "experiment": cfg.experiment_name, "system": cfg.system.name, "impl": impl, "model": m.name,
            "task": t.name, "cluster": c.name, "world_size": c.world_size, "num_experts": m.num_experts,
            "top_k": m.top_k, "hidden_size": m.hidden_size, "expert_ffn_size": m.expert_ffn_size,
            "tokens_per_rank": t.tokens_per_rank, "routing": t.routing,
            "batch_size": t.get("batch_size", -1), "seq_len": t.get("seq_len", -1), "seed": cfg.seed}


def run(cfg: DictConfig, out_dir) -> Path | None:
    """Runs one configuration; returns the results file (None when skipped)."""
    out_dir = Path(out_dir)
    if cfg.resume and has_results(out_dir):
        log.info("results exist in %s: skipped (resume=true)", out_dir)
        return None
    validate(cfg)
    impl = system_class(OmegaConf.to_container(cfg.system)).impl
    entry = import_object(cfg.task.entry)
    c = cfg.cluster
    log.info("running system=%s model=%s task=%s on %d rank(s)", cfg.system.name, cfg.model.name,
             cfg.task.name, c.world_size)
    t0 = time.perf_counter()
    cfg_dict = OmegaConf.to_container(cfg, resolve=True)
    cfg_dict["out_dir_resolved"] = str(out_dir)
    if cfg.task.get("prepare"):
        cfg_dict = import_object(cfg.task.prepare)(cfg_dict)
    per_rank = launch(entry, c.world_size, (cfg_dict,), seed=cfg.seed,
                      timeout_s=c.run_timeout_s, collective_timeout_s=c.collective_timeout_s,
                      threads=c.threads_per_rank, backend=c.backend)
    if per_rank is None or per_rank[0] is None:       # a non-zero torchrun rank: rank 0 writes
        return None
    rows = [r for rank_rows in per_rank for r in rank_rows]
    # the point's wall time here, start-up and any pre-training of a missing proxy included
    rows.append(row("run_wall_time", time.perf_counter() - t0, "s"))
    df = make_frame(rows, run_context(cfg, impl))
    path = write_results(df, out_dir)
    (out_dir / ERROR_FILE).unlink(missing_ok=True)
    log.info("wrote %d rows to %s in %.1f s", len(df), path, time.perf_counter() - t0)
    return path


def run_or_record_failure(cfg: DictConfig, out_dir, multirun: bool) -> Path | None:
    """In a multirun, a failing point writes ``error.txt`` and the sweep goes on."""
    try:
        return run(cfg, out_dir)
    except Exception as exc:
        if not multirun:
            raise
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / ERROR_FILE).write_text(traceback.format_exc())
        FAILED_POINTS.append(str(out_dir))
        log.error("point failed (%s); see %s", str(exc).splitlines()[0], Path(out_dir) / ERROR_FILE)
        return None


def failed_points(sweep_dir) -> list[Path]:
    return sorted(p.parent for p in Path(sweep_dir).rglob(ERROR_FILE))


class SweepSummary(Callback):
    """Closes a multirun: writes its report and lists the points that failed
    (run.py then exits non-zero)."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        failed = failed_points(sweep_dir)
        if any(sweep_dir.rglob("results.parquet")):
            from analysis.report import write_report
            log.info("report: %s", write_report([sweep_dir], sweep_dir, builders=config.get("report", "")))
        if failed:
            names = "\n  ".join(str(p) for p in failed)
            log.error(f"{len(failed)} sweep point(s) failed (see error.txt in each):\n  {names}\n"
                               "The other points' results are intact; rerun the same command with "
                               f"hydra.sweep.dir={sweep_dir} to run only what is missing.")
