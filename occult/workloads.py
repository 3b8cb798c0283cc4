"""Routing workloads that stress load: every system of a run sees the same routing, drawn
for every rank of the world from the run's seed (any process can draw any rank's), top-k
always without replacement.

* ``imbalance`` (``max_over_mean``): a seeded skew of expert popularity, Zipf over a seeded
  order of the experts whose head is the experts that the contiguous placement puts on one
  seeded device, its exponent tuned (bisection, the same noise at every step) until the
  dispatch's received rows, max / mean over ranks under the contiguous placement, equal the
  target within 2 %. Reachable: 1 to min(K, E/P) x P / K (every pair of a token on the hot
  device; :func:`largest_max_over_mean`).
* ``incast`` (``incast_device``, ``incast_share``): of every token's K choices, ``share`` x K
  (rounded per token at random, so the share holds on average) are drawn uniformly from the
  experts that the contiguous placement puts on ``device``, the rest uniformly from the others.
* ``trace`` (:func:`trace_routing`): a saved routing trace (``routing.parquet`` of a run
  with ``task.save_routing=true``) replayed: its first layer's tokens in rank order, rank r
  taking tokens [r T, (r + 1) T).

Shapes: T tokens per rank, E experts, K top-k, P ranks, e = E / P.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

import torch

IMBALANCE_TOLERANCE = 0.02
MAX_OVER_MEAN_CAP = 4.0


def workload_generator(seed: int, rank: int) -> torch.Generator:
    """The generator of rank ``rank``'s routing in these workloads (on the host)."""
    return torch.Generator(device="cpu").manual_seed(seed * 7_000_003 + 15_485_863 * (rank + 1) + 17)


def largest_max_over_mean(num_experts: int, top_k: int, world_size: int) -> float:
    """The most received rows max / mean that top-k without replacement allows under the
    contiguous placement: every token's pairs on one device, min(K, e) of K."""
    e = num_experts // world_size
    return min(top_k, e) * world_size / top_k


def max_over_mean_error(target: float, num_experts: int, top_k: int, world_size: int) -> str:
    """Why ``task.max_over_mean`` cannot be reached here (one line), or ""."""
    top = min(MAX_OVER_MEAN_CAP, largest_max_over_mean(num_experts, top_k, world_size))
    if target < 1.0 or target > top:
        return (f"task.max_over_mean={target}: allowed values are 1.0 to {top:g} here (the largest reachable "
                f"with E={num_experts}, K={top_k}, P={world_size} is min(K, E/P) x P / K = "
                f"{largest_max_over_mean(num_experts, top_k, world_size):g}, capped at {MAX_OVER_MEAN_CAP:g})")
    return ""


def imbalance_order(num_experts: int, world_size: int, seed: int) -> torch.Tensor:
    """Experts from most to least popular: the hot device's (seeded) experts first, then the
    others, each part in a seeded order: [E]."""
    g = torch.Generator(device="cpu").manual_seed(seed * 31 + 5)
    e = num_experts // world_size
    hot = int(torch.randint(world_size, (1,), generator=g, device="cpu"))
    perm_E = torch.randperm(num_experts, generator=g, device="cpu")
    on_hot_E = perm_E // e == hot
    return torch.cat([perm_E[on_hot_E], perm_E[~on_hot_E]])


def zipf_popularity(order_E: torch.Tensor, s: float) -> torch.Tensor:
    """Popularity [E] (float64): the expert at position r of ``order_E`` weighted (r + 1)^-s."""
    w_E = torch.empty(order_E.numel(), dtype=torch.float64, device="cpu")
    w_E[order_E] = 1.0 / torch.arange(1, order_E.numel() + 1, dtype=torch.float64, device="cpu") ** s
    return w_E / w_E.sum()


def _gumbel(num_tokens: int, num_experts: int, g: torch.Generator) -> torch.Tensor:
    u_TE = torch.rand(num_tokens, num_experts, generator=g, dtype=torch.float64, device="cpu").clamp_min(1e-300)
    return -torch.log(-torch.log(u_TE))


def received_max_over_mean(ids_NK: torch.Tensor, num_experts: int, world_size: int) -> float:
    """Dispatch received rows (one per pair) max / mean over devices under the contiguous
    placement, for every rank's tokens ``ids_NK``."""
    recv_P = torch.bincount((ids_NK // (num_experts // world_size)).flatten(), minlength=world_size).double()
    return float(recv_P.max() / recv_P.mean()) if recv_P.sum() else 1.0


def imbalance_routing(tokens_P: list, top_k: int, num_experts: int, target: float, seed: int
                      ) -> tuple[list, float, float]:
    """Every rank's top-k ids under the imbalance workload: ``([ids_TK per rank], exponent,
    achieved max / mean)``. Raises ``ValueError`` (one line) when the target is out of reach."""
    P = len(tokens_P)
    err = max_over_mean_error(target, num_experts, top_k, P)
    if err:
        raise ValueError(err)
    order_E = imbalance_order(num_experts, P, seed)
    noise_NE = torch.cat([_gumbel(T, num_experts, workload_generator(seed, r)) for r, T in enumerate(tokens_P)])

    def draw(s: float) -> torch.Tensor:
        return torch.topk(zipf_popularity(order_E, s).log().unsqueeze(0) + noise_NE, top_k, dim=1).indices

    def ratio(s: float) -> float:
        return received_max_over_mean(draw(s), num_experts, P)

    lo, hi = 0.0, 1.0
    while ratio(hi) < target and hi < 512:
        lo, hi = hi, hi * 2
    for _ in range(60):
        if abs(ratio(lo) / target - 1) <= IMBALANCE_TOLERANCE / 2:
            break
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ratio(mid) < target else (lo, mid)
    best = min((lo, hi), key=lambda s: abs(ratio(s) / target - 1))
    got = ratio(best)
    if abs(got / target - 1) > IMBALANCE_TOLERANCE:
        raise ValueError(f"task.max_over_mean={target}: the closest this workload reaches with "
                         f"{sum(tokens_P)} tokens is {got:.4f} (more tokens per rank, or another target)")
    ids_NK = draw(best)
    cuts = torch.tensor([0] + list(tokens_P)).cumsum(0).tolist()
    return [ids_NK[cuts[r]:cuts[r + 1]] for r in range(P)], best, got


def incast_error(device: int, share: float, num_experts: int, top_k: int, world_size: int) -> str:
    """Why the incast workload cannot run (one line), or ""."""
    e = num_experts // world_size
    if not 0 <= device < world_size:
        return f"task.incast_device={device}: allowed values are 0 to {world_size - 1} (the world's ranks)"
    if not 0.0 <= share <= 1.0:
        return f"task.incast_share={share}: allowed values are 0.0 to 1.0 (the share of every token's choices)"
    most = -(-share * top_k // 1)
    if most > e or top_k - int(share * top_k) > num_experts - e:
        return (f"task.incast_share={share}: {share} x K={top_k} choices on device {device}'s {e} experts "
                f"(and the rest on the other {num_experts - e}) do not fit")
    return ""


def incast_topk(num_tokens: int, top_k: int, num_experts: int, world_size: int, device: int, share: float,
                g: torch.Generator) -> torch.Tensor:
    """One rank's top-k ids under the incast workload: [T, K] (long), distinct per token."""
    e = num_experts // world_size
    n_in_T = int(share * top_k) + (torch.rand(num_tokens, generator=g, dtype=torch.float64, device="cpu")
                                   < share * top_k - int(share * top_k)).long()
    inside_E = (torch.arange(num_experts, device="cpu") // e) == device
    ins_e, outs_o = inside_E.nonzero().flatten(), (~inside_E).nonzero().flatten()
    rank_in_Te = torch.argsort(_gumbel(num_tokens, e, g), dim=1, descending=True)[:, :top_k]
    rank_out_To = torch.argsort(_gumbel(num_tokens, outs_o.numel(), g), dim=1, descending=True)[:, :top_k]
    cand_TC = torch.cat([ins_e[rank_in_Te], outs_o[rank_out_To]], dim=1)
    col_in = torch.arange(rank_in_Te.shape[1], device="cpu").unsqueeze(0)
    col_out = torch.arange(rank_out_To.shape[1], device="cpu").unsqueeze(0)
    keep_TC = torch.cat([col_in < n_in_T.unsqueeze(1), col_out < (top_k - n_in_T).unsqueeze(1)], dim=1)
    return cand_TC[keep_TC].view(num_tokens, top_k)


def trace_file(path) -> Path:
    """The ``routing.parquet`` that ``task.trace`` names (the file, or a run folder holding it)."""
    p = Path(path)
    return p / "routing.parquet" if p.is_dir() else p


def trace_sha256(path) -> str:
    """sha256 of the trace file (the ``trace_sha256`` column)."""
    return hashlib.sha256(trace_file(path).read_bytes()).hexdigest()


def trace_routing_ids(path) -> torch.Tensor:
    """The trace's first layer: every token's top-k ids in rank order, [N, K]."""
    from .routing_traces import trace_topk
    import pandas as pd

    df = pd.read_parquet(trace_file(path))
    return trace_topk(df, int(df.layer.min()))[0]


def trace_error(path, num_experts: int, top_k: int, tokens_per_rank: int, world_size: int) -> str:
    """Why the trace does not fit the run (one line naming ``task.trace``), or ""."""
    if not path:
        return "task.trace is not set: task.routing=trace needs a routing.parquet (or a run folder holding one)"
    f = trace_file(path)
    if not f.is_file():
        return f"task.trace={str(path)!r}: no routing trace there ({f} is not a file)"
    ids_NK = trace_routing_ids(path)
    need = tokens_per_rank * world_size
    if ids_NK.shape[1] != top_k or int(ids_NK.max()) >= num_experts or ids_NK.shape[0] < need:
        return (f"task.trace={str(path)!r}: its shape (tokens {ids_NK.shape[0]}, top-k {ids_NK.shape[1]}, "
                f"experts up to {int(ids_NK.max()) + 1}) does not match the run (tokens {need} = "
                f"task.tokens_per_rank x P, model.top_k {top_k}, model.num_experts {num_experts})")
    return ""


def workload_topk(kind: str, rank: int, tokens_P: list, top_k: int, num_experts: int, seed: int,
                  max_over_mean: float = 2.0, incast_device: int = 0, incast_share: float = 0.5,
                  trace: Optional[str] = None) -> torch.Tensor:
    """Rank ``rank``'s top-k ids [T, K] under the workload ``kind`` for a world whose ranks
    have ``tokens_P`` tokens (on the host)."""
    P = len(tokens_P)
    if kind == "imbalance":
        return imbalance_routing(tokens_P, top_k, num_experts, max_over_mean, seed)[0][rank]
    if kind == "incast":
        return incast_topk(tokens_P[rank], top_k, num_experts, P, incast_device, incast_share,
                           workload_generator(seed, rank))
    if kind == "trace":
        lo = sum(tokens_P[:rank])
        return trace_routing_ids(trace)[lo:lo + tokens_P[rank]].clone()
    raise ValueError(f"routing workload {kind!r}: allowed values are imbalance, incast, trace")


WORKLOADS = ("imbalance", "incast", "trace")
