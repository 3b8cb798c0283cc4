"""task=calibrate: this world's loopback and matmul rate, for the cost model, as a sweep point
(``python run.py experiment=calibrate`` fits a profile from P = 2, 4, 8). What is timed and
the rows: :mod:`occult.tasks.loopback`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .loopback import RANK_BYTES, calibration_rows
from .schema import TaskConf, at_least


@dataclass
class Config(TaskConf):
    """task=calibrate: this world's loopback and matmul rate, for the cost model
    (:mod:`occult.tasks.calibrate`): ``iters`` timed calls per message size."""

    iters: int = 8

    entry: ClassVar[str] = "occult.tasks.calibrate.run"
    uses_system: ClassVar[bool] = False

    def check(self) -> None:
        super().check()
        at_least("iters", self.iters, 3)


def run(ctx, spec) -> list:
    """Task entry (``task=calibrate``): the calibration as a sweep point (``task.iters``
    timed calls per size, at least 3: :class:`Config` checks it)."""
    if ctx.world_size < 2:
        raise ValueError("task=calibrate needs cluster.world_size >= 2 (it times all-to-alls between ranks)")
    return calibration_rows(ctx, RANK_BYTES, spec.task.iters)
