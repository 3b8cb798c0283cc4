"""Observing collectives that run inside a library.

A library that runs its own all-to-alls (DeepSpeed's ``MOELayer``, Tutel's
``tutel.net.all_to_all``) cannot go through :mod:`occult.ep.comm`; its adapter
observes them instead. The rows per peer come from the buffer that really went into
the collective (set on the :class:`CallTrace` from its shape), the time from the
measuring clock around the call; in backward, identity autograd probes placed on the
exchange's input and output start and stop the clock when the gradient reaches them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .accounting import Recorder
from .measure import barrier, clock


@dataclass
class CallTrace:
    """One layer call's observation of a library's exchanges: rows per peer, times, logging.

    Call-scoped (built by the adapter for one call, referenced by the call's hooks and
    autograd probes); the adapter keeps none on itself.
    """

    layer: int
    recorder: Optional[Recorder]
    ep: object                   # the EPGroup
    rows_P: list = field(default_factory=list)      # rows per peer, set from the real buffer
    row_bytes: int = 0
    started: dict = field(default_factory=dict)     # (phase, direction) -> (t0, barrier wait)

    def start(self, phase: str, direction: str) -> None:
        """Just before an exchange: optional barrier, then the clock."""
        rec = self.recorder
        if rec is None:
            return
        wait = barrier(self.ep) if rec.sync_collectives else 0.0
        self.started[(phase, direction)] = (clock(), wait)

    def stop(self, phase: str, direction: str) -> None:
        """Just after it: logs the exchange's rows per peer and its time."""
        rec = self.recorder
        if rec is None or (phase, direction) not in self.started:
            return
        t0, wait = self.started.pop((phase, direction))
        rec.log_collective(layer=self.layer, phase=phase, direction=direction, rows_P=self.rows_P,
                           row_bytes=self.row_bytes, seconds=clock() - t0, wait_seconds=wait)


class _Probe(torch.autograd.Function):
    """Identity whose backward calls ``on_grad()`` when the gradient reaches it."""

    @staticmethod
    def forward(ctx, x, on_grad: Callable[[], None]):
        ctx.on_grad = on_grad
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.on_grad()
        return grad, None


def probe(x: torch.Tensor, on_grad: Callable[[], None]) -> torch.Tensor:
    """``x``, with ``on_grad`` called in backward (plain ``x`` when nothing flows back)."""
    return _Probe.apply(x, on_grad) if x.requires_grad else x
