"""BRIM_0 and BRIM_1, the bidirectional re-index matrices of Occult.

Token states (Occult, Fig. 4):
  ORI  one row per token on its home device                      [T, D]
  SFD  one row per (token, destination device): the deduplicated  [R, D]
       send buffer (and, on the receiver, the received rows)
  EPD  one row per (token, expert) on the expert's device         [Q, D]

BRIM_0 [P, T]: for device p and ORI token t, the position of t's copy in the
SFD send buffer, or -1 when none of t's experts is on p. The buffer is ordered
by (device, token), so the rows for device p are contiguous.

BRIM_1 [e, R]: for local expert s and received SFD row r, the position of the
pair (r, s) in EPD order, or -1 when row r does not use expert s. EPD is
ordered by (local expert, row), so each expert's rows are contiguous.

Both are built with tensor operations only (no Python loop over tokens or rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ep import Placement


@dataclass(frozen=True)
class Brim0:
    """BRIM_0 and what is derived from it on the sending side."""

    index_PT: torch.Tensor      # SFD position of (device, token), or -1
    token_R: torch.Tensor       # ORI token of each SFD row (the inverse map)
    device_R: torch.Tensor      # destination device of each SFD row
    send_P: torch.Tensor        # SFD rows per destination device


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


def build_brim0(topk_ids_TK: torch.Tensor, placement: Placement) -> Brim0:
    """BRIM_0 from the top-k ids of this rank's tokens and the placement."""
    T, dev = topk_ids_TK.shape[0], topk_ids_TK.device
    P = placement.num_devices
    hit_PT = torch.zeros(P, T, dtype=torch.bool, device=dev)
    hit_PT[placement.device_E[topk_ids_TK], torch.arange(T, device=dev).unsqueeze(1)] = True
    index_PT = _positions(hit_PT)
    device_R, token_R = torch.nonzero(hit_PT, as_tuple=True)    # in SFD (device, token) order
    return Brim0(index_PT, token_R, device_R, hit_PT.sum(1))


def build_brim1(uses_Re: torch.Tensor) -> Brim1:
    """BRIM_1 from the received rows' local-expert masks ``uses_Re`` (bool [R, e])."""
    hit_eR = uses_Re.t()
    index_eR = _positions(hit_eR)
    slot_Q, row_Q = torch.nonzero(hit_eR, as_tuple=True)        # in EPD (expert, row) order
    return Brim1(index_eR, row_Q, slot_Q, hit_eR.sum(1))


def local_expert_weights(topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, placement: Placement,
                         brim0: Brim0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per SFD row, the gate weight of each local expert of its destination (0 where unused)
    and the mask of used local experts: ``(weights_Re, uses_Re)``. Differentiable in the weights."""
    T, K = topk_ids_TK.shape
    P, e = placement.num_devices, placement.num_local
    dev_TK, slot_TK = placement.device_E[topk_ids_TK], placement.slot_E[topk_ids_TK]
    tok_TK = torch.arange(T, device=topk_ids_TK.device).unsqueeze(1).expand(T, K)
    w_TPe = topk_weights_TK.new_zeros(T, P, e).index_put((tok_TK, dev_TK, slot_TK), topk_weights_TK)
    uses_TPe = torch.zeros(T, P, e, dtype=torch.bool, device=topk_ids_TK.device)
    uses_TPe[tok_TK, dev_TK, slot_TK] = True
    return w_TPe[brim0.token_R, brim0.device_R], uses_TPe[brim0.token_R, brim0.device_R]
