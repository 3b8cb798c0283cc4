"""Rank functions for tests/test_lossy.py (importable by spawned ranks): each lossy
system against an independent single-device statement of what it computes, written
from the rule's definition (no code of the system's own: not its hyperplanes, its
bucket keys or its keep mask).

Shapes: T tokens of this rank, D hidden, E experts, K top-k, B hash bits.
"""
import torch

import torch.distributed as dist

from occult.ep import MoELayer, Placement, Recorder, ReferenceMoE, system_config
from occult.ep.router import TopKRouter
from occult.parity import LayerCase, make_problem


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def lsh_by_hand(x_TD, ids_TK, w_TK, experts, bits: int, seed: int, layer: int = 0):
    """LSH-MoE from its definition, one bucket at a time: B random hyperplanes per layer
    (standard normal [D, B], from a generator seeded ``seed * 7919 + layer`` on the host);
    two pairs of one expert share a bucket when their tokens fall on the same side of every
    hyperplane; each bucket's centroid c (the mean of its tokens) goes through the expert,
    and each pair gets f_e(c) plus its residual x_t - c (the error compensation), weighted
    and summed at home: out_t = sum_k w_tk (f_e(c) + x_t - c). bits = 0: every pair its
    own bucket, so c = x_t. [T, D]."""
    T, K = ids_TK.shape
    if bits:
        g = torch.Generator(device="cpu").manual_seed(seed * 7919 + layer)
        planes_DB = torch.randn(x_TD.shape[1], bits, generator=g, device="cpu").to(x_TD)
        side_TB = (x_TD @ planes_DB > 0).tolist()
    buckets: dict = {}
    for t in range(T):
        for k in range(K):
            key = (int(ids_TK[t, k]), tuple(side_TB[t])) if bits else (int(ids_TK[t, k]), t, k)
            buckets.setdefault(key, []).append((t, k))
    out_TD = torch.zeros_like(x_TD)
    for (expert, *_), pairs in buckets.items():
        c_D = torch.stack([x_TD[t] for t, _ in pairs]).mean(0)
        h_F = torch.nn.functional.silu(c_D @ experts["w_gate"][expert]) * (c_D @ experts["w_up"][expert])
        y_D = h_F @ experts["w_down"][expert]
        for t, k in pairs:
            out_TD[t] += w_TK[t, k] * (y_D + x_TD[t] - c_D)
    return out_TD


def luffy_by_hand(x_TD, ids_TK, w_TK, experts, threshold: float):
    """Luffy's condensation from its definition, one expert at a time: its pairs in token
    order (then k); each joins the first earlier leader whose token is identical to its own
    or has cosine similarity >= threshold with it, or leads a cluster of its own; the
    expert runs on each leader's token, and every pair of the cluster takes that output,
    weighted and summed at home: out_t = sum_k w_tk f_e(x_leader(t, k)). [T, D]."""
    T, K = ids_TK.shape
    out_TD = torch.zeros_like(x_TD)
    leaders: dict = {}
    for e in sorted(set(ids_TK.flatten().tolist())):
        for t in range(T):
            for k in range(K):
                if int(ids_TK[t, k]) != e:
                    continue
                x_D = x_TD[t]
                lead = next((s for s in leaders.setdefault(e, [])
                             if torch.equal(x_TD[s], x_D)
                             or (threshold < 1 and torch.cosine_similarity(x_TD[s], x_D, 0) >= threshold)), None)
                if lead is None:
                    leaders[e].append(t)
                    lead = t
                c_D = x_TD[lead]
                h_F = torch.nn.functional.silu(c_D @ experts["w_gate"][e]) * (c_D @ experts["w_up"][e])
                out_TD[t] += w_TK[t, k] * (h_F @ experts["w_down"][e])
    return out_TD


def adaptive_by_hand(ids_TK, w_TK, threshold: float):
    """AdapMoE's rule from its definition, token by token: the token's experts by
    decreasing gate weight (the lower slot first on a tie), taken until they hold at least
    1 - threshold of its top-k weight (always one); the rest dropped (id -1, weight 0),
    the kept ones with their own weights. ``(ids_TK, w_TK)``."""
    ids, w = ids_TK.clone(), w_TK.clone()
    for t in range(ids.shape[0]):
        weights = w_TK[t].tolist()
        target, held, kept = (1.0 - threshold) * sum(weights), 0.0, 0
        for k in sorted(range(len(weights)), key=lambda k: (-weights[k], k)):
            if kept and held >= target:
                ids[t, k], w[t, k] = -1, 0.0
                continue
            held, kept = held + weights[k], kept + 1
    return ids, w


def moe_by_hand(x_TD, ids_TK, w_TK, experts):
    """sum_k w_tk f_{e_tk}(x_t) over a token's kept pairs (id >= 0), one pair at a time. [T, D]."""
    out_TD = torch.zeros_like(x_TD)
    for t in range(ids_TK.shape[0]):
        for k in range(ids_TK.shape[1]):
            e = int(ids_TK[t, k])
            if e < 0:
                continue
            x_D = x_TD[t]
            h_F = torch.nn.functional.silu(x_D @ experts["w_gate"][e]) * (x_D @ experts["w_up"][e])
            out_TD[t] += w_TK[t, k] * (h_F @ experts["w_down"][e])
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
    """``[(kind, system dict, case), ...]``; kind ``lsh``, ``luffy`` or ``adaptive``: the system's
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
            elif kind == "luffy":
                want_TD = luffy_by_hand(x_TD, ids_TK, w_TK, prob.experts, cfg.threshold)
            else:
                want_TD = moe_by_hand(x_TD, *adaptive_by_hand(ids_TK, w_TK, cfg.threshold), prob.experts)
        kept = int((rec.routing[0][1] >= 0).sum())
        dispatch = [ev for ev in rec.comm if ev.phase == "dispatch" and ev.direction == "forward"]
        out.append({"err": _rel(y_TD.detach(), want_TD), "sent_rows": sum(sum(ev.rows_P) for ev in dispatch),
                    "kept_pairs": kept, "pairs": x_TD.shape[0] * case.top_k,
                    "grad_finite": bool(torch.isfinite(x_TD.grad).all()) and x_TD.grad.abs().sum().item() > 0})
    return out


def repeated_rows(tokens: tuple) -> torch.Tensor:
    """Each rank's tokens made to repeat: rank r's token j is its token j mod ceil(n_r / 2)
    (so every token but maybe one appears twice on its rank). The global row of each. [T]."""
    rows, lo = [], 0
    for n in tokens:
        rows.append(lo + torch.arange(n) % max((n + 1) // 2, 1))
        lo += n
    return torch.cat(rows)


def on_repeats(ctx, system: dict, case: LayerCase) -> dict:
    """``system`` on ``case``'s tokens made to repeat (:func:`repeated_rows`; the router routes,
    so a repeated token goes where its first copy goes) against the single-device reference,
    forward and backward (the case's random upstream gradient, a different one for each
    copy): relative errors of the output, the router's and this rank's experts' gradients,
    the input gradient per token and summed over the copies of each token; the rows the
    dispatch sent and the pairs."""
    placement = Placement.contiguous(case.num_experts, ctx.world_size).to(ctx.device)
    prob = make_problem(case, placement, ctx.device)
    row_T = repeated_rows(case.tokens).to(ctx.device)
    x_all = prob.x_TD[row_T]
    lo = sum(case.tokens[:ctx.rank])
    hi = lo + case.tokens[ctx.rank]
    ref = ReferenceMoE(prob.router_ED, prob.experts, case.top_k, rule=case.gate_rule)
    x_ref = x_all.clone().requires_grad_(True)
    out_ref = ref(x_ref, None)
    (out_ref * prob.grad_TD).sum().backward()

    dispatcher = system_config(system).build(ctx.ep, 0, case.num_experts, placement)
    layer = MoELayer.from_global(prob.router_ED, prob.experts, case.top_k, dispatcher, rule=case.gate_rule)
    x = x_all[lo:hi].clone().requires_grad_(True)
    rec = Recorder(rank=ctx.rank)
    out = layer(x, rec, None)
    (out * prob.grad_TD[lo:hi]).sum().backward()
    grad_router = layer.router.weight.grad.clone()
    dist.all_reduce(grad_router, group=ctx.ep.group)
    local = dispatcher.local_expert_ids
    copies = lambda g_TD: torch.zeros_like(g_TD).index_add_(0, row_T[lo:hi] - lo, g_TD)   # summed over copies
    dispatch = [ev for ev in rec.comm if ev.phase == "dispatch" and ev.direction == "forward"]
    return {"out": _rel(out.detach(), out_ref.detach()[lo:hi]),
            "grad_router": _rel(grad_router, ref.router.weight.grad),
            **{f"grad_{k}": _rel(getattr(layer.experts, k).grad, getattr(ref, k).grad[local])
               for k in ("w_gate", "w_up", "w_down")},
            "grad_x": _rel(x.grad, x_ref.grad[lo:hi]),
            "grad_x_over_copies": _rel(copies(x.grad), copies(x_ref.grad[lo:hi])),
            "sent_rows": sum(sum(ev.rows_P) for ev in dispatch), "pairs": (hi - lo) * case.top_k}


def lossy_world(ctx, grid_jobs: list, lossy_jobs: list, repeat_jobs: list = ()) -> tuple:
    """One world for all: :func:`occult.parity.run_grid`, :func:`lossy_checks` and
    :func:`on_repeats` (``[(system dict, case), ...]``)."""
    from occult.parity import run_grid
    return run_grid(ctx, grid_jobs), lossy_checks(ctx, lossy_jobs), [on_repeats(ctx, s, c) for s, c in repeat_jobs]
