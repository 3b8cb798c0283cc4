"""Observing collectives that run inside a library.

A library that runs its own all-to-alls (DeepSpeed's ``MOELayer``, Tutel's
``tutel.net.all_to_all``) cannot go through :mod:`occult.ep.comm`; its adapter
observes them instead. The rows per peer come from the buffer that really went into
the collective (set on the :class:`CallTrace` from its shape), the time from the
measuring clock around the call; in backward, identity autograd probes placed on the
exchange's input and output start and stop the clock when the gradient reaches them.

Inside a co-executed strand (:mod:`occult.ep.strands`) such a collective cannot hand the
turn over: the library blocks in it, and no other strand computes meanwhile. Its start and
end are then marks (read once every strand has ended), and its whole time is logged as
the ``exposed_comm`` it is (none of it hidden), beside the collective itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .accounting import Recorder
from .measure import barrier, between, mark
from .strands import current_strand


def observed_start(rec: Recorder) -> object:
    """The start of an observed collective: ``rec``'s (:meth:`Recorder.now`), or a mark inside a strand."""
    return mark() if current_strand() is not None else rec.now()


def log_observed(rec: Recorder, layer: int, phase: str, direction: str, rows_P, row_bytes: int, t0,
                 wait: float = 0.0) -> None:
    """Logs a library's collective that started at ``t0`` (:func:`observed_start`) and has
    ended. Inside a strand it could not yield: its whole time is also its ``exposed_comm``
    (both read once every strand has ended)."""
    strand = current_strand()
    if strand is None:
        rec.log_collective(layer=layer, phase=phase, direction=direction, rows_P=rows_P, row_bytes=row_bytes,
                           seconds=rec.since(t0), wait_seconds=wait)
        return
    end = mark()

    def later() -> None:
        seconds = between(t0, end)
        rec.log_collective(layer=layer, phase=phase, direction=direction, rows_P=rows_P, row_bytes=row_bytes,
                           seconds=seconds, wait_seconds=wait)
        rec.log_span(layer, "exposed_comm", direction, seconds)
    strand.later(later)


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
        self.started[(phase, direction)] = (observed_start(rec), wait)

    def stop(self, phase: str, direction: str) -> None:
        """Just after it: logs the exchange's rows per peer and its time."""
        rec = self.recorder
        if rec is None or (phase, direction) not in self.started:
            return
        t0, wait = self.started.pop((phase, direction))
        log_observed(rec, self.layer, phase, direction, list(self.rows_P), self.row_bytes, t0, wait)


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
