"""The experts step and the gate-weighted merge in one, over rows read through an index.

A dispatch whose receiver holds one row per (token, destination device) and carries several of
a token's experts in it (Occult's SFD rows, hierarchical EP's per-device rows) runs each local
expert on the rows that use it and must sum the outputs of a row's experts, each scaled by its
gate weight, back into that row. Done as three steps that is a [Q, D] gather (EPD), the grouped
experts on it and a [Q, D] weighted scatter-add: two large fresh buffers per call, which on a
CPU cost more than the arithmetic (page faults). :func:`merged_swiglu` does it one expert and
one cache-sized tile of its rows at a time, straight into the [R, D] merged rows, with a
backward that does the same; :data:`FUSE_FROM_BYTES` is the EPD size from which it wins.

Shapes: R rows held (one per token and device), Q (row, local expert) pairs grouped by local
expert, D hidden, F expert FFN size, e local experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as nnf
from torch import nn

from .permute import gather_rows

# the EPD size [Q, D] in bytes above which the merged step beats materialising EPD on a CPU
# (its per-expert gathers and adds replace large fresh buffers: 1.4-3x faster from 4 MiB,
# measured alone on one thread of this project's 2-core CPU machine); below it the loop's
# extra per-expert operations can cost more than the buffer (1.35x slower at a 2 MiB,
# 128-wide EPD, e.g. a proxy model's prefill)
FUSE_FROM_BYTES = 2 << 20


def epd_exceeds(pairs: int, x_RD: torch.Tensor) -> bool:
    """Whether ``pairs`` rows of ``x_RD`` gathered ([Q, D], EPD) would exceed
    :data:`FUSE_FROM_BYTES`: where the merged step beats materialising them on a CPU."""
    return pairs * x_RD.shape[1] * x_RD.element_size() > FUSE_FROM_BYTES


@dataclass(frozen=True)
class GatheredRows:
    """The EPD rows ``source_RD[index_Q]``, not materialised: what a dispatch hands an
    experts step that reads its rows through the index (:func:`merged_swiglu`, a fused
    kernel)."""

    source_RD: torch.Tensor
    index_Q: torch.Tensor

    def materialize(self) -> torch.Tensor:
        return gather_rows(self.source_RD, self.index_Q)


def _segments(sizes: list):
    """(local expert, slice of its EPD rows) for each expert, in EPD order."""
    start = 0
    for s, n in enumerate(sizes):
        yield s, slice(start, start + n)
        start += n


# the rows of an expert go through the fused step in tiles of about this many bytes of
# gathered input, so that a tile stays in cache between the products that read it and the
# scatter that reads their output (2 MiB of L2 per core on this project's CPU machine):
# one expert's forward at D = 2048, F = 16 took 0.73x the time untiled (256-row tiles; the
# same at F = 1024) alone on one thread, the comm-bound bench layer's experts step 0.85x
TILE_BYTES = 2 << 20


def _tiles(seg: slice, rows: int):
    """``seg`` cut into consecutive slices of nearly equal size, ``rows`` to 2 ``rows`` rows
    each (one slice when it is shorter): no short tail tile, whose products would read
    the expert's weights for a few rows."""
    n = seg.stop - seg.start
    k = max(1, n // rows) if n else 0
    for i in range(k):
        yield slice(seg.start + i * n // k, seg.start + (i + 1) * n // k)


def _tile_rows(source_RD: torch.Tensor) -> int:
    """Rows per tile: :data:`TILE_BYTES` of ``source_RD``'s rows, at least one; on a GPU
    (no cache to stay in, and a launch per product) an expert's rows are one tile."""
    if source_RD.device.type not in ("cpu", "meta"):
        return max(1, source_RD.shape[0])
    return max(1, TILE_BYTES // max(1, source_RD.shape[1] * source_RD.element_size()))


class _MergedSwiGLU(torch.autograd.Function):
    """out_RD[row_Q[q]] += weight_Q[q] * expert_{slot(q)}(source_RD[row_Q[q]]), one expert
    and one tile of its rows at a time. Saves the source, the index, the weights and the
    two [Q, F] pre-activations; the backward gathers each tile's rows and output gradients
    again and adds its input gradients straight into one [R, D] buffer."""

    @staticmethod
    def forward(ctx, source_RD, weight_Q, row_Q, sizes, w_gate_eDF, w_up_eDF, w_down_eFD):
        Q, F = row_Q.numel(), w_gate_eDF.shape[2]
        out_RD = source_RD.new_zeros(source_RD.shape)
        gate_QF, up_QF = source_RD.new_empty(Q, F), source_RD.new_empty(Q, F)
        rows = _tile_rows(source_RD)
        for s, seg in _segments(sizes):
            for t in _tiles(seg, rows):
                idx_n = row_Q[t]
                x_nD = source_RD.index_select(0, idx_n)
                torch.mm(x_nD, w_gate_eDF[s], out=gate_QF[t])
                torch.mm(x_nD, w_up_eDF[s], out=up_QF[t])
                h_nF = nnf.silu(gate_QF[t]).mul_(up_QF[t]).mul_(weight_Q[t].unsqueeze(1))
                out_RD.index_add_(0, idx_n, h_nF @ w_down_eFD[s])
        ctx.sizes = sizes
        ctx.save_for_backward(source_RD, weight_Q, row_Q, w_gate_eDF, w_up_eDF, w_down_eFD, gate_QF, up_QF)
        return out_RD

    @staticmethod
    def backward(ctx, grad_RD):
        source_RD, weight_Q, row_Q, w_gate, w_up, w_down, gate_QF, up_QF = ctx.saved_tensors
        need_x, need_w, _, _, need_wg, need_wu, need_wd = ctx.needs_input_grad
        _, D, F = w_gate.shape
        grad_src = torch.zeros_like(source_RD) if need_x else None
        grad_weight = torch.empty_like(weight_Q) if need_w else None
        grad_wg = torch.empty_like(w_gate) if need_wg else None
        grad_wu = torch.empty_like(w_up) if need_wu else None
        grad_wd = torch.empty_like(w_down) if need_wd else None
        rows = _tile_rows(source_RD)
        for s, seg in _segments(ctx.sizes):
            if seg.stop == seg.start:                                  # an expert without rows
                for grad in (grad_wg, grad_wu, grad_wd):
                    if grad is not None:
                        grad[s].zero_()
                continue
            # the gate's and the up projection's weight gradients side by side, [D, 2F]: one
            # product per tile with its gathered rows gives both (0.8x the backward's time of
            # two products, alone on one thread at D = 2048, F = 16)
            gw_D2F = source_RD.new_empty(D, 2 * F) if (need_wg or need_wu) else None
            for j, t in enumerate(_tiles(seg, rows)):
                beta = 1 if j else 0                                   # the first tile overwrites
                idx_n = row_Q[t]
                gy_nD = grad_RD.index_select(0, idx_n)
                g_nF, u_nF, w_n1 = gate_QF[t], up_QF[t], weight_Q[t].unsqueeze(1)
                sig_nF = torch.sigmoid(g_nF)
                a_nF = g_nF * sig_nF                                   # silu(gate)
                h0_nF = a_nF * u_nF                                    # the unweighted hidden row
                if need_wd:
                    grad_wd[s].addmm_((h0_nF * w_n1).t(), gy_nD, beta=beta)
                gh_nF = gy_nD @ w_down[s].t()
                if need_w:
                    grad_weight[t] = (gh_nF * h0_nF).sum(1)
                gh_nF.mul_(w_n1)
                gb_n2F = gh_nF.new_empty(gh_nF.shape[0], 2 * F)
                gg_nF, gu_nF = gb_n2F[:, :F], gb_n2F[:, F:]
                torch.mul(gh_nF, a_nF, out=gu_nF)
                torch.mul(gh_nF.mul_(u_nF), sig_nF * (1 + g_nF * (1 - sig_nF)), out=gg_nF)   # silu'(gate)
                if gw_D2F is not None:
                    gw_D2F.addmm_(source_RD.index_select(0, idx_n).t(), gb_n2F, beta=beta)
                if need_x:
                    gx_nD = gg_nF @ w_gate[s].t()
                    grad_src.index_add_(0, idx_n, gx_nD.addmm_(gu_nF, w_up[s].t()))
            if gw_D2F is not None:
                if need_wg:
                    grad_wg[s] = gw_D2F[:, :F]
                if need_wu:
                    grad_wu[s] = gw_D2F[:, F:]
        return grad_src, grad_weight, None, None, grad_wg, grad_wu, grad_wd


def merged_swiglu(experts: nn.Module, rows: GatheredRows, counts_e: torch.Tensor,
                  weight_Q: torch.Tensor) -> torch.Tensor:
    """The experts step and the merge in one: for each EPD row q,
    ``weight_Q[q] * expert(rows.source_RD[rows.index_Q[q]])`` summed into its row of
    ``rows.source_RD``: [R, D] -> [R, D], differentiable in the rows, the weights and the
    experts (:class:`occult.ep.GroupedExperts`' weights)."""
    sizes = counts_e.tolist()            # device-to-host sync: the experts' segment sizes
    return _MergedSwiGLU.apply(rows.source_RD, weight_Q, rows.index_Q, sizes, experts.w_gate, experts.w_up,
                               experts.w_down)
