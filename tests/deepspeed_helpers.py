"""Rank functions for tests/test_deepspeed.py (importable by spawned ranks)."""
import torch

from occult.ep import MoELayer, Placement, Recorder, reference_moe, system_config
from occult.parity import make_problem, run_grid

DEEPSPEED = "baselines.deepspeed.DeepSpeedDispatcher"


def grid_and_version(ctx, jobs: list) -> dict:
    """:func:`occult.parity.run_grid` on ``jobs``, and the deepspeed version the ranks ran."""
    import deepspeed

    return {"grid": run_grid(ctx, jobs), "version": deepspeed.__version__}


def dropping_call(ctx, case, options: dict, keep_TK: list) -> dict:
    """One forward of ``case`` with a capacity that drops routes, on this rank.

    ``keep_TK`` (all ranks' tokens, [T, K] of 0/1) says by hand which routes fit;
    the output is compared with the reference MoE on the kept routes only.
    Returns the relative error, the recorder's counters and rows per peer.
    """
    placement = Placement.contiguous(case.num_experts, ctx.world_size)
    prob = make_problem(case, placement)
    lo = sum(case.tokens[:ctx.rank])
    hi = lo + case.tokens[ctx.rank]
    config = system_config({"name": "deepspeed", "_target_": DEEPSPEED, **options})
    layer = MoELayer.from_global(prob.router_ED, prob.experts, case.top_k,
                                 config.build(ctx.ep, 0, case.num_experts, placement))
    x_TD, ids_TK = prob.x_TD[lo:hi], prob.ids_TK[lo:hi]
    rec = Recorder(rank=ctx.rank)
    with torch.no_grad():
        out_TD = layer(x_TD, rec, ids_TK)
        _, _, w_TK = layer.router(x_TD, ids_TK)
        keep = torch.tensor(keep_TK, dtype=w_TK.dtype)[lo:hi]
        ref_TD = reference_moe(x_TD, ids_TK, w_TK * keep, prob.experts)
    err = ((out_TD - ref_TD).abs().max() / ref_TD.abs().max()).item()
    return {"error": err, "counters": {name: value for _, name, value in rec.counters},
            "rows": {(ev.phase, ev.direction): list(ev.rows_P) for ev in rec.comm}}
