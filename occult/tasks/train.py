"""task=train: forward, backward, gradient synchronisation and an AdamW step (``task.lr``)
on training batches, on every system.

    python run.py task=train model=olmoe_proxy system=occult [task.grad_sync=overlap]

``task.microbatches=2`` co-executes micro-batches; ``task.grad_sync=end|overlap|lina``
schedules the gradient all-reduce (docs/schedules.md). The iteration, the gate and the
rows: :mod:`occult.tasks.model`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List

from ..columns import column
from ..errors import ConfigError
from ..spec import RunSpec
from .model import run_workload
from .schema import Timed, Gated, Placed, MicroBatched, Migrated, SavesRouting, Trained


@dataclass
class Config(Timed, Gated, Placed, MicroBatched, Migrated, Trained, SavesRouting):
    """task=train: forward, backward, gradient sync and an AdamW step on training batches
    of ``corpus`` (its train split). ``grad_sync``: when the replicated weights' gradients
    are averaged (``end``, ``overlap``, ``lina``: :mod:`occult.models.grad_sync`)."""

    grad_sync: str = column("end", absent="", later="end")

    def schedule(self) -> Dict[str, Any]:
        return {**super().schedule(), "grad_sync": self.grad_sync}

    def schedule_changes(self) -> List[str]:
        mine = [] if self.is_default("grad_sync") else [f"task.grad_sync={self.grad_sync}"]
        return super().schedule_changes() + mine

    def trains(self) -> bool:
        return True

    def check(self) -> None:
        super().check()
        from ..models.grad_sync import GRAD_SYNCS

        if self.grad_sync not in GRAD_SYNCS:
            raise ConfigError(f"task.grad_sync={self.grad_sync!r}: allowed values are {list(GRAD_SYNCS)}")

    entry: ClassVar[str] = "occult.tasks.train.run"
    prepare: ClassVar[str] = "occult.tasks.model.prepare"
    whole_model: ClassVar[bool] = True


def run(ctx, spec: RunSpec) -> list:
    """task=train on this rank (:func:`occult.tasks.model.run_workload`)."""
    return run_workload(ctx, spec, "train")
