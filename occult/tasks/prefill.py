"""task=prefill: a whole model's forward over the prompts, on every system: time to first token.

    python run.py task=prefill model=olmoe_proxy system=occult cluster=cpu4 [task.microbatches=2]

``task.batch_size`` held-out prompts of ``task.seq_len`` tokens per rank (``task.corpus`` /
``task.split``), behind the parity gate; ``task.microbatches=2``: two micro-batches
co-executed (docs/schedules.md). The iteration, the gate and the rows:
:mod:`occult.tasks.model`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..spec import RunSpec
from .model import run_workload
from .schema import Served


@dataclass
class Config(Served):
    """task=prefill: one forward over the prompts (:mod:`occult.tasks.model`)."""


    entry: ClassVar[str] = "occult.tasks.prefill.run"


def run(ctx, spec: RunSpec) -> list:
    """task=prefill on this rank (:func:`occult.tasks.model.run_workload`)."""
    return run_workload(ctx, spec, "prefill")
