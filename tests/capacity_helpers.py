"""Rank function for tests/test_baselines_capacity.py (importable by spawned ranks)."""
import torch
import torch.distributed as dist

from occult.ep import MoELayer, Placement, Recorder
from occult.parity import make_problem, run_grid
from occult.ep import system_config


def layer_call(ctx, cls_path: str, options: dict, case) -> dict:
    """One forward and backward of ``case`` on this rank, keeping the dispatcher's handle.

    Returns this rank's output and input gradient, the router gradient summed
    over ranks, the dispatcher's ``stats``, ``counts_e`` and the rows sent to
    each peer per (phase, direction).
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
            "rows": {(ev.phase, ev.direction): ev.rows_P for ev in rec.comm}}


def calls_and_grid(ctx, calls: list, grid: list) -> dict:
    """``layer_call`` for each ``(cls_path, options, case)`` of ``calls``, then
    :func:`occult.parity.run_grid` on ``grid``: one world for a whole test module."""
    return {"calls": [layer_call(ctx, *job) for job in calls], "grid": run_grid(ctx, grid)}
