"""task=bench: systems side by side on one MoE layer in one world, forward and backward.

    python run.py experiment=bench                     # (make bench) naive vs occult, layers and models
    python run.py experiment=bench model=bench_comm task.iters=3 task.compare=[naive,occult,megablocks]
    python run.py task=bench 'task.compare=[naive,{name:occult,kernels:epd},{name:naive,payload:int8}]'

One MoE layer (``model``'s E, K, D, F; ``task.tokens_per_rank`` tokens per rank,
``task.routing``) for each system of ``task.compare`` (:mod:`occult.tasks.compare`: the
systems, their turns, the replayed collectives, the rows' tags). Every system is first
checked against the single-device reference; then the systems' iterations alternate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..ep import Recorder
from ..ep.measure import iterations, stopwatch
from ..ep.static import times_by_marks
from ..memory import saved_activation_bytes
from ..records import row
from ..spec import RunSpec
from .common import comm_rows, parity_gate, routing_rows
from .compare import replay_rows, tagged, turns
from .one_layer import build_layer, make_inputs, time_iteration
from .schema import Timed, Gated, Exchanges, LayerInputs, Compared


@dataclass
class Config(Timed, Gated, Exchanges, LayerInputs, Compared):
    """task=bench: systems side by side on one MoE layer, forward and backward
    (:mod:`occult.tasks.bench`)."""

    entry: ClassVar[str] = "occult.tasks.bench.run"
    prepare: ClassVar[str] = "occult.tasks.compare.prepare"
    expert_parallel_only: ClassVar[bool] = True


def run(ctx, spec: RunSpec) -> list:
    """On every rank: parity per system, then alternating timed iterations."""
    systems, t = spec.compared, spec.task
    layers, recs, rows = [], [], []
    for config in systems:
        layer = build_layer(ctx, spec, config)
        rows.append(parity_gate(ctx, spec, config, t.routing, layer.dispatcher.placement)
                    if t.check_parity else [])
        layers.append(layer)
        recs.append(Recorder(rank=ctx.rank, sync_collectives=t.sync_collectives, marks=times_by_marks(config)))
    x_TD, ids_TK, grad_TD = make_inputs(ctx, spec)
    for i, layer in enumerate(layers):
        act = saved_activation_bytes(layer, x_TD.clone().requires_grad_(True), None, ids_TK)
        rows[i].append(row("activation_bytes", act, "bytes", layer=0, rank=ctx.rank))
    for sample in iterations(ctx.ep, t.warmup, t.iters):
        took = {}
        for i in turns(len(layers), sample):
            with stopwatch() as sw:
                sample_rows = time_iteration(ctx, layers[i], x_TD, ids_TK, grad_TD, recs[i], sample, True)
            took[i] = f"{systems[i].name} {sw.seconds:.1f} s"
            if sample >= 0:
                rows[i] += sample_rows
        if ctx.rank == 0:
            kind = "warm-up" if sample < 0 else f"sample {sample + 1}/{t.iters}"
            print(f"  [{spec.model.name}] {kind}: {', '.join(took[i] for i in sorted(took))}", flush=True)
    base_id = f"{spec.experiment_name}/bench/{spec.model.name}/{spec.cluster.name}/{spec.run_digest}"
    out = []
    replayed = replay_rows(ctx, layers, recs, (x_TD, ids_TK, grad_TD), t.iters) if ctx.world_size > 1 else None
    for i, config in enumerate(systems):
        rows[i] += comm_rows(recs[i]) + routing_rows(ctx, recs[i], layers[i].dispatcher.placement)
        rows[i] += replayed[i] if replayed else []
        out += tagged(rows[i], config, base_id, ctx.world_size)
    return out
