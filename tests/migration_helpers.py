"""Rank functions for tests/test_migration.py (importable by spawned ranks): one tiny OLMoE
model (float64, naive EP) run with and without sequence migration on the same batches.

Shapes: B sequences per rank, S length, D hidden, V vocabulary, P ranks.
"""
from typing import Optional

import torch
import torch.nn.functional as nnf
from omegaconf import OmegaConf

from occult.ep import Recorder, system_config
from occult.ep.accounting import recording
from occult.models.build import hf_config, init_model, to_expert_parallel
from occult.models.ep_block import ep_placements
from occult.models.families import family_of, gate_rule
from occult.models.runtime import sync_gradients
from occult.parity import run_model_grid
from occult.tasks.migration import MigratingModel

B, S, V, D = 3, 5, 40, 16
MODEL = dict(family="olmoe", num_experts=8, top_k=2, hidden_size=D, expert_ffn_size=8, num_layers=2, num_heads=2,
             max_position=32)
NAIVE = {"name": "naive", "_target_": "baselines.naive.NaiveDispatcher"}


def rank_model(ctx):
    m = OmegaConf.create(MODEL)
    fam = family_of("olmoe")
    full = init_model(fam, hf_config(m, V), 0).double()
    return to_expert_parallel(full, fam, lambda li: system_config(NAIVE).build(ctx.ep, li, 8), gate_rule(m))


def batch(rank: int, parity: int) -> tuple:
    """B sequences whose tokens all have the given parity (and their next-token targets)."""
    g = torch.Generator().manual_seed(10 + rank)
    x_BS = torch.randint(0, V // 2, (B, S), generator=g) * 2 + parity
    return x_BS, torch.roll(x_BS, -1, 1)


def step(ctx, model, x_BS, y_BS) -> dict:
    """One forward and backward (gradients synchronised), under a recorder."""
    rec = Recorder(rank=ctx.rank)
    model.zero_grad(set_to_none=True)
    with recording(rec):
        logits = model(input_ids=x_BS, use_cache=False).logits
        loss = nnf.cross_entropy(logits.flatten(0, 1), y_BS.flatten())
        loss.backward()
    sync_gradients(ctx, model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"logits": logits.detach(), "grads": grads, "rec": rec}


def migration_world(ctx) -> dict:
    """Rank 0's tokens are even, rank 1's odd. Plain EP; then migration with a table that
    scores even tokens for rank 1 and odd ones for rank 0 (every sequence moves); then a
    step with the table counted from that step's routing."""
    x_BS, y_BS = batch(ctx.rank, ctx.rank % 2)
    plain = rank_model(ctx)
    out = {"plain": step(ctx, plain, x_BS, y_BS)}
    model = MigratingModel(ctx, rank_model(ctx), ep_placements(plain))
    table_VP = torch.zeros(V, ctx.world_size, dtype=torch.float64)
    table_VP[0::2, 1] = table_VP[1::2, 0] = 1.0
    model.table_VP = table_VP
    out["swap"] = step(ctx, model, x_BS, y_BS)
    out["counted"] = step(ctx, model, x_BS, y_BS)
    out["table_after"] = model.table_VP
    for key in ("plain", "swap", "counted"):
        rec = out[key].pop("rec")
        out[key]["comm"] = [(ev.phase, ev.direction, ev.rows_P, ev.row_bytes) for ev in rec.comm if ev.layer == -1]
        out[key]["counters"] = {name: v for layer, name, v in rec.counters if layer == -1}
        placements = ep_placements(plain)
        out[key]["remote_plain"] = sum(int((placements[li].pair_local(ids)[0] != ctx.rank).sum())
                                       for li, ids, *_ in rec.routing)
    out["profiled"] = profiled_table(ctx, x_BS)
    return out


def profiled_table(ctx, x_BS):
    """The first step's table from a fresh migrating model (the profiling pass)."""
    plain = rank_model(ctx)
    model = MigratingModel(ctx, plain, ep_placements(plain))
    with torch.no_grad():
        model(input_ids=x_BS)
    return model.table_VP


def models_and_migration(ctx, jobs: list, migration: bool, scmoe: dict, olmoe: Optional[dict] = None) -> tuple:
    """One world for all: :func:`occult.parity.run_model_grid`, when asked
    :func:`migration_world` (None otherwise), ScMoE's schedules on model config ``scmoe``
    (:func:`scmoe_helpers.schedule_world`) and, with ``olmoe``, the runs' whole-model gate
    (:func:`scmoe_helpers.gate_world`; None otherwise)."""
    from scmoe_helpers import gate_world, schedule_world
    return (run_model_grid(ctx, jobs), migration_world(ctx) if migration else None, schedule_world(ctx, scmoe),
            gate_world(ctx, scmoe, olmoe) if olmoe else None)
