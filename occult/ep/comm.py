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
    """Where a collective is logged: layer, phase name and recorder (may be None);
    ``meta_cols``: trailing values of each row that are metadata (e.g. gate weights
    riding with a hidden state), logged apart as ``meta_bytes``."""

    layer: int
    phase: str
    recorder: Optional[Recorder]
    meta_cols: int = 0


def _exchange(x_RD: torch.Tensor, send_P: list, recv_P: list, ep: EPGroup, where: Exchange,
              direction: str, meta_row_bytes: Optional[int] = None) -> torch.Tensor:
    """One all-to-all of rows; ``send_P[j]`` rows go to rank j, ``recv_P[j]`` come from rank j.
    ``meta_row_bytes``: of each row's bytes, the metadata (default: ``where.meta_cols`` values)."""
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
        seconds = clock() - t0
        raw = _raw_seconds(x_RD, out, send_P, recv_P, ep) if rec.raw_replay else -1.0
        row_bytes = int(torch.Size(x_RD.shape[1:]).numel() * x_RD.element_size())
        rec.log_collective(layer=where.layer, phase=where.phase, direction=direction, rows_P=send_P,
                           row_bytes=row_bytes, seconds=seconds, wait_seconds=wait,
                           meta_row_bytes=(where.meta_cols * x_RD.element_size() if meta_row_bytes is None
                                           else meta_row_bytes), raw_seconds=raw)
    return out


def _raw_seconds(x_RD: torch.Tensor, out: torch.Tensor, send_P: list, recv_P: list, ep: EPGroup) -> float:
    """The same exchange again as a plain ``all_to_all_single`` (its output buffer made
    before the clock), after a barrier: what the collective costs without the harness."""
    if ep.world_size == 1:
        return 0.0
    scratch = torch.empty_like(out)
    barrier(ep)
    t0 = clock()
    dist.all_to_all_single(scratch, x_RD, list(recv_P), list(send_P), group=ep.group)
    return clock() - t0


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD, send_P, recv_P, ep, where):
        ctx.send_P, ctx.recv_P, ctx.ep, ctx.where = send_P, recv_P, ep, where
        return _exchange(x_RD, send_P, recv_P, ep, where, "forward")

    @staticmethod
    def backward(ctx, grad_RD):
        grad = _exchange(grad_RD, ctx.recv_P, ctx.send_P, ctx.ep, ctx.where, "backward")
        return grad, None, None, None, None


class _CompressedRows(torch.autograd.Function):
    """The all-to-all of rows whose hidden values cross in a compressed payload
    (:mod:`occult.ep.payload`) and whose trailing ``where.meta_cols`` values cross exactly;
    the backward sends the gradients the same way."""

    @staticmethod
    def forward(ctx, x_RX, send_P, recv_P, ep, where, payload):
        ctx.args = (send_P, recv_P, ep, where, payload)
        return _compressed(x_RX, send_P, recv_P, ep, where, payload, "forward")

    @staticmethod
    def backward(ctx, grad_RX):
        send_P, recv_P, ep, where, payload = ctx.args
        return _compressed(grad_RX, recv_P, send_P, ep, where, payload, "backward"), None, None, None, None, None


def _compressed(x_RX, send_P, recv_P, ep, where, payload, direction):
    from .payload import decode, encode, meta_bytes_per_row
    X = where.meta_cols
    D = x_RX.shape[1] - X
    wire_RW = encode(x_RX[:, :D], payload, x_RX[:, D:])
    got_RW = _exchange(wire_RW, send_P, recv_P, ep, where, direction, meta_row_bytes=meta_bytes_per_row(payload, X))
    h_RD, meta_RX = decode(got_RW, payload, D, x_RX.dtype)
    return torch.cat([h_RD, meta_RX.to(x_RX.dtype)], dim=1) if X else h_RD


def all_to_all_rows(x_RD: torch.Tensor, send_P: list, recv_P: list, ep: EPGroup,
                    where: Exchange, payload: str = "fp32") -> torch.Tensor:
    """Variable-split all-to-all of rows, differentiable: [sum(send_P), ...] -> [sum(recv_P), ...].
    ``payload`` other than ``fp32`` (the rows as they are): the hidden values cross as
    bf16, int8 or fp8 (:mod:`occult.ep.payload`), the metadata columns exactly."""
    send_P, recv_P = [int(s) for s in send_P], [int(r) for r in recv_P]
    if payload != "fp32":
        return _CompressedRows.apply(x_RD, send_P, recv_P, ep, where, payload)
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
