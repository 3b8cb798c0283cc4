"""task=layer: one MoE layer, random-init weights, timed per phase on every rank.

The layer, its inputs and a timed iteration: :mod:`occult.tasks.one_layer` (weights
generated per expert from the seed, so a rank builds only the experts its placement gives
it; tokens and synthetic routing seeded per rank). Before anything is timed the system is checked against the
single-device reference (task.check_parity). Every timed sample is kept.
With ``task.calibrate=true`` the ranks first measure their loopback
(:mod:`occult.tasks.loopback`), so that the cost model can be checked against
this run with a calibration taken under the same load.

Shapes: T tokens per rank, D hidden, F expert FFN, E experts, K top-k.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..ep import Recorder
from ..ep.measure import iterations
from ..ep.static import times_by_marks
from ..spec import RunSpec
from .common import comm_rows, parity_gate, routing_rows
from .one_layer import build_layer, make_inputs, task_placement, time_iteration
from .schema import Timed, Gated, Exchanges, LayerInputs, Placed, WithBackward


@dataclass
class Config(Timed, Gated, Exchanges, Placed, LayerInputs, WithBackward):
    """task=layer: one MoE layer, timed per phase (:mod:`occult.tasks.layer`)."""

    calibrate: bool = False             # measure the world's loopback first (the cost-model check)

    entry: ClassVar[str] = "occult.tasks.layer.run"
    expert_parallel_only: ClassVar[bool] = True


def run(ctx, spec: RunSpec) -> list:
    """One rank's part of task=layer; returns its result rows."""
    t = spec.task
    rows = []
    layer = build_layer(ctx, spec, placement=task_placement(ctx, spec))
    placement = layer.dispatcher.placement
    if t.check_parity:
        rows += parity_gate(ctx, spec, spec.system, t.routing, placement)
    if t.calibrate and ctx.world_size > 1:
        # this world's loopback under the load the timed iterations will see
        from .loopback import calibration_rows
        rows += calibration_rows(ctx)
    x_TD, ids_TK, grad_TD = make_inputs(ctx, spec)
    rec = Recorder(rank=ctx.rank, sync_collectives=t.sync_collectives, marks=times_by_marks(layer.dispatcher.config))
    for sample in iterations(ctx.ep, t.warmup, t.iters):
        sample_rows = time_iteration(ctx, layer, x_TD, ids_TK, grad_TD, rec, sample, t.backward)
        if sample >= 0:
            rows += sample_rows
    # the last timed iteration's collectives and routing (identical in every iteration)
    rows += comm_rows(rec)
    rows += routing_rows(ctx, rec, placement)
    return rows
