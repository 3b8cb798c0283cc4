"""Rank functions for tests/test_lossy.py (importable by spawned ranks): each lossy
system against an independent single-device statement of what it computes.

Shapes: T tokens of this rank, D hidden, E experts, K top-k, B hash bits.
"""
import torch

from baselines.adaptive_topk import AdaptiveTopK
from baselines.lsh import hyperplanes
from occult.ep import MoELayer, Placement, Recorder, system_config
from occult.ep.experts import swiglu
from occult.ep.layer import reference_moe
from occult.ep.router import TopKRouter
from occult.parity import LayerCase, make_problem


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def lsh_by_hand(x_TD, ids_TK, w_TK, experts, bits: int, seed: int):
    """LSH-MoE as its docstring states it, one (expert, hash code) bucket at a time:
    out_t = sum_k w_tk (f_e(c) + x_t - c), c the mean of the bucket's tokens; bits = 0:
    every pair its own bucket (c = x_t). [T, D]."""
    if bits == 0:
        return reference_moe(x_TD, ids_TK, w_TK, experts)
    planes_DB = hyperplanes(x_TD.shape[1], bits, 0, seed, x_TD.device, x_TD.dtype)
    code_T = ((x_TD @ planes_DB > 0).long() * (2 ** torch.arange(bits))).sum(1)
    out_TD = torch.zeros_like(x_TD)
    for expert in ids_TK.unique().tolist():
        for code in code_T.unique().tolist():
            tok, slot = torch.nonzero((ids_TK == expert) & (code_T == code).unsqueeze(1), as_tuple=True)
            if tok.numel() == 0:
                continue
            c_D = x_TD[tok].mean(0)
            y_D = swiglu(c_D[None], experts["w_gate"][expert], experts["w_up"][expert], experts["w_down"][expert])[0]
            for t, k in zip(tok.tolist(), slot.tolist()):
                out_TD[t] += w_TK[t, k] * (y_D + x_TD[t] - c_D)
    return out_TD


def _layer_and_inputs(ctx, system: dict, case: LayerCase):
    """The rank's layer for ``system``, its tokens, forced ids and the global problem."""
    placement = Placement.contiguous(case.num_experts, ctx.world_size).to(ctx.device)
    prob = make_problem(case, placement, ctx.device)
    lo = sum(case.tokens[:ctx.rank])
    hi = lo + case.tokens[ctx.rank]
    dispatcher = system_config(system).build(ctx.ep, 0, case.num_experts, placement)
    layer = MoELayer.from_global(prob.router_ED, prob.experts, case.top_k, dispatcher, case.renormalize)
    ids = None if prob.ids_TK is None else prob.ids_TK[lo:hi]
    return layer, prob.x_TD[lo:hi], ids, prob


def lossy_checks(ctx, jobs: list) -> list:
    """``[(kind, system dict, case), ...]``; kind ``lsh`` or ``adaptive``: the system's
    output against its statement by hand on this rank's tokens (relative error), the
    rows it sent, the pairs it had, and whether the input got a finite gradient."""
    out = []
    for kind, system, case in jobs:
        layer, x_TD, ids, prob = _layer_and_inputs(ctx, system, case)
        x_TD = x_TD.clone().requires_grad_(True)
        rec = Recorder(rank=ctx.rank)
        y_TD = layer(x_TD, rec, ids)
        y_TD.sum().backward()
        router = TopKRouter(prob.router_ED.clone(), case.top_k, case.renormalize)
        with torch.no_grad():
            probs_TE, ids_TK, w_TK = router(x_TD, ids)
            cfg = system_config(system)
            if kind == "lsh":
                want_TD = lsh_by_hand(x_TD, ids_TK, w_TK, prob.experts, cfg.bits, cfg.seed)
            else:
                kept_ids, kept_w = AdaptiveTopK(cfg.threshold)(probs_TE, ids_TK, w_TK, layer.dispatcher.placement)
                want_TD = reference_moe(x_TD, kept_ids, kept_w, prob.experts)
        kept = int((rec.routing[0][1] >= 0).sum())
        dispatch = [ev for ev in rec.comm if ev.phase == "dispatch" and ev.direction == "forward"]
        out.append({"err": _rel(y_TD.detach(), want_TD), "sent_rows": sum(sum(ev.rows_P) for ev in dispatch),
                    "kept_pairs": kept, "pairs": x_TD.shape[0] * case.top_k,
                    "grad_finite": bool(torch.isfinite(x_TD.grad).all()) and x_TD.grad.abs().sum().item() > 0})
    return out


def lossy_world(ctx, grid_jobs: list, lossy_jobs: list) -> tuple:
    """One world for both: :func:`occult.parity.run_grid` and :func:`lossy_checks`."""
    from occult.parity import run_grid
    return run_grid(ctx, grid_jobs), lossy_checks(ctx, lossy_jobs)
