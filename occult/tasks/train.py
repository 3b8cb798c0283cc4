"""task=train: forward, backward, gradient synchronisation and an AdamW step (``task.lr``)
on training batches, on every system.

    python run.py task=train model=olmoe_proxy system=occult [task.grad_sync=overlap]

``task.microbatches=2`` co-executes micro-batches; ``task.grad_sync=end|overlap|lina``
schedules the gradient all-reduce (docs/schedules.md). The iteration, the gate and the
rows: :mod:`occult.tasks.model`.
"""
from __future__ import annotations

from ..spec import RunSpec
from .model import run_workload


def run(ctx, spec: RunSpec) -> list:
    """task=train on this rank (:func:`occult.tasks.model.run_workload`)."""
    return run_workload(ctx, spec, "train")
