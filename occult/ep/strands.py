"""Micro-batch co-execution: strands that take turns at the collectives.

DHelix's strands and the two-batch overlap of DeepSeek-V3's and SGLang's inference: a
rank's batch is cut into micro-batches, each one a *strand* that runs the whole model on
its own sequences; while one strand's exchange is in flight the other computes. Here each
strand is a thread, and exactly one of them runs at a time (the *turn*):

  a strand computes until it starts a collective (asynchronously, through
  :mod:`occult.ep.comm`), hands the turn to the next live strand and, when the turn comes
  back, waits for its collective and computes on.

So with two strands layer l of micro-batch 1 (attention, router, the dispatch's counts)
runs while micro-batch 0's dispatch is in flight, micro-batch 0's experts while micro-batch
1's dispatch is, and so on, layer by layer: the layers interleave without the model's code
knowing (any family, any system whose collectives go through :mod:`occult.ep.comm`).
Collectives start in an order fixed by the schedule (round robin over the live strands,
one collective per turn), the same on every rank. A collective a library runs by itself
(deepspeed, tutel) is synchronous: correct, and not overlapped; its whole time is its
``exposed_comm`` (:func:`occult.ep.observe.log_observed`).

What is measured: ``exposed_comm``, per collective, the time from the turn coming back to
the collective's end: communication that the other strands' compute did not hide. Times
inside a strand are marks (:func:`occult.ep.measure.mark`: CUDA events on the strand's
stream, the host clock on a CPU rank), read once every strand has ended
(:meth:`Strands.later`), so that no clock read waits for the device between turns. On
CUDA each strand runs on its own stream. On a CPU rank the strands share the rank's cores
with gloo's transfers, so the exposed time measures the schedule, not a GPU's overlap.

Only the forward co-executes: a training step runs each micro-batch's backward in turn
(:func:`occult.models.runtime.forward_micro_batches` says why).
"""
from __future__ import annotations

import contextvars
import threading
from typing import Callable, Optional, Sequence

import torch

from .context import current, entered
from .measure import between, mark

def current_strand() -> Optional["Strand"]:
    """The strand this thread runs (None outside co-execution): the run context's ``strand``."""
    return current().strand


class Strand:
    """One micro-batch's thread in a :class:`Strands` schedule."""

    def __init__(self, strands: "Strands", index: int):
        self.strands, self.index = strands, index

    def await_work(self, work, where, direction: str) -> None:
        """After starting a collective (``work``: its handle; None when there is nothing to
        wait for): hands the turn over, then, once it is back, waits for the collective and
        notes the exposed time (logged for ``where``, an :class:`occult.ep.comm.Exchange`,
        and ``direction``)."""
        self.strands.hand_over(self.index)
        start = mark()
        if work is not None:
            work.wait()
        end = mark()
        rec = where.recorder
        if rec is not None:
            self.strands.later(lambda: rec.log_span(where.layer, "exposed_comm", direction, between(start, end)))

    def later(self, fn: Callable[[], None]) -> None:
        """Runs ``fn`` once every strand of the schedule has ended."""
        self.strands.later(fn)


class Strands:
    """A co-execution schedule of ``n`` strands: :meth:`run` runs them, one turn at a time."""

    def __init__(self, n: int):
        self.n = n
        self._cond = threading.Condition()
        self._turn = 0
        self._alive = [True] * n
        self._deferred: list = []

    def hand_over(self, me: int) -> None:
        """Gives the turn to the next live strand after ``me`` and blocks until it is ``me``'s again."""
        with self._cond:
            self._turn = self._next(me)
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._turn == me)

    def _next(self, me: int) -> int:
        for step in range(1, self.n + 1):
            j = (me + step) % self.n
            if self._alive[j]:
                return j
        return me

    def _finish(self, me: int) -> None:
        with self._cond:
            self._alive[me] = False
            self._turn = self._next(me)
            self._cond.notify_all()

    def later(self, fn: Callable[[], None]) -> None:
        """Runs ``fn`` once every strand has ended (reading marks then waits for nothing)."""
        self._deferred.append(fn)

    def run(self, fns: Sequence[Callable[[], object]], device) -> list:
        """Runs ``fns[i]`` as strand i (each in its own thread, with the caller's grad mode,
        context variables and device; on CUDA on a stream of its own), strand 0 first;
        returns their results in order and re-raises the first strand's error."""
        device = torch.device(device)
        grad = torch.is_grad_enabled()
        results: list = [None] * self.n
        errors: list = [None] * self.n
        caller_stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        streams = [torch.cuda.Stream(device) for _ in range(self.n)] if caller_stream is not None else []

        def body(i: int) -> None:
            with entered(strand=Strand(self, i)):
                run(i)

        def run(i: int) -> None:
            try:
                with self._cond:
                    self._cond.wait_for(lambda: self._turn == i)
                with torch.set_grad_enabled(grad):
                    if streams:
                        torch.cuda.set_device(device)
                        streams[i].wait_stream(caller_stream)
                        with torch.cuda.stream(streams[i]):
                            results[i] = fns[i]()
                    else:
                        results[i] = fns[i]()
            except BaseException as exc:          # noqa: BLE001 - re-raised by the caller
                errors[i] = exc
            finally:
                self._finish(i)

        threads = [threading.Thread(target=contextvars.copy_context().run, args=(body, i), daemon=True,
                                    name=f"strand-{i}") for i in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in streams:
            caller_stream.wait_stream(s)
        for fn in self._deferred:
            fn()
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results


def co_execute(fns: Sequence[Callable[[], object]], device) -> list:
    """``[fn() for fn in fns]``, the calls co-executed as strands when there are several
    (one: called as it is, no thread)."""
    if len(fns) == 1:
        return [fns[0]()]
    return Strands(len(fns)).run(fns, device)
