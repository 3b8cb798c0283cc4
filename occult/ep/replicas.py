"""Training on a placement with copies: a replicated expert's gradient is the sum over its
copies.

On a :class:`occult.ep.placement.SlotPlacement` each copy of an expert serves some of the
expert's pairs (its replica rule), so each copy's weight gradient is a partial sum; the
expert's gradient, and what every copy must step with, is the sum over its copies. One
all-reduce of the replicated experts' gradients (every rank adds its copies into a buffer
of those experts, zeros elsewhere) gives it to every copy; identical copies stepping with
identical gradients stay identical.

Shapes: S slots, e slots on this rank, U replicated experts, W = 3 D F weights per expert.
"""
from __future__ import annotations

import torch

from .measure import sum_over_ranks
from .placement import SlotPlacement


def replicated_experts(placement) -> torch.Tensor:
    """Logical experts with more than one copy (empty for a placement without copies): [U]."""
    if not isinstance(placement, SlotPlacement):
        return torch.zeros(0, dtype=torch.long, device="cpu")
    return (placement.copies_E() > 1).nonzero().flatten()


def sum_replica_gradients(experts, placement, ep) -> None:
    """Replaces the gradient of every local copy of a replicated expert by the sum over all
    of its copies (in place; a collective: call it on every rank of ``ep``, after backward).
    ``experts``: this rank's :class:`occult.ep.experts.GroupedExperts`, one row per local slot
    of ``placement``. Nothing to do for a placement without copies."""
    hot_U = replicated_experts(placement)
    if not hot_U.numel():
        return
    params = [experts.w_gate, experts.w_up, experts.w_down]
    local_e = placement.local_experts(ep.rank).to(hot_U.device)
    where_E = torch.full((placement.num_experts,), -1, dtype=torch.long, device=hot_U.device)
    where_E[hot_U] = torch.arange(hot_U.numel(), device=hot_U.device)
    row_e = where_E[local_e]                    # each local slot's row among the replicated experts
    mine = (row_e >= 0).nonzero().flatten()
    ref = params[0]
    grads_eW = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten(1) for p in params], 1)
    buf_UW = torch.zeros(hot_U.numel(), grads_eW.shape[1], dtype=ref.dtype, device=ref.device)
    buf_UW.index_add_(0, row_e[mine].to(ref.device), grads_eW[mine.to(ref.device)])
    sum_over_ranks(ep, buf_UW)
    summed_eW = grads_eW.clone()
    summed_eW[mine.to(ref.device)] = buf_UW[row_e[mine].to(ref.device)]
    offset = 0
    for p in params:
        n = p[0].numel() if p.shape[0] else p.numel()
        p.grad = summed_eW[:, offset:offset + n].reshape(p.shape).clone()
        offset += n
