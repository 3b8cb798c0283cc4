"""Occult's experts step: the shared grouped experts, or, on a GPU with Triton, a fused
kernel that reads each expert's rows straight from the received SFD buffer through
BRIM_1's row index, so that EPD is never materialised in the forward pass.

Shapes: R received SFD rows, Q EPD rows (grouped by local expert), D hidden, e local experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from ..ep.permute import gather_rows


@dataclass(frozen=True)
class GatheredRows:
    """The EPD rows ``source_RD[index_Q]``, not materialised: what Occult's dispatch hands
    its experts step on the fused path."""

    source_RD: torch.Tensor
    index_Q: torch.Tensor

    def materialize(self) -> torch.Tensor:
        return gather_rows(self.source_RD, self.index_Q)


def occult_experts(experts: nn.Module, routed, counts_e: torch.Tensor,
                   weight_Q: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rank's experts (:class:`occult.ep.GroupedExperts`) on Occult's EPD rows: [Q, D].
    ``routed`` is the EPD tensor (``weight_Q``: each row's gate weight, applied to its
    hidden row), or :class:`GatheredRows` (the fused path, unweighted: the Triton
    gather-fused grouped matmul when it can run on these tensors, else gathered first)."""
    if not isinstance(routed, GatheredRows):
        return experts(routed, counts_e, weight_Q)
    from ..kernels import use_triton
    if use_triton(routed.source_RD):
        from ..kernels.fused import gathered_swiglu
        return gathered_swiglu(routed.source_RD, routed.index_Q, counts_e, experts.w_gate, experts.w_up,
                               experts.w_down)
    return experts(routed.materialize(), counts_e)
