"""Autograd wrappers around the Triton kernels: Triton forward, PyTorch backward.

The backward materialises the gathered rows once (it needs them for the weight
gradients); the forward never does.

Shapes: R source rows, Q grouped rows, D hidden, F expert FFN, e experts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as nnf


def _per_expert(counts_e: torch.Tensor, *tensors):
    """Splits each [Q, ...] tensor into the experts' segments."""
    sizes = counts_e.tolist()      # device-to-host sync
    return zip(*(torch.split(t, sizes) for t in tensors))


class _GatherGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, src_RD, w_eDN, index_Q, counts_e):
        from .triton_moe import gather_grouped_mm
        ctx.save_for_backward(src_RD, w_eDN, index_Q, counts_e)
        return gather_grouped_mm(src_RD, index_Q, counts_e, w_eDN)

    @staticmethod
    def backward(ctx, g_QN):
        src_RD, w_eDN, index_Q, counts_e = ctx.saved_tensors
        x_QD = src_RD.index_select(0, index_Q)
        grad_x, grad_w = [], torch.zeros_like(w_eDN)
        for i, (x_e, g_e) in enumerate(_per_expert(counts_e, x_QD, g_QN)):
            grad_x.append(g_e @ w_eDN[i].t())
            grad_w[i] = x_e.t() @ g_e
        grad_x_QD = torch.cat(grad_x) if grad_x else x_QD.new_zeros(x_QD.shape)
        grad_src = torch.zeros_like(src_RD).index_add_(0, index_Q, grad_x_QD)
        return grad_src, grad_w, None, None


def gathered_swiglu(source_RD: torch.Tensor, index_Q: torch.Tensor, counts_e: torch.Tensor,
                    w_gate_eDF: torch.Tensor, w_up_eDF: torch.Tensor, w_down_eFD: torch.Tensor) -> torch.Tensor:
    """Grouped SwiGLU on the rows ``source_RD[index_Q]``, read in place: -> [Q, D]."""
    h_gate = _GatherGroupedMM.apply(source_RD, w_gate_eDF, index_Q, counts_e)
    h_up = _GatherGroupedMM.apply(source_RD, w_up_eDF, index_Q, counts_e)
    h_QF = nnf.silu(h_gate) * h_up
    identity_Q = torch.arange(h_QF.shape[0], device=h_QF.device)
    return _GatherGroupedMM.apply(h_QF, w_down_eFD, identity_Q, counts_e)


def triton_weighted_scatter_add(num_rows, index_Q, y_QD, weight_Q):
    """The merge kernel, as a ``kernel`` for :func:`occult.ep.permute.weighted_scatter_add`."""
    from .triton_moe import weighted_scatter_add
    return weighted_scatter_add(num_rows, index_Q, y_QD, weight_Q)
