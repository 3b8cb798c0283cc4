"""task=decode: greedy generation of ``task.new_tokens`` tokens with a KV cache after the
prompts, on every system.

    python run.py task=decode model=olmoe_proxy system=occult [system.dispatch_mode=static]

The prompt runs the dynamic dispatch, the steps the system's ``dispatch_mode`` (static:
fixed buffers, with ``task.cuda_graph`` each MoE block's step captured in a CUDA graph);
``task.microbatches=2``: two micro-batches co-executed, each with its own cache
(docs/schedules.md). The iteration, the gate and the rows: :mod:`occult.tasks.model`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..errors import ConfigError
from ..spec import RunSpec
from .model import run_workload
from .schema import Generates, Served


@dataclass
class Config(Served, Generates):
    """task=decode: greedy generation with a KV cache after the prompts. ``cuda_graph``: each
    MoE block's static decode step captured in a CUDA graph and replayed
    (:mod:`occult.ep.graphs`; CUDA ranks and ``system.dispatch_mode=static`` only)."""

    cuda_graph: bool = False

    entry: ClassVar[str] = "occult.tasks.decode.run"

    def call_tokens(self) -> int:
        """A decode step's B (its prompt runs the dynamic dispatch)."""
        return self.batch_size

    def check(self) -> None:
        super().check()
        if self.migration:
            raise ConfigError("task.migration=true: task=decode would move each migrated sequence's KV cache, "
                              "which is not implemented; allowed values here: false (migration runs with "
                              "task=prefill and task=train)")

    def check_run(self, cfg) -> None:
        super().check_run(cfg)
        if not self.cuda_graph:
            return
        import torch

        from ..ep import system_config
        from ..ep.graphs import refusal

        system = system_config(cfg.system)
        why = refusal(cfg.cluster.backend, system.is_static(),
                      torch.cuda.is_available())
        if why:
            raise ConfigError(why)


def run(ctx, spec: RunSpec) -> list:
    """task=decode on this rank (:func:`occult.tasks.model.run_workload`)."""
    return run_workload(ctx, spec, "decode")
