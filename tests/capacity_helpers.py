"""The hand-computed capacity case and the rank functions of tests/test_baselines_capacity.py
and tests/test_tutel.py (importable by spawned ranks)."""
import torch
import torch.distributed as dist

from occult.ep import MoELayer, Placement, Recorder, TopKRouter, reference_moe, system_config
from occult.parity import LayerCase, make_problem, run_grid

P, E, K = 2, 4, 2    # e = 2: experts 0, 1 on rank 0 and 2, 3 on rank 1
RANK0 = ((0, 1), (0, 2), (1, 0), (0, 3), (2, 0), (3, 2), (1, 3), (2, 1))
RANK1 = ((0, 1), (2, 0), (0, 3))
HAND = LayerCase(E, K, (8, 3), routing="explicit", explicit_ids=sum(RANK0 + RANK1, ()), hidden=16)
# cf = 0.5: C = K * int(0.5 * ceil(8 / 4)) = 2 slots per (rank, expert) (T = the larger
# rank's 8 tokens). Tutel's priority: every first choice (k=0) in token order, then
# every second choice. Queues on rank 0 (token, k):
#   expert 0: (0,0) (1,0) (3,0) (2,1) (4,1)  -> drops (3,0) (2,1) (4,1)
#   expert 1: (2,0) (6,0) (0,1) (7,1)        -> drops (0,1) (7,1)
#   expert 2: (4,0) (7,0) (1,1) (5,1)        -> drops (1,1) (5,1)
#   expert 3: (5,0) (3,1) (6,1)              -> drops (6,1)
# rank 1, expert 0: (0,0) (2,0) (1,1)         -> drops (1,1) (token order would drop (2,0))
DROPPED = {0: {(3, 0), (2, 1), (4, 1), (0, 1), (7, 1), (1, 1), (5, 1), (6, 1)}, 1: {(1, 1)}}
KEPT = {0: 16 - 8, 1: 6 - 1}


def rel(a, b):
    """max |a - b| / max |b| (0 for empty tensors)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() if b.numel() else 0.0


def expected(dropped: dict):
    """The reference MoE on the whole HAND problem with the dropped pairs' gate weights zeroed:
    output, input gradient and router gradient."""
    prob = make_problem(HAND, Placement.contiguous(E, P))
    router = TopKRouter(prob.router_ED.clone(), K, HAND.renormalize)
    x_TD = prob.x_TD.clone().requires_grad_(True)
    _, ids_TK, w_TK = router(x_TD, prob.ids_TK)
    keep_TK = torch.ones_like(w_TK)
    for rank, pairs in dropped.items():
        lo = sum(HAND.tokens[:rank])
        for t, k in pairs:
            keep_TK[lo + t, k] = 0.0
    out_TD = reference_moe(x_TD, ids_TK, w_TK * keep_TK, prob.experts)
    (out_TD * prob.grad_TD).sum().backward()
    return out_TD.detach(), x_TD.grad, router.weight.grad


def layer_call(ctx, cls_path: str, options: dict, case) -> dict:
    """One forward and backward of ``case`` on this rank, keeping the dispatcher's handle.

    Returns this rank's output and input gradient, the router gradient summed
    over ranks, the dispatcher's ``stats``, ``counts_e``, the rows sent to each
    peer per (phase, direction) and every logged collective (phase, direction,
    rows per peer, bytes per row).
    """
    placement = Placement.contiguous(case.num_experts, ctx.world_size)
    prob = make_problem(case, placement)
    lo = sum(case.tokens[:ctx.rank])
    hi = lo + case.tokens[ctx.rank]
    dispatcher = system_config({"name": cls_path.rsplit('.', 1)[-1], "_target_": cls_path, **options}).build(
        ctx.ep, 0, case.num_experts, placement)
    layer = MoELayer.from_global(prob.router_ED, prob.experts, case.top_k, dispatcher, case.renormalize)
    x_TD = prob.x_TD[lo:hi].clone().requires_grad_(True)
    rec = Recorder(rank=ctx.rank)
    _, ids_TK, w_TK = layer.router(x_TD, None if prob.ids_TK is None else prob.ids_TK[lo:hi])
    routed_RD, counts_e, handle = dispatcher.dispatch(x_TD, ids_TK, w_TK, layer=0, recorder=rec)
    out_TD = dispatcher.combine(layer.experts(routed_RD, counts_e), handle)
    (out_TD * prob.grad_TD[lo:hi]).sum().backward()
    grad_router = layer.router.weight.grad.clone()
    if ctx.world_size > 1:
        dist.all_reduce(grad_router, group=ctx.ep.group)
    return {"out": out_TD.detach(), "grad_x": x_TD.grad, "grad_router": grad_router,
            "stats": dispatcher.stats(handle), "counts_e": counts_e.tolist(),
            "rows": {(ev.phase, ev.direction): ev.rows_P for ev in rec.comm},
            "comm": [(ev.phase, ev.direction, ev.rows_P, ev.row_bytes) for ev in rec.comm]}


def calls_and_grid(ctx, calls: list, grid: list) -> dict:
    """``layer_call`` for each ``(cls_path, options, case)`` of ``calls``, then
    :func:`occult.parity.run_grid` on ``grid``: one world for a whole test module."""
    return {"calls": [layer_call(ctx, *job) for job in calls], "grid": run_grid(ctx, grid)}
