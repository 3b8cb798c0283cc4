"""Pure permutation helpers shared by dispatchers (no communication).

Shapes: T tokens, K top-k, P ranks, e local experts, R rows.
"""
from __future__ import annotations

import torch

from .placement import Placement


def sort_pairs_by_destination(topk_ids_TK: torch.Tensor, placement: Placement
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Orders the (token, k) pairs by (destination device, local slot).

    Returns ``order_R`` (indices into the flattened [T*K] pairs; ``order_R // K``
    is the token) and ``send_Pe``, the number of pairs for each destination
    device and local expert: shape [P, e].
    """
    P, e = placement.num_devices, placement.num_local
    key_R = (placement.device_E[topk_ids_TK] * e + placement.slot_E[topk_ids_TK]).flatten()
    order_R = torch.argsort(key_R, stable=True)
    send_Pe = torch.bincount(key_R, minlength=P * e).view(P, e)
    return order_R, send_Pe


def expert_major_order(recv_Pe: torch.Tensor) -> torch.Tensor:
    """Permutation taking received rows from (source, slot) order to (slot, source) order.

    ``recv_Pe[j, s]`` rows arrived from rank j for local expert s, in that
    order. Returns ``perm_R`` with ``rows[perm_R]`` grouped by local expert.
    """
    P, e = recv_Pe.shape
    slot_R = torch.arange(e).repeat(P).repeat_interleave(recv_Pe.flatten())
    return torch.argsort(slot_R, stable=True)


def inverse_permutation(perm_R: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i``."""
    inv = torch.empty_like(perm_R)
    inv[perm_R] = torch.arange(perm_R.numel())
    return inv
