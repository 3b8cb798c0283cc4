"""BRIM_0 and BRIM_1, the bidirectional re-index matrices of Occult.

Token states (Occult, Fig. 4):
  ORI  one row per token on its home device                      [T, D]
  SFD  one row per (token, destination device): the deduplicated  [R, D]
       send buffer (and, on the receiver, the received rows)
  EPD  one row per (token, expert) on the expert's device         [Q, D]

BRIM_0 [P, T]: for device p and ORI token t, the position of t's copy in the
SFD send buffer, or -1 when none of t's experts is on p. The buffer is ordered
by (device, token), so the rows for device p are contiguous. It is built, and
kept, sparse: the SFD row of each (token, k) pair (``row_TK``) and the inverse
map (``token_R``, ``device_R``), O(T K) at any P; ``Brim0.index_PT`` is the dense map.

BRIM_1 [e, R]: for local expert s and received SFD row r, the position of the
pair (r, s) in EPD order, or -1 when row r does not use expert s. EPD is
ordered by (local expert, row), so each expert's rows are contiguous.

Each SFD row travels with the gate weights of its destination's e local experts
(:func:`local_expert_weights`; -1 for an expert the row does not use), appended to the
row's D values: one all-to-all carries both, and the receiver reads BRIM_1's mask from
the weights (:func:`uses_of`).

Both are built with tensor operations only (no Python loop over tokens or rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ep import Placement
from ..ep.permute import home_of


@dataclass(frozen=True)
class Brim0:
    """BRIM_0 and what is derived from it on the sending side, built from the (token,
    expert) pairs alone (no dense [P, T] tensor: O(T K), whatever the world size)."""

    token_R: torch.Tensor       # ORI token of each SFD row (the inverse map)
    device_R: torch.Tensor      # destination device of each SFD row
    send_P: torch.Tensor        # SFD rows per destination device
    row_TK: torch.Tensor        # SFD row of each (token, k) pair, -1 for a dropped pair
    num_tokens: int
    local_TK: torch.Tensor      # local slot (on its destination) of each (token, k) pair

    @property
    def index_PT(self) -> torch.Tensor:
        """BRIM_0 itself [P, T]: the SFD position of (device, token), or -1 (a dense map, for
        reading; the dispatch uses its sparse parts)."""
        P, T = self.send_P.numel(), self.num_tokens
        index_PT = torch.full((P, T), -1, dtype=torch.long, device=self.token_R.device)
        index_PT[self.device_R, self.token_R] = torch.arange(self.token_R.numel(), device=self.token_R.device)
        return index_PT


@dataclass(frozen=True)
class Brim1:
    """BRIM_1 and what is derived from it on the receiving side."""

    index_eR: torch.Tensor      # EPD position of (local expert, received row), or -1
    row_Q: torch.Tensor         # received SFD row of each EPD row (the inverse map)
    slot_Q: torch.Tensor        # local expert of each EPD row
    counts_e: torch.Tensor      # EPD rows per local expert


def _positions(hit_AB: torch.Tensor) -> torch.Tensor:
    """Row-major rank of every True entry, -1 elsewhere: the index map of a mask."""
    pos = torch.cumsum(hit_AB.flatten().long(), 0).view(hit_AB.shape) - 1
    return torch.where(hit_AB, pos, torch.full_like(pos, -1))


def build_brim0(topk_ids_TK: torch.Tensor, placement: Placement, home: int = 0) -> Brim0:
    """BRIM_0 from the top-k ids of this rank's tokens and the placement: the distinct
    (device, token) keys of the pairs, in (device, token) order, are the SFD rows (dropped
    pairs, id -1, make none). This is also Occult's traffic plan: ``send_P``. On a slot
    placement (copies) a pair's device and slot are those of the copy its replica rule picks
    for the sending rank ``home``; BRIM_1 and the SFD rows' e weights are then per slot."""
    T, K = topk_ids_TK.shape
    keep_TK = topk_ids_TK >= 0
    tok_TK = torch.arange(T, device=topk_ids_TK.device).unsqueeze(1).expand(T, K)
    device_TK, local_TK = placement.pair_local(topk_ids_TK, home_of(topk_ids_TK, home))
    key_Q = device_TK[keep_TK] * T + tok_TK[keep_TK]
    keys_R, row_Q = torch.unique(key_Q, sorted=True, return_inverse=True)
    row_TK = torch.full_like(topk_ids_TK, -1)
    row_TK[keep_TK] = row_Q
    device_R = keys_R // max(T, 1)
    return Brim0(keys_R % max(T, 1), device_R, torch.bincount(device_R, minlength=placement.num_devices), row_TK, T,
                 local_TK)


def build_brim1(uses_Re: torch.Tensor) -> Brim1:
    """BRIM_1 from the received rows' local-expert masks ``uses_Re`` (bool [R, e])."""
    hit_eR = uses_Re.t()
    index_eR = _positions(hit_eR)
    slot_Q, row_Q = torch.nonzero(hit_eR, as_tuple=True)        # in EPD (expert, row) order
    return Brim1(index_eR, row_Q, slot_Q, hit_eR.sum(1))


# the gate-weight slot of a local expert that an SFD row does not use (gate weights are >= 0)
UNUSED = -1.0


def local_expert_weights(topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, placement: Placement,
                         brim0: Brim0) -> torch.Tensor:
    """Per SFD row, the gate weight of each local expert of its destination, and
    :data:`UNUSED` (-1) where the row does not use that expert: ``weights_Re`` [R, e], in
    the weights' dtype, differentiable in the weights. Built from the (token, k) pairs
    through BRIM_0 (no dense [T, P, e] tensor)."""
    keep_TK = topk_ids_TK >= 0                                   # dropped pairs (id -1) are not sent
    row_Q = brim0.row_TK[keep_TK]                                # each pair's SFD row
    w_Re = topk_weights_TK.new_full((brim0.token_R.numel(), placement.num_local), UNUSED)
    return w_Re.index_put((row_Q, brim0.local_TK[keep_TK]), topk_weights_TK[keep_TK])


def uses_of(weights_Re: torch.Tensor) -> torch.Tensor:
    """Which local experts each received SFD row uses (bool [R, e]), from its weights."""
    return weights_Re.detach() >= 0
