"""The run spec: one typed, frozen value from the command line to the ranks.

:func:`occult.runner.build_spec` makes it once per run from the composed, validated config:
the typed model, cluster, pre-training and task configs (the task's own ``Config``), the
typed system config (None where the task runs no top-level system), the run folder, the
run's config digest and seed, and the routers' model a task resolves (``task.routers``).
A task's ``prepare`` (once, in the launching process) returns a new spec with what it
resolved (the checkpoint, the compared systems, a profiled file, the one-off set-up it did:
:meth:`RunSpec.replace`); the runner hands the result to every rank as it is, and each
task entry ``run(ctx, spec)`` reads typed fields. Nothing travels beside it.

The spec pickles (the ranks are processes): every field is a dataclass, a tuple or a
plain value.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Tuple

from .schemas import ClusterConf, ModelConf, PretrainConf

if TYPE_CHECKING:           # typing only: a spec needs no task or system code to exist
    from .ep.system import SystemConfig
    from .tasks.schema import TaskConf


@dataclass(frozen=True)
class RunSpec:
    """What a run runs, typed (see the module docstring)."""

    model: ModelConf
    cluster: ClusterConf
    task: TaskConf
    pretrain: PretrainConf
    system: Optional[SystemConfig]          # None: the task runs no top-level system
    out_dir: str                            # the run folder (rank 0 writes there)
    run_digest: str                         # the composed config's digest (the run_id's last part)
    seed: int
    experiment_name: str
    label: str
    # what the launching process resolved for the ranks
    routers_model: Optional[ModelConf] = None   # task.routers: the model whose routers route
    checkpoint: Optional[str] = None        # the weights every rank loads (None: seeded random)
    compared: Tuple[SystemConfig, ...] = ()  # tasks that compare systems: their typed configs
    setup_done: Tuple[str, ...] = ()        # one-off set-up the preparation did, in words

    def replace(self, **changes: Any) -> "RunSpec":
        """A copy with ``changes`` (:func:`dataclasses.replace`)."""
        return dataclasses.replace(self, **changes)

    def with_task(self, **changes: Any) -> "RunSpec":
        """A copy whose task config has ``changes`` (e.g. another split for a profiling set)."""
        return dataclasses.replace(self, task=dataclasses.replace(self.task, **changes))

    def with_model(self, model) -> "RunSpec":
        """A copy with another model config (e.g. the routers' model of ``task.routers``)."""
        return dataclasses.replace(self, model=model)
