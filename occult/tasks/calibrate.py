"""task=calibrate: this world's loopback and matmul rate, for the cost model, as a sweep point
(``python run.py experiment=calibrate`` fits a profile from P = 2, 4, 8). What is timed and
the rows: :mod:`occult.tasks.loopback`.
"""
from __future__ import annotations

from .loopback import RANK_BYTES, calibration_rows


def run(ctx, spec) -> list:
    """Task entry (``task=calibrate``): the calibration as a sweep point (``task.iters``
    timed calls per size, at least 3: :class:`occult.tasks.options.CalibrateTask` checks it)."""
    if ctx.world_size < 2:
        raise ValueError("task=calibrate needs cluster.world_size >= 2 (it times all-to-alls between ranks)")
    return calibration_rows(ctx, RANK_BYTES, spec.task.iters)
