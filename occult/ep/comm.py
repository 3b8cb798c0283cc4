"""Differentiable variable-split all-to-all, accounted.

The one place where dispatchers talk to other ranks. Forward runs
``all_to_all_single`` with the given split sizes; backward runs the transposed
exchange (send and receive splits swapped). Both log the split sizes that went
into the collective, and the time it took, on the call's :class:`Recorder`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .accounting import Recorder
from .measure import barrier, clock


@dataclass(frozen=True)
class EPGroup:
    """The expert-parallel group a dispatcher talks to (static, per process)."""

    rank: int = 0
    world_size: int = 1
    group: Optional[object] = None   # a torch.distributed ProcessGroup, None = default / single process
    device: str = "cpu"              # where this rank computes: "cpu" (gloo) or "cuda:<local rank>" (NCCL)


@dataclass(frozen=True)
class Exchange:
    """Where a collective is logged: layer, phase name and recorder (may be None)."""

    layer: int
    phase: str
    recorder: Optional[Recorder]


def _exchange(x_RD: torch.Tensor, send_P: list, recv_P: list, ep: EPGroup, where: Exchange,
              direction: str) -> torch.Tensor:
    """One all-to-all of rows; ``send_P[j]`` rows go to rank j, ``recv_P[j]`` come from rank j."""
    rec = where.recorder
    wait = barrier(ep) if rec is not None and rec.sync_collectives else 0.0
    t0 = clock()
    x_RD = x_RD.contiguous()
    out = x_RD.new_empty((sum(recv_P),) + tuple(x_RD.shape[1:]))
    if ep.world_size == 1:
        out.copy_(x_RD)
    else:
        dist.all_to_all_single(out, x_RD, list(recv_P), list(send_P), group=ep.group)
    if rec is not None:
        row_bytes = int(torch.Size(x_RD.shape[1:]).numel() * x_RD.element_size())
        rec.log_collective(layer=where.layer, phase=where.phase, direction=direction, rows_P=send_P,
                           row_bytes=row_bytes, seconds=clock() - t0, wait_seconds=wait)
    return out


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD, send_P, recv_P, ep, where):
        ctx.send_P, ctx.recv_P, ctx.ep, ctx.where = send_P, recv_P, ep, where
        return _exchange(x_RD, send_P, recv_P, ep, where, "forward")

    @staticmethod
    def backward(ctx, grad_RD):
        grad = _exchange(grad_RD, ctx.recv_P, ctx.send_P, ctx.ep, ctx.where, "backward")
        return grad, None, None, None, None


def all_to_all_rows(x_RD: torch.Tensor, send_P: list, recv_P: list, ep: EPGroup,
                    where: Exchange) -> torch.Tensor:
    """Variable-split all-to-all of rows, differentiable: [sum(send_P), ...] -> [sum(recv_P), ...]."""
    send_P, recv_P = [int(s) for s in send_P], [int(r) for r in recv_P]
    if x_RD.requires_grad:
        return _AllToAllRows.apply(x_RD, send_P, recv_P, ep, where)
    return _exchange(x_RD, send_P, recv_P, ep, where, "forward")


def exchange_counts(counts_PX: torch.Tensor, ep: EPGroup, where: Exchange) -> torch.Tensor:
    """Send row j of ``counts_PX`` (int64, [P, X]) to rank j; returns what each rank sent us.

    This is the metadata exchange that precedes variable-split all-to-alls
    (a device-to-host sync follows when the caller turns counts into splits).
    """
    P = ep.world_size
    return _exchange(counts_PX, [1] * P, [1] * P, ep, where, "forward")
