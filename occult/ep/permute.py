"""Pure permutation helpers shared by dispatchers (no communication).

Shapes: T tokens, K top-k, P ranks, e local experts, R rows.
"""
from __future__ import annotations

from typing import Optional

import torch

from .placement import AnyPlacement, Placement, SlotPlacement  # noqa: F401 (types)


def sort_pairs_by_destination(topk_ids_TK: torch.Tensor, placement: AnyPlacement,
                              keep_TK: Optional[torch.Tensor] = None, home: int = 0
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Orders the (token, k) pairs by (destination device, local slot). ``placement``: a
    :class:`Placement`, or a :class:`SlotPlacement` (each pair to the copy its replica rule
    picks for the pairs of sending rank ``home``; e is then the slots per device).

    Returns ``order_R`` (indices into the flattened [T*K] pairs; ``order_R // K``
    is the token) and ``send_Pe``, the number of pairs for each destination
    device and local expert: shape [P, e]. Dropped pairs (id ``NO_EXPERT``) and, when
    ``keep_TK`` (bool) is given, the pairs it does not keep are left out of ``order_R``
    and of the counts.
    """
    P, e = placement.num_devices, placement.num_local
    device_TK, local_TK = placement.pair_local(topk_ids_TK, home_of(topk_ids_TK, home))
    key_R = (device_TK * e + local_TK).flatten()
    left_out_R = (topk_ids_TK < 0).flatten()
    if keep_TK is not None:
        left_out_R = left_out_R | ~keep_TK.flatten()
    key_R = torch.where(left_out_R, torch.full_like(key_R, P * e), key_R)     # left-out pairs sort last
    order_R = torch.argsort(key_R, stable=True)
    counts = torch.bincount(key_R, minlength=P * e + 1)
    send_Pe = counts[:P * e].view(P, e)
    return order_R[:key_R.numel() - int(counts[P * e])], send_Pe


def home_of(topk_ids_TK: torch.Tensor, rank: int) -> torch.Tensor:
    """Every token's sending rank, ``rank``: [T] (what a replica rule decides by)."""
    return torch.full((topk_ids_TK.shape[0],), rank, dtype=torch.long, device=topk_ids_TK.device)


def expert_major_order(recv_Pe: torch.Tensor) -> torch.Tensor:
    """Permutation taking received rows from (source, slot) order to (slot, source) order.

    ``recv_Pe[j, s]`` rows arrived from rank j for local expert s, in that
    order. Returns ``perm_R`` with ``rows[perm_R]`` grouped by local expert.
    """
    P, e = recv_Pe.shape
    slot_R = torch.arange(e, device=recv_Pe.device).repeat(P).repeat_interleave(recv_Pe.flatten())
    return torch.argsort(slot_R, stable=True)


def inverse_permutation(perm_R: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i``."""
    inv = torch.empty_like(perm_R)
    inv[perm_R] = torch.arange(perm_R.numel(), device=perm_R.device)
    return inv


def gather_rows(x_RD: torch.Tensor, index_Q: torch.Tensor) -> torch.Tensor:
    """``x_RD[index_Q]`` as ``index_select``: its backward is one ``index_add``
    (advanced indexing's backward, an accumulating ``index_put``, is much slower on CPU)."""
    return x_RD.index_select(0, index_Q)


def _scatter_add(num_rows: int, index_Q: torch.Tensor, src_QD: torch.Tensor) -> torch.Tensor:
    out = src_QD.new_zeros((num_rows,) + tuple(src_QD.shape[1:]))
    return out.index_add_(0, index_Q, src_QD)


class _ScatterAddRows(torch.autograd.Function):
    """Saves only the index for backward (autograd's own ``index_add`` keeps the source alive)."""

    @staticmethod
    def forward(ctx, src_QD, index_Q, num_rows):
        ctx.save_for_backward(index_Q)
        return _scatter_add(num_rows, index_Q, src_QD)

    @staticmethod
    def backward(ctx, grad_RD):
        (index_Q,) = ctx.saved_tensors
        return grad_RD.index_select(0, index_Q), None, None


def scatter_add_rows(num_rows: int, index_Q: torch.Tensor, src_QD: torch.Tensor) -> torch.Tensor:
    """``out[index_Q[q]] += src_QD[q]`` into fresh zeros: [Q, D] -> [num_rows, D]
    (in place on the zeros: one pass, no copy; backward keeps only the index)."""
    if src_QD.requires_grad:
        return _ScatterAddRows.apply(src_QD, index_Q, num_rows)
    return _scatter_add(num_rows, index_Q, src_QD)


class _WeightedScatterAdd(torch.autograd.Function):
    """out[index[q]] += weight[q] * src[q], with a backward that allocates one [Q, D]
    buffer (a gather) instead of three: on a CPU, fresh large buffers cost more than the
    arithmetic (page faults). ``kernel`` replaces the forward (a GPU kernel); the
    backward is the same."""

    @staticmethod
    def forward(ctx, src_QD, weight_Q, index_Q, num_rows, kernel):
        ctx.save_for_backward(src_QD, weight_Q, index_Q)
        if kernel is not None:
            return kernel(num_rows, index_Q, src_QD, weight_Q)
        return _scatter_add(num_rows, index_Q, src_QD * weight_Q.unsqueeze(1))

    @staticmethod
    def backward(ctx, grad_RD):
        src_QD, weight_Q, index_Q = ctx.saved_tensors
        g_QD = grad_RD.index_select(0, index_Q)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w = torch.bmm(g_QD.unsqueeze(1), src_QD.unsqueeze(2)).view(-1)   # row-wise dot
        grad_src = g_QD.mul_(weight_Q.unsqueeze(1)) if ctx.needs_input_grad[0] else None
        return grad_src, grad_w, None, None, None


def weighted_scatter_add(num_rows: int, index_Q: torch.Tensor, src_QD: torch.Tensor,
                         weight_Q: torch.Tensor, kernel=None) -> torch.Tensor:
    """``out[index_Q[q]] += weight_Q[q] * src_QD[q]`` into zeros: [Q, D] -> [num_rows, D].
    The gate-weighted sum every dispatcher's combine ends with (differentiable in both).
    ``kernel(num_rows, index_Q, src_QD, weight_Q)``, if given, computes the forward."""
    return _WeightedScatterAdd.apply(src_QD, weight_Q, index_Q, num_rows, kernel)
