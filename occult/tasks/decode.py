"""task=decode: greedy generation of ``task.new_tokens`` tokens with a KV cache after the
prompts, on every system.

    python run.py task=decode model=olmoe_proxy system=occult [system.dispatch_mode=static]

The prompt runs the dynamic dispatch, the steps the system's ``dispatch_mode`` (static:
fixed buffers, with ``task.cuda_graph`` each MoE block's step captured in a CUDA graph);
``task.microbatches=2``: two micro-batches co-executed, each with its own cache
(docs/schedules.md). The iteration, the gate and the rows: :mod:`occult.tasks.model`.
"""
from __future__ import annotations

from ..spec import RunSpec
from .model import run_workload


def run(ctx, spec: RunSpec) -> list:
    """task=decode on this rank (:func:`occult.tasks.model.run_workload`)."""
    return run_workload(ctx, spec, "decode")
