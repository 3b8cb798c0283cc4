"""Occult's experts step, on the received SFD rows and BRIM_1's row index.

Three paths (``system.kernels``):
  torch   per local expert: gather its rows from the received SFD buffer, run the
          SwiGLU, weight, and add the outputs straight into the merged SFD rows
          (:func:`occult.ep.merged.merged_swiglu`, in the core: hierarchical EP runs it
          too). Neither EPD nor the experts' [Q, D] outputs exist at full size, only one
          expert's rows at a time (a custom backward does the same).
  epd     the token states one by one: EPD materialised (a [Q, D] gather), the shared
          grouped experts, then the merge as a scatter-add (the dispatcher's combine).
  triton  on a GPU: a kernel that reads each expert's rows through BRIM_1's row index
          (:func:`occult.kernels.fused.gathered_swiglu`) and a merge kernel.

Shapes: R received SFD rows, Q EPD rows (grouped by local expert), D hidden, F expert
FFN size, e local experts.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..ep.merged import GatheredRows


def occult_experts(experts: nn.Module, routed, counts_e: torch.Tensor,
                   weight_Q: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rank's experts (:class:`occult.ep.GroupedExperts`) on Occult's EPD rows: [Q, D].
    ``routed`` is the EPD tensor (``weight_Q``: each row's gate weight, applied to its
    hidden row), or :class:`GatheredRows` (the Triton path, unweighted: the Triton
    gather-fused grouped matmul when it can run on these tensors, else gathered first)."""
    if not isinstance(routed, GatheredRows):
        return experts(routed, counts_e, weight_Q)
    from ..kernels import use_triton
    if use_triton(routed.source_RD):
        from ..kernels.fused import gathered_swiglu
        return gathered_swiglu(routed.source_RD, routed.index_Q, counts_e, experts.w_gate, experts.w_up,
                               experts.w_down)
    return experts(routed.materialize(), counts_e)
