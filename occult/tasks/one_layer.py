"""One MoE layer on the ranks (task=layer and task=bench time it): its seeded weights (a rank
builds only the experts its placement gives it), its seeded tokens and routing (synthetic,
the router's, or a load workload of :mod:`occult.workloads`), the placement of
``task.placement`` (EPLB's slots from a profiling draw), and one timed iteration.

Shapes: T tokens per rank, D hidden, F expert FFN, E experts, K top-k.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..ep import GroupedExperts, MoELayer, Recorder, TopKRouter, system_config
from ..ep.measure import barrier, clock
from ..models.families import gate_rule
from ..records import row
from ..synthetic import expert_popularity, sample_topk
from ..workloads import WORKLOADS, workload_topk
from .common import timing_rows


def expert_weights(expert_ids, hidden: int, ffn: int, seed: int, dtype, device) -> GroupedExperts:
    """Experts ``expert_ids`` (slot order), each from its own seeded generator (drawn on
    the host, so every device gets the same weights), on ``device``."""
    gates, ups, downs = [], [], []
    for i in expert_ids.tolist():
        g = torch.Generator(device="cpu").manual_seed(seed * 1_000_003 + 7919 * (i + 1))
        gates.append(torch.randn(hidden, ffn, generator=g, device="cpu") / hidden ** 0.5)
        ups.append(torch.randn(hidden, ffn, generator=g, device="cpu") / hidden ** 0.5)
        downs.append(torch.randn(ffn, hidden, generator=g, device="cpu") / ffn ** 0.5)

    def stack(ts, shape):
        out = torch.stack(ts) if ts else torch.zeros((0,) + shape, device="cpu")
        return out.to(device=device, dtype=dtype)

    return GroupedExperts(stack(gates, (hidden, ffn)), stack(ups, (hidden, ffn)), stack(downs, (ffn, hidden)))


def router_weight(spec) -> torch.Tensor:
    """The layer's seeded router weight [E, D] (on the host, float32)."""
    m = spec.model
    g = torch.Generator(device="cpu").manual_seed(spec.seed)
    return torch.randn(m.num_experts, m.hidden_size, generator=g, device="cpu") / m.hidden_size ** 0.5


def build_layer(ctx, spec, system=None, placement=None) -> MoELayer:
    """This rank's MoE layer of ``spec.model`` (seeded weights, its own experts only) for
    ``system`` (default ``spec.system``) on ``placement`` (default the system's)."""
    m = spec.model
    dtype = getattr(torch, m.dtype)
    config = system_config(spec.system if system is None else system).sized(spec.task.tokens_per_rank)
    dispatcher = config.build(ctx.ep, 0, m.num_experts, placement)
    router_ED = router_weight(spec)
    router = TopKRouter(router_ED.to(device=ctx.device, dtype=dtype), m.top_k, rule=gate_rule(m))
    experts = expert_weights(dispatcher.local_expert_ids, m.hidden_size, m.expert_ffn_size, spec.seed, dtype,
                             ctx.device)
    return MoELayer(router, experts, dispatcher, layer_idx=0)


def make_inputs(ctx, spec):
    """This rank's tokens, forced top-k ids (None for the router) and upstream gradient,
    drawn on the host from the seed and moved to the rank's device."""
    m, t = spec.model, spec.task
    g = torch.Generator(device="cpu").manual_seed(spec.seed * 1_000_003 + 104729 * (ctx.rank + 1))
    to = dict(device=ctx.device, dtype=getattr(torch, m.dtype))
    x_TD = torch.randn(t.tokens_per_rank, m.hidden_size, generator=g, device="cpu").to(**to)
    grad_TD = torch.randn(t.tokens_per_rank, m.hidden_size, generator=g, device="cpu").to(**to)
    ids_TK = None
    if t.routing in WORKLOADS:
        ids_TK = rank_workload(spec, ctx.rank, ctx.world_size, spec.seed).to(ctx.device)
    elif t.routing != "router":
        ids_TK = sample_topk(t.tokens_per_rank, m.top_k,
                             expert_popularity(t.routing, m.num_experts, t.zipf_s), g).to(ctx.device)
    return x_TD, ids_TK, grad_TD


def rank_workload(spec, rank: int, world_size: int, seed: int) -> torch.Tensor:
    """Rank ``rank``'s top-k ids [T, K] under a load workload (:mod:`occult.workloads`), on the host."""
    m, t = spec.model, spec.task
    return workload_topk(t.routing, rank, [t.tokens_per_rank] * world_size, m.top_k, m.num_experts, seed,
                         t.max_over_mean, t.incast_device, t.incast_share, t.trace)


def profiling_ids(spec, world_size: int) -> torch.Tensor:
    """The top-k ids [N, K] of a profiling set: every rank's routing of the run's workload
    drawn from seed + 1 (a trace: the trace itself; router routing: the layer's router on
    seeded tokens of seed + 1), computed alike in every process (no communication)."""
    m, t = spec.model, spec.task
    T, E = t.tokens_per_rank, m.num_experts
    if t.routing in WORKLOADS:
        ids_NK = torch.cat([rank_workload(spec, r, world_size, spec.seed + 1) for r in range(world_size)])
    elif t.routing == "router":
        g = torch.Generator(device="cpu").manual_seed(spec.seed + 1)
        x_ND = torch.randn(T * world_size, m.hidden_size, generator=g, device="cpu")
        router = TopKRouter(router_weight(spec), m.top_k, rule=gate_rule(m))
        with torch.no_grad():
            ids_NK = router.route(x_ND)[2]
    else:
        g = torch.Generator(device="cpu").manual_seed(spec.seed + 1)
        ids_NK = sample_topk(T * world_size, m.top_k, expert_popularity(t.routing, E, t.zipf_s), g)
    return ids_NK


def task_placement(ctx, spec):
    """The layer's placement from ``task.placement`` (None: the system's own): EPLB's slots
    from the pairs per expert of :func:`profiling_ids` (rank 0 writes the artifact to the run folder), or a slot
    artifact's first layer."""
    t = spec.task
    if t.placement == "contiguous":
        return None
    from ..placement.eplb import load_slot_placements, save_slot_placements
    if t.placement not in ("eplb", "eplb_affinity"):
        placements, _ = load_slot_placements(t.placement)
        return placements[min(placements)]
    ids_NK = profiling_ids(spec, ctx.world_size)
    load_E = torch.bincount(ids_NK.flatten(), minlength=spec.model.num_experts).double()
    placements, built_by = slot_placements_of(t, {0: ids_NK}, {0: load_E}, ctx, expert_groups(spec.model))
    if ctx.rank == 0:
        save_slot_placements(Path(spec.out_dir) / f"placement_{t.placement}.json", placements,
                             built_by, {"profiling": f"task.routing={t.routing}, seed {spec.seed + 1}, "
                                        f"{t.tokens_per_rank} tokens per rank",
                                        "load_E": load_E.tolist(), "num_redundant": t.num_redundant})
    return placements[0]


def expert_groups(m) -> int:
    """The model's expert groups (``model.n_group``: its router's group limit; 1: none):
    what EPLB packs onto nodes (:func:`occult.placement.eplb.eplb_rebalance`)."""
    return int(m.n_group)


def slot_placements_of(t, ids_by_layer: dict, load_by_layer: dict, ctx, num_groups: int = 1) -> tuple[dict, dict]:
    """``({layer: SlotPlacement}, built_by)`` for ``task.placement`` eplb (EPLB from the loads)
    or eplb_affinity (EPLB's counts packed with co-activation, ``task.affinity_weight``);
    ``num_groups``: the model's expert groups (:func:`expert_groups`)."""
    if t.placement == "eplb_affinity":
        from ..placement.affinity import affinity_placements, built_by_affinity
        E = next(iter(load_by_layer.values())).numel()
        return (affinity_placements(ids_by_layer, E, t.num_redundant, ctx.world_size, ctx.ep.devices_per_node,
                                    t.affinity_weight, num_groups), built_by_affinity(t.affinity_weight))
    from ..placement.eplb import built_by_eplb, eplb_placements
    return (eplb_placements(load_by_layer, t.num_redundant, ctx.world_size, ctx.ep.devices_per_node, num_groups),
            built_by_eplb())


def time_iteration(ctx, layer: MoELayer, x_TD, ids_TK, grad_TD, rec: Recorder, sample: int,
                   backward: bool) -> list:
    """One forward (and backward) of the layer on every rank, started together;
    returns the sample's rows: phase spans, collective times, layer times."""
    rec.clear()
    layer.zero_grad(set_to_none=True)
    x = x_TD.clone().requires_grad_(backward)
    barrier(ctx.ep)
    t0 = clock()
    out = layer(x, rec, ids_TK)
    t1 = clock()
    if backward:
        out.backward(grad_TD)
    t2 = clock()
    rows = timing_rows(rec, sample)
    rows.append(row("time", (t1 - t0) * 1e3, "ms", layer=0, rank=ctx.rank, phase="layer",
                    direction="forward", sample=sample))
    if backward:
        rows.append(row("time", (t2 - t1) * 1e3, "ms", layer=0, rank=ctx.rank, phase="layer",
                        direction="backward", sample=sample))
        rows.append(row("time", (t2 - t0) * 1e3, "ms", layer=0, rank=ctx.rank, phase="layer",
                        direction="forward+backward", sample=sample))
    return rows
