"""system=occult: collaborative all-to-all, exact top-k MoE with one row per
(token, destination device).

Forward (Occult, Fig. 4):
  sender    route -> BRIM_0 -> ORI to SFD (one copy per destination device, with
            the gate weights of that device's local experts beside it)
  exchange  all-to-all of SFD rows (+ the local-expert masks)
  receiver  BRIM_1 -> SFD to EPD -> grouped experts (shared code) ->
            merge EPD to SFD: weight by the gate weights and sum the rows of
            the same token (intra-device pre-aggregation)
  exchange  all-to-all of the merged SFD rows back
  sender    SFD to ORI: sum each token's rows (by BRIM_0)

Autograd flows through the index operations; the backward all-to-alls
(:mod:`occult.ep.comm`) move the same deduplicated rows as the forward ones.

Shapes: T tokens, K top-k, D hidden, P ranks, e local experts, R SFD rows,
Q EPD rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..ep import Exchange, Recorder, SplitDispatcher, SystemConfig, all_to_all_rows, exchange_counts
from ..ep.accounting import span
from ..ep.permute import gather_rows, scatter_add_rows, weighted_scatter_add
from ..kernels import triton_available, use_triton
from .brim import Brim0, Brim1, build_brim0, build_brim1, local_expert_weights
from .experts import GatheredRows, occult_experts


@dataclass(frozen=True)
class OccultHandle:
    brim0: Brim0                 # sender side
    brim1: Brim1                 # receiver side
    weight_Q: torch.Tensor       # gate weight of each EPD row (received)
    send_P: list
    recv_P: list
    num_tokens: int
    layer: int
    recorder: Optional[Recorder]
    fused: bool = False          # Triton kernels for the expert matmul and the merge


KERNELS = ("auto", "torch", "triton")


class OccultDispatcher(SplitDispatcher):
    """``kernels``: ``torch`` (vectorised PyTorch, the reference path), ``triton`` (the
    gather-fused expert matmul and the atomic weighted merge; CUDA, or the Triton
    interpreter), or ``auto`` (triton on CUDA tensors when triton imports, else torch)."""

    impl = "harness"

    @dataclass
    class Config(SystemConfig):
        kernels: str = "auto"    # auto (Triton on CUDA when installed) | torch | triton

        def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
            super().check(num_experts=num_experts, top_k=top_k, world_size=world_size)
            if self.kernels not in KERNELS:
                raise ValueError(f"system.kernels={self.kernels!r}: allowed values are {list(KERNELS)}")
            if self.kernels == "triton" and not triton_available():
                raise ValueError("system.kernels=triton: the triton package is not installed "
                                 "(pip install -e '.[gpu]')")

    def _fused(self, x_TD) -> bool:
        kernels = self.config.kernels
        if kernels == "triton" and not use_triton(x_TD):
            raise ValueError("system.kernels=triton runs on CUDA tensors only (or under the Triton "
                             "interpreter, TRITON_INTERPRET=1); use kernels=auto or torch on a CPU")
        return kernels != "torch" and use_triton(x_TD)

    def run_experts(self, experts, routed_QD, counts_e):
        """Occult's own experts step (:func:`occult.collab.experts.occult_experts`)."""
        return occult_experts(experts, routed_QD, counts_e)

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK, *, layer=0, recorder=None):
        rec = recorder
        with span(rec, layer, "occult_index"):
            brim0 = build_brim0(topk_ids_TK, self.placement)
            w_Re, uses_Re = local_expert_weights(topk_ids_TK, topk_weights_TK, self.placement, brim0)
            # ORI -> SFD: one copy per destination device; beside it, per local expert of that
            # device, the gate weight and a use mask (1/0) in one small [R, 2e] tensor
            sfd_RD = gather_rows(x_TD, brim0.token_R)
            meta_RX = torch.cat([w_Re.to(x_TD.dtype), uses_Re.to(x_TD.dtype)], dim=1)
        # device-to-host sync: split sizes must be Python ints for the collective
        send_P = brim0.send_P.tolist()
        recv_P = exchange_counts(brim0.send_P.view(-1, 1), self.ep, Exchange(layer, "counts", rec)).flatten().tolist()
        recv_RD = all_to_all_rows(sfd_RD, send_P, recv_P, self.ep, Exchange(layer, "dispatch", rec))
        meta_recv_RX = all_to_all_rows(meta_RX, send_P, recv_P, self.ep, Exchange(layer, "dispatch_meta", rec))
        with span(rec, layer, "occult_index"):
            e = self.placement.num_local
            brim1 = build_brim1(meta_recv_RX[:, e:].detach() > 0.5)
            # SFD -> EPD: one row per (token, local expert), grouped by expert; the fused
            # path hands the experts the received rows and BRIM_1's row index instead
            fused = self._fused(x_TD)
            routed_QD = GatheredRows(recv_RD, brim1.row_Q) if fused else gather_rows(recv_RD, brim1.row_Q)
            weight_Q = meta_recv_RX[brim1.row_Q, brim1.slot_Q]
        handle = OccultHandle(brim0, brim1, weight_Q, send_P, recv_P, x_TD.shape[0], layer, rec, fused)
        return routed_QD, brim1.counts_e, handle

    def combine(self, y_QD, handle: OccultHandle):
        rec, layer = handle.recorder, handle.layer
        with span(rec, layer, "occult_merge"):
            # EPD -> SFD on the receiver: gate-weight and pre-aggregate rows of the same token
            kernel = None
            if handle.fused:
                from ..kernels.fused import triton_weighted_scatter_add as kernel
            merged_RD = weighted_scatter_add(sum(handle.recv_P), handle.brim1.row_Q, y_QD, handle.weight_Q,
                                             kernel)
        back_RD = all_to_all_rows(merged_RD, handle.recv_P, handle.send_P, self.ep,
                                  Exchange(layer, "combine", rec))
        with span(rec, layer, "occult_merge"):
            # SFD -> ORI at home: sum the copies of each token
            return scatter_add_rows(handle.num_tokens, handle.brim0.token_R, back_RD)
