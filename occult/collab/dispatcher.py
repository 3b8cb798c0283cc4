"""system=occult: collaborative all-to-all, exact top-k MoE with one row per
(token, destination device).

Forward (Occult, Fig. 4):
  sender    route -> BRIM_0 -> ORI to SFD (one copy per destination device; after
            its D values, the gate weights of that device's e local experts, -1 for
            one it does not use)
  exchange  one all-to-all of SFD rows [R, D + e] (the split sizes come from the
            counts exchange that every variable-split system makes first)
  receiver  BRIM_1 from the weights -> SFD to EPD -> grouped experts, each row's
            gate weight scaling its expert's hidden row -> merge EPD to SFD: sum
            the rows of the same token (intra-device pre-aggregation); on the
            default paths the gather and the merge are fused into the experts step
            (:mod:`occult.collab.experts`), so that EPD never exists at full size
  exchange  all-to-all of the merged SFD rows back [R, D]
  sender    SFD to ORI: sum each token's rows (by BRIM_0)

So Occult makes as many collectives per layer as naive EP, forward (counts,
dispatch, combine) and backward (dispatch, combine); its dispatch rows carry e
metadata values, logged as such (``meta_bytes``), which the cost model keeps at
their size when it re-sizes hidden rows to a real model's width. Autograd flows
through the index operations; the backward all-to-alls (:mod:`occult.ep.comm`)
move the same deduplicated rows as the forward ones.

Shapes: T tokens, K top-k, D hidden, P ranks, e local experts, R SFD rows,
Q EPD rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..ep import Exchange, Recorder, SplitDispatcher, all_to_all_rows, exchange_counts
from ..ep.payload import wire_row_bytes
from ..ep.plan import metadata_sends, returned, sends
from ..ep.static import StaticConfig, runs_static
from ..ep.system import PayloadConfig, ReplicaConfig
from ..ep.accounting import span
from ..ep.permute import gather_rows, scatter_add_rows, weighted_scatter_add
from ..ep.merged import GatheredRows, epd_exceeds, merged_swiglu
from ..kernels import TRITON_DTYPES, triton_available, triton_takes, use_triton
from .brim import Brim0, Brim1, build_brim0, build_brim1, local_expert_weights, uses_of
from .experts import occult_experts
from .static import StaticSFD
from ..ep.capabilities import Capabilities
from ..ep.payload import PAYLOADS
from ..ep.replica_rules import REPLICA_POLICIES


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
    kernels: str                 # the path this call took: torch | epd | triton


KERNELS = ("auto", "torch", "epd", "triton")


@dataclass
class OccultOptions(StaticConfig, PayloadConfig):
    """Occult's own options (its kernels, payloads and dispatch mode); the variants of
    :mod:`occult.collab.variants`, which run on one copy per expert, take these alone."""

    # auto (Triton on CUDA when installed, for all but float64; else by size) | torch | epd | triton
    kernels: str = "auto"

    def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
        super().check(num_experts=num_experts, top_k=top_k, world_size=world_size)
        if self.kernels not in KERNELS:
            raise ValueError(f"system.kernels={self.kernels!r}: allowed values are {list(KERNELS)}")
        if self.kernels == "triton" and not triton_available():
            raise ValueError("system.kernels=triton: the triton package is not installed "
                             "(pip install -e '.[gpu]')")
        if self.is_static() and self.kernels != "auto":
            raise ValueError(f"system.kernels={self.kernels!r}: dispatch_mode=static has one experts step of "
                             "its own (every local expert on every slot); allowed value with it: auto")

    def other_exact_paths(self) -> list:
        # the PyTorch path this config does not take on small problems such as the parity
        # suite's (auto takes epd there); triton's kernels are checked under the
        # interpreter (make test-triton) and on a GPU
        if self.is_static():
            return super().other_exact_paths()
        return super().other_exact_paths() + [{"kernels": "epd" if self.kernels == "torch" else "torch"}]


class OccultDispatcher(StaticSFD, SplitDispatcher):
    """``kernels`` (:mod:`occult.collab.experts`): ``torch`` (PyTorch, one local expert at
    a time: its rows gathered from the received buffer, its outputs added into the merged
    rows), ``epd`` (PyTorch, EPD materialised, then the merge: the token states one by
    one), ``triton`` (the gather-fused expert matmul and the atomic weighted merge; CUDA,
    or the Triton interpreter; float16, bfloat16 or float32 rows), or ``auto`` (triton on
    CUDA tensors of those dtypes when triton imports, else torch for a large EPD, epd for a
    small one: :data:`occult.ep.merged.FUSE_FROM_BYTES`).
    ``dispatch_mode=static``: one slot per token per destination device in fixed buffers, no
    counts exchange, no host read (:mod:`occult.collab.static`)."""

    capabilities = Capabilities(
        impl="harness", precision="float64", expert_parallel=True, exact_forward=True, exact_backward=True,
        static_dispatch=True,
        co_execution=True,
        yields=True,
        traffic_plan=True,
        migration=True,
        replica_rules=REPLICA_POLICIES, payloads=PAYLOADS, dropped_pairs=True,
        shortcut_overlap=False)

    @dataclass
    class Config(ReplicaConfig, OccultOptions):
        """Occult's options and its replica rule on a slot placement (copies)."""

    def _kernels(self, x_TD, epd_rows: int) -> str:
        """The path this call takes: torch | epd | triton (``auto``: triton where it runs,
        else torch once EPD would exceed :data:`occult.ep.merged.FUSE_FROM_BYTES`, else epd)."""
        kernels = self.config.kernels
        if kernels == "triton" and not use_triton(x_TD):
            raise ValueError("system.kernels=triton runs on CUDA tensors only (or under the Triton "
                             "interpreter, TRITON_INTERPRET=1); use kernels=auto, torch or epd on a CPU")
        if kernels == "triton" and not triton_takes(x_TD.dtype):
            raise ValueError(f"system.kernels=triton: the Triton kernels take {', '.join(TRITON_DTYPES)} "
                             f"rows, not {str(x_TD.dtype).removeprefix('torch.')} (tl.dot has none); use "
                             f"kernels=auto (the PyTorch path for such rows), torch or epd")
        if kernels == "auto":
            if use_triton(x_TD) and triton_takes(x_TD.dtype):
                return "triton"
            return "torch" if epd_exceeds(epd_rows, x_TD) else "epd"
        return kernels

    def run_experts(self, experts, routed_QD, counts_e, handle: "OccultHandle"):
        """Occult's own experts step (:mod:`occult.collab.experts`); each EPD row's gate
        weight scales its expert's F-wide hidden row. The torch path returns the merged
        SFD rows [R, D]; epd and triton return the EPD outputs [Q, D] (triton unweighted:
        its merge kernel weights them)."""
        if handle.kernels == "torch":
            return merged_swiglu(experts, routed_QD, counts_e, handle.weight_Q)
        return occult_experts(experts, routed_QD, counts_e, handle.weight_Q if handle.kernels == "epd" else None)

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK, *, layer=0, recorder=None):
        rec = recorder
        D, e = x_TD.shape[1], self.placement.num_local
        with span(rec, layer, "occult_index"):
            brim0 = build_brim0(topk_ids_TK, self.placement, self.ep.rank)
            w_Re = local_expert_weights(topk_ids_TK, topk_weights_TK.to(x_TD.dtype), self.placement, brim0)
            # ORI -> SFD: one copy per destination device, and after its D values the gate
            # weights of that device's e local experts (-1: not used): one row, one all-to-all
            sfd_RX = pack_rows(x_TD, brim0.token_R, w_Re)
        # device-to-host sync: split sizes must be Python ints for the collective
        send_P = brim0.send_P.tolist()
        recv_P = exchange_counts(brim0.send_P.view(-1, 1), self.ep, Exchange(layer, "counts", rec)).flatten().tolist()
        recv_RX = all_to_all_rows(sfd_RX, send_P, recv_P, self.ep, Exchange(layer, "dispatch", rec, meta_cols=e),
                                  self.config.payload_of("dispatch"))
        with span(rec, layer, "occult_index"):
            recv_RD, w_recv_Re = split_columns(recv_RX, D)
            brim1 = build_brim1(uses_of(w_recv_Re))
            # SFD -> EPD: one row per (token, local expert), grouped by expert; the torch and
            # triton paths hand the experts the received rows and BRIM_1's row index instead
            kernels = self._kernels(x_TD, brim1.row_Q.numel())
            routed_QD = (gather_rows(recv_RD, brim1.row_Q) if kernels == "epd"
                         else GatheredRows(recv_RD, brim1.row_Q))
            weight_Q = w_recv_Re[brim1.row_Q, brim1.slot_Q]
        handle = OccultHandle(brim0, brim1, weight_Q, send_P, recv_P, x_TD.shape[0], layer, rec, kernels)
        return routed_QD, brim1.counts_e, handle

    def plan(self, topk_ids_TK, topk_weights_TK, *, rank, shape, facts_PX=None, training=True):
        """``counts`` (one int64 per rank), ``dispatch`` (BRIM_0's SFD rows, each with its e
        gate weights) and ``combine`` (the dispatch returned, the merged rows)."""
        if runs_static(self.config):
            return self.static_plan(topk_ids_TK, rank=rank, shape=shape)
        P, e = self.ep.world_size, self.placement.num_local
        send_P = build_brim0(topk_ids_TK, self.placement, rank).send_P
        d_bytes, d_meta = wire_row_bytes(self.config.payload_of("dispatch"), shape.hidden, e, shape.element_bytes)
        c_bytes, c_meta = wire_row_bytes(self.config.payload_of("combine"), shape.hidden, 0, shape.element_bytes)
        return [metadata_sends("counts", rank, [1] * P, send_P.element_size()),
                sends("dispatch", rank, send_P, d_bytes, meta_row_bytes=d_meta),
                returned("combine", 1, c_bytes, meta_row_bytes=c_meta)]

    def combine(self, y_QD, handle: OccultHandle):
        rec, layer = handle.recorder, handle.layer
        R = sum(handle.recv_P)
        with span(rec, layer, "occult_merge"):
            # EPD -> SFD on the receiver: the rows of the same token summed (intra-device
            # pre-aggregation); gate weights were applied in the experts step, or here by
            # the triton path's kernel; the torch path merged in its experts step
            if handle.kernels == "torch":
                merged_RD = y_QD
            elif handle.kernels == "triton":
                from ..kernels.fused import triton_weighted_scatter_add
                merged_RD = weighted_scatter_add(R, handle.brim1.row_Q, y_QD, handle.weight_Q,
                                                 triton_weighted_scatter_add)
            else:
                merged_RD = scatter_add_rows(R, handle.brim1.row_Q, y_QD)
        back_RD = all_to_all_rows(merged_RD, handle.recv_P, handle.send_P, self.ep,
                                  Exchange(layer, "combine", rec), self.config.payload_of("combine"))
        with span(rec, layer, "occult_merge"):
            # SFD -> ORI at home: sum the copies of each token
            return scatter_add_rows(handle.num_tokens, handle.brim0.token_R, back_RD)


class _PackRows(torch.autograd.Function):
    """The SFD send buffer, with a backward that adds the gradient rows into one [T, D + X]
    buffer and hands back its tokens' columns (autograd's cat, gather and in-place metadata
    write would also clone the whole [R, D + X] gradient)."""

    @staticmethod
    def forward(ctx, x_TD, token_R, meta_RX):
        T, D = x_TD.shape
        wide_TDX = torch.cat([x_TD, x_TD.new_zeros(T, meta_RX.shape[1])], dim=1)
        out_RDX = gather_rows(wide_TDX, token_R)      # one gather of the widened tokens
        out_RDX[:, D:] = meta_RX
        ctx.save_for_backward(token_R)
        ctx.shape_TD = (T, D)
        return out_RDX

    @staticmethod
    def backward(ctx, grad_RDX):
        (token_R,) = ctx.saved_tensors
        T, D = ctx.shape_TD
        grad_x = grad_meta = None
        if ctx.needs_input_grad[0]:
            # the whole rows added, then the tokens' columns copied out (a contiguous
            # gradient for the layers below): an index_add_ from the strided [R, D] columns
            # took 7x as long as from the contiguous rows (alone, on a CPU)
            wide_TDX = grad_RDX.new_zeros(T, grad_RDX.shape[1])
            grad_x = wide_TDX.index_add_(0, token_R, grad_RDX.contiguous())[:, :D].contiguous()
        if ctx.needs_input_grad[2]:
            grad_meta = grad_RDX[:, D:]
        return grad_x, None, grad_meta


def pack_rows(x_TD: torch.Tensor, token_R: torch.Tensor, meta_RX: torch.Tensor) -> torch.Tensor:
    """The SFD send buffer: row r is ``x_TD[token_R[r]]`` followed by ``meta_RX[r]``:
    [T, D], [R], [R, X] -> [R, D + X], differentiable in both."""
    return _PackRows.apply(x_TD, token_R, meta_RX)


class _SplitColumns(torch.autograd.Function):
    """[R, D + X] -> views ([R, D], [R, X]), with a backward that writes both gradients into
    one [R, D + X] buffer (autograd's two slices would each make a zero-filled full-size
    gradient, then add them). An unused output's gradient arrives as zeros (autograd
    materialises it)."""

    @staticmethod
    def forward(ctx, rows_RDX, D):
        ctx.D = D
        return rows_RDX[:, :D], rows_RDX[:, D:]

    @staticmethod
    def backward(ctx, grad_RD, grad_RX):
        D = ctx.D
        out_RDX = grad_RD.new_empty(grad_RD.shape[0], D + grad_RX.shape[1])
        out_RDX[:, :D] = grad_RD
        out_RDX[:, D:] = grad_RX
        return out_RDX, None


def split_columns(rows_RDX: torch.Tensor, D: int) -> tuple:
    """The received SFD rows and their metadata: [R, D + X] -> ([R, D], [R, X])."""
    return _SplitColumns.apply(rows_RDX, D)
