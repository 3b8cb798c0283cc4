"""Grouped SwiGLU experts, shared by every system.

Shapes: e local experts, D hidden, F expert FFN size, R rows grouped by expert.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as nnf
from torch import nn


def swiglu(x_RD: torch.Tensor, w_gate_DF: torch.Tensor, w_up_DF: torch.Tensor,
           w_down_FD: torch.Tensor, weight_R: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One expert: (silu(x W_g) * (x W_u)) W_d, [R, D] -> [R, D]; with ``weight_R`` each
    row's output is scaled by its weight (applied to the F-wide hidden row, before W_d)."""
    h_RF = nnf.silu(x_RD @ w_gate_DF) * (x_RD @ w_up_DF)
    if weight_R is not None:
        h_RF = h_RF * weight_R.unsqueeze(1)
    return h_RF @ w_down_FD


def grouped_swiglu(x_RD: torch.Tensor, counts_e: torch.Tensor, w_gate_eDF: torch.Tensor,
                   w_up_eDF: torch.Tensor, w_down_eFD: torch.Tensor,
                   weight_R: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Runs expert i on rows ``[sum(counts[:i]), sum(counts[:i+1]))``: [R, D] -> [R, D]
    (``weight_R`` [R]: each row's output scaled by its weight, see :func:`swiglu`)."""
    # device-to-host sync: the split sizes are needed on the host
    sizes = counts_e.tolist()
    pieces = torch.split(x_RD, sizes)
    weights = torch.split(weight_R, sizes) if weight_R is not None else [None] * len(sizes)
    # unbind, not w[i]: its backward stacks the e gradients once, where indexing would
    # allocate and add a full [e, D, F] gradient per expert
    outs = [swiglu(xi, wg, wu, wd, ri) for xi, wg, wu, wd, ri in
            zip(pieces, w_gate_eDF.unbind(0), w_up_eDF.unbind(0), w_down_eFD.unbind(0), weights)]
    if not outs:
        return x_RD.new_zeros(x_RD.shape)
    return torch.cat(outs, dim=0)


class GroupedExperts(nn.Module):
    """The experts a rank holds: fused [e, D, F] / [e, F, D] weights."""

    def __init__(self, w_gate_eDF: torch.Tensor, w_up_eDF: torch.Tensor, w_down_eFD: torch.Tensor):
        super().__init__()
        self.w_gate = nn.Parameter(w_gate_eDF)
        self.w_up = nn.Parameter(w_up_eDF)
        self.w_down = nn.Parameter(w_down_eFD)

    def forward(self, x_RD: torch.Tensor, counts_e: torch.Tensor,
                weight_R: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Expert i on rows ``[sum(counts_e[:i]), sum(counts_e[:i+1]))``: [R, D] -> [R, D]
        (``weight_R``: each row's output scaled by its weight)."""
        return grouped_swiglu(x_RD, counts_e, self.w_gate, self.w_up, self.w_down, weight_R)


def init_expert_weights(num_experts: int, hidden: int, ffn: int, generator: torch.Generator,
                        dtype: torch.dtype = torch.float32) -> dict:
    """Seeded global expert weights: {'w_gate': [E,D,F], 'w_up': [E,D,F], 'w_down': [E,F,D]}."""
    def rnd(*shape, fan_in):
        return (torch.randn(*shape, generator=generator, device=generator.device) / fan_in ** 0.5).to(dtype)
    return {"w_gate": rnd(num_experts, hidden, ffn, fan_in=hidden),
            "w_up": rnd(num_experts, hidden, ffn, fan_in=hidden),
            "w_down": rnd(num_experts, ffn, hidden, fan_in=ffn)}


def expert_rows(experts: GroupedExperts) -> torch.Tensor:
    """The experts' weights as rows, one per expert: [e, W] with W = 3 D F (gate, up and down
    flattened), for systems that move weights instead of tokens."""
    return torch.cat([experts.w_gate.flatten(1), experts.w_up.flatten(1), experts.w_down.flatten(1)], dim=1)


def weights_of_rows(rows_UW: torch.Tensor, hidden: int, ffn: int) -> tuple:
    """The inverse of :func:`expert_rows`: [U, 3 D F] -> (w_gate [U, D, F], w_up [U, D, F],
    w_down [U, F, D])."""
    U, n = rows_UW.shape[0], hidden * ffn
    return (rows_UW[:, :n].view(U, hidden, ffn), rows_UW[:, n:2 * n].view(U, hidden, ffn),
            rows_UW[:, 2 * n:].view(U, ffn, hidden))
