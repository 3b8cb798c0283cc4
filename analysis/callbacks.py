"""The Hydra callback that writes a sweep's report (named in ``conf/config.yaml``).

At the end of every multirun, :class:`SweepReport` writes ``report.md`` (tables, figures)
into the sweep folder with the builders of the experiment's ``report`` field and their
knobs in ``report_options``, the one way an experiment attaches its report
(:mod:`analysis.figures`).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("occult")


class SweepReport(Callback):
    """Writes the sweep's report when any point has results."""

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if os.environ.get("RANK", "0") != "0":       # under torchrun every rank runs the sweep; rank 0 reports
            return
        if not any(sweep_dir.rglob("results.parquet")):
            return
        from .report import write_report
        knobs = config.get("report_options")
        options = OmegaConf.to_container(knobs, resolve=True) if knobs is not None else {}
        log.info("report: %s", write_report([sweep_dir], sweep_dir, builders=config.get("report", ""), options=options))
