"""Occult's static-shape path (``system.dispatch_mode=static``, :mod:`occult.ep.static`).

A token has at most one SFD row per destination device, so the send buffer to each device
has one slot per token: ``M = max_tokens_per_rank`` slots, slot t holding token t's D
values and, after them, the gate weights of that device's e local experts (-1 for one it
does not use; a row whose weights are all -1 is padding: the valid mark is in the row).
No BRIM_0 to build, no counts collective, no host read:

  sender    the [M, P, e] weights table from the (token, k) pairs (one scatter), each
            token's row copied to every destination's slot t
  exchange  one equal-split all-to-all of [P M, D + e]
  receiver  every local expert on every received row, weighted by its gate weight (0 for
            an expert the row does not use): two GEMMs, [N, D] x [D, e F] and
            [N, e F] x [e F, D], whose second one is the merge (intra-device
            pre-aggregation); no BRIM_1, no EPD gather
  exchange  the merged rows back, [P M, D]
  sender    the sum over the P slots of each token (padding rows are zeros)

Its index work is the sender's scatter and copy and the sender's sum (spans
``occult_index`` and ``occult_merge``, as on the dynamic path).

Shapes: T tokens (at most M), K top-k, D hidden, P ranks, e local experts, N = P M.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..ep import Exchange, Recorder
from ..ep.accounting import span
from ..ep.comm import all_to_all_fixed
from ..ep.payload import wire_row_bytes
from ..ep.permute import home_of
from ..ep.plan import returned, sends
from ..ep.static import StaticDispatch, slot_swiglu


@dataclass(frozen=True)
class StaticSFDHandle:
    weight_eN: torch.Tensor      # gate weight of each local expert for each received row (0: unused)
    send_valid_R: torch.Tensor   # which rows this rank sent were valid (the token uses the device)
    recv_valid_R: torch.Tensor   # which rows it received were valid
    num_tokens: int
    layer: int
    recorder: Optional[Recorder]


def weights_table(topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, placement, M: int,
                  rank: int = 0) -> torch.Tensor:
    """Per destination device, token slot and local expert, the pair's gate weight, -1 where
    the token does not use that expert: [P, M, e] (differentiable in the weights; a dropped
    pair, id -1, writes nowhere); on a slot placement, the copies the replica rule picks for
    tokens sent by ``rank``."""
    T, K = topk_ids_TK.shape
    P, e = placement.num_devices, placement.num_local
    keep_TK = topk_ids_TK >= 0
    dev_TK, slot_TK = placement.pair_local(topk_ids_TK, home_of(topk_ids_TK, rank))
    tok_T1 = torch.arange(T, device=topk_ids_TK.device).unsqueeze(1)
    at_TK = torch.where(keep_TK, (dev_TK * M + tok_T1) * e + slot_TK, torch.full_like(dev_TK, P * M * e))
    w_X = topk_weights_TK.new_full((P * M * e + 1,), -1.0)
    return w_X.index_put((at_TK.flatten(),), topk_weights_TK.flatten())[:P * M * e].view(P, M, e)


class StaticSFD(StaticDispatch):
    """Occult's static path (the module docstring)."""

    def static_dispatch(self, x_TD, topk_ids_TK, topk_weights_TK, M, *, layer, recorder):
        rec = recorder
        P, e = self.placement.num_devices, self.placement.num_local
        T, D = x_TD.shape
        with span(rec, layer, "occult_index"):
            w_PMe = weights_table(topk_ids_TK, topk_weights_TK.to(x_TD.dtype), self.placement, M, self.ep.rank)
            x_MD = torch.cat([x_TD, x_TD.new_zeros(M - T, D)]) if M > T else x_TD
            send_RX = torch.cat([x_MD.unsqueeze(0).expand(P, M, D), w_PMe], 2).reshape(P * M, D + e)
        marks = lambda rows: (rows[:, D:].detach() >= 0).any(1)
        recv_RX = all_to_all_fixed(send_RX, marks, self.ep, Exchange(layer, "dispatch", rec, meta_cols=e),
                                   valid_back=marks)
        with span(rec, layer, "occult_index"):
            x_ND, w_Ne = recv_RX[:, :D], recv_RX[:, D:]
            weight_eN = torch.where(w_Ne >= 0, w_Ne, torch.zeros_like(w_Ne)).t()
        return x_ND, StaticSFDHandle(weight_eN, marks(send_RX), marks(recv_RX), T, layer, rec)

    def static_experts(self, experts, x_ND, handle: StaticSFDHandle):
        return slot_swiglu(x_ND, experts.w_gate, experts.w_up, experts.w_down, handle.weight_eN)

    def static_combine(self, merged_ND, handle: StaticSFDHandle):
        rec, layer = handle.recorder, handle.layer
        back_ND = all_to_all_fixed(merged_ND, handle.recv_valid_R, self.ep, Exchange(layer, "combine", rec),
                                   valid_back=handle.send_valid_R)
        with span(rec, layer, "occult_merge"):
            P = self.placement.num_devices
            return back_ND.view(P, -1, back_ND.shape[1]).sum(0)[:handle.num_tokens]

    def static_plan(self, topk_ids_TK, *, rank, shape):
        P, e = self.placement.num_devices, self.placement.num_local
        M = self.config.max_tokens_per_rank
        d_bytes, d_meta = wire_row_bytes("fp32", shape.hidden, e, shape.element_bytes)
        c_bytes, _ = wire_row_bytes("fp32", shape.hidden, 0, shape.element_bytes)
        return [sends("dispatch", rank, [M] * P, d_bytes, meta_row_bytes=d_meta), returned("combine", 1, c_bytes)]
