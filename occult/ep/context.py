"""The run context: every switch that changes what a collective does, in one module.

A collective of :mod:`occult.ep.comm` reads :func:`current` once and runs under what it
says; nothing else holds such a switch. Each is entered explicitly, for a block, with
:func:`entered` (and left, restored, at its end):

* ``recorder`` (per context: a ``ContextVar``): where collectives, spans and routing are
  logged for layers called without an explicit recorder (whole models);
  :func:`occult.ep.accounting.recording` enters it.
* ``dynamic`` (per context): calls of a static system run its dynamic path (a decode
  task's prompt); :func:`occult.ep.static.dynamic_calls` enters it.
* ``strand`` (per thread): the co-executed micro-batch this thread runs
  (:mod:`occult.ep.strands`: a collective starts asynchronously and hands the turn over).
* ``guard`` (per process: the autograd engine runs a CUDA backward's collectives on a thread
  of its own): told before and after every collective (task.grad_sync=lina);
  :func:`occult.ep.comm.collective_guard` enters it.
* ``sync_device`` (per process, set once per rank by :func:`use_device`): the CUDA device the
  measuring clock synchronises (None: a CPU rank).

Per-context switches are seen by the threads a strand schedule starts (it copies the
context); the per-process ones by every thread.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Optional

import torch

_RECORDER: ContextVar = ContextVar("occult_recorder", default=None)
_DYNAMIC: ContextVar = ContextVar("occult_dynamic_calls", default=False)
_THREAD = threading.local()            # .strand
_PROCESS: dict = {"guard": None, "sync_device": None}
_KEEP = object()


@dataclass(frozen=True)
class RunState:
    """What the collectives called now run under (a snapshot: :func:`current`)."""

    recorder: Any                  # occult.ep.accounting.Recorder or None
    dynamic: bool                  # a static system's calls run its dynamic path
    strand: Any                    # occult.ep.strands.Strand or None
    guard: Any                     # an object with before() / after(), or None
    sync_device: Optional[torch.device]   # the CUDA device the clock synchronises, or None


def current() -> RunState:
    """The switches as this thread and context see them now."""
    return RunState(_RECORDER.get(), _DYNAMIC.get(), getattr(_THREAD, "strand", None), _PROCESS["guard"],
                    _PROCESS["sync_device"])


@contextmanager
def entered(*, recorder=_KEEP, dynamic=_KEEP, strand=_KEEP, guard=_KEEP):
    """Runs the block with the given switches (the others as they are); restores them at its
    end. ``sync_device`` is a rank's for its life: :func:`use_device`."""
    tokens = []
    if recorder is not _KEEP:
        tokens.append((_RECORDER, _RECORDER.set(recorder)))
    if dynamic is not _KEEP:
        tokens.append((_DYNAMIC, _DYNAMIC.set(bool(dynamic))))
    previous_strand = getattr(_THREAD, "strand", None)
    if strand is not _KEEP:
        _THREAD.strand = strand
    previous_guard = _PROCESS["guard"]
    if guard is not _KEEP:
        _PROCESS["guard"] = guard
    try:
        yield current()
    finally:
        if guard is not _KEEP:
            _PROCESS["guard"] = previous_guard
        if strand is not _KEEP:
            _THREAD.strand = previous_strand
        for var, token in reversed(tokens):
            var.reset(token)


def use_device(device) -> None:
    """This process's rank computes on ``device`` from now on (a CUDA device: the clock
    synchronises it before reading)."""
    device = torch.device(device)
    _PROCESS["sync_device"] = device if device.type == "cuda" else None
