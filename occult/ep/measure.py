"""How everything the harness times is timed: one clock, one barrier, warm-up and timed
iterations started together, and the slowest rank.

Every timed thing uses this module: the recorder's spans and the accounted collectives
(:mod:`occult.ep.accounting`, :mod:`occult.ep.comm`), the tasks' iterations, the
benchmark and the loopback calibration. A step lasts as long as its slowest rank, so
over-all-ranks figures reduce with :func:`slowest`; the other reductions over ranks the
tasks make after their timed work are here too (:func:`sum_over_ranks`,
:func:`mean_over_ranks`, :func:`gather_objects`).

The clock is the host's monotonic performance counter. On a CPU rank the host clock
sees the work as it happens (``CLOCK = "host"``). On a CUDA rank kernels run
asynchronously, so every clock read first waits for the rank's device to finish what
was queued (``torch.cuda.synchronize``; ``CUDA_CLOCK = "cuda-synchronized"``): a
phase's time is then its device time plus the host's launch overhead, and the
synchronisation itself happens outside the timed intervals only where two reads are
adjacent. :func:`use_device` sets the rank's device once, when the rank starts.

A schedule that overlaps collectives with compute must not wait for the device between
them (a synchronising read would wait for the collectives' stream too and serialise
them): it takes :func:`mark` s, points on the device's timeline that do not wait (a CUDA
event on the current stream; the host clock on a CPU rank), and reads the intervals
between them with :func:`between` once the schedule has run. A static step, which may not
wait for the device at all (:mod:`occult.ep.static`), is timed the same way: its recorder
(``Recorder(marks=True)``) keeps each span and collective as an :class:`Interval` of marks,
read after the step.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from time import perf_counter
from typing import Iterator, Sequence, Union

import torch
import torch.distributed as dist

from . import context

CLOCK = "host"
CUDA_CLOCK = "cuda-synchronized"
def use_device(device) -> None:
    """Times this process's rank on ``device`` from now on (a CUDA device: synchronised
    reads): the run context's ``sync_device`` (:func:`occult.ep.context.use_device`)."""
    context.use_device(device)


def clock_name(backend: str) -> str:
    """What times a run's ranks on ``backend``: the ``clock`` column of its rows."""
    return CUDA_CLOCK if backend == "nccl" else CLOCK


# called with what is about to synchronise, before :func:`clock` or :func:`between` reads
# (None: nothing); :func:`occult.ep.host_sync.no_host_sync` sets it to refuse them
ON_SYNC = None


def clock() -> float:
    """Seconds on the measuring clock (only differences mean anything); on a CUDA rank,
    after the device has finished its queued work."""
    if ON_SYNC is not None:
        ON_SYNC("occult.ep.measure.clock() synchronises the device")
    device = context.current().sync_device
    if device is not None:
        torch.cuda.synchronize(device)
    return perf_counter()


def mark():
    """A point on this rank's timeline that does not wait for the device: a CUDA event
    recorded on the current stream (CUDA rank) or the host clock (CPU rank)."""
    if context.current().sync_device is None:
        return perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def between(start, end) -> float:
    """Seconds from mark ``start`` to mark ``end`` (on CUDA, waits until ``end`` is reached)."""
    if ON_SYNC is not None:
        ON_SYNC("occult.ep.measure.between() waits for the device")
    if isinstance(start, float):
        return end - start
    end.synchronize()
    return start.elapsed_time(end) / 1e3


@dataclass(frozen=True)
class Interval:
    """The interval from mark ``start`` to mark ``end`` (:func:`mark`), read later: a timed
    thing of a step that may not wait for the device (a static step's, ``Recorder(marks=True)``),
    read by :meth:`occult.ep.accounting.Recorder.settle` after the step."""

    start: object
    end: object

    def seconds(self) -> float:
        return between(self.start, self.end)


def barrier(ep) -> float:
    """Waits until every rank of ``ep`` (an :class:`occult.ep.comm.EPGroup`) gets here;
    returns the seconds waited (0 in a world of one, unless it runs its collectives)."""
    if ep.local_only:
        return 0.0
    t0 = clock()
    dist.barrier(group=ep.group)
    return clock() - t0


@dataclass
class Stopwatch:
    """What :func:`stopwatch` measured: ``seconds`` once the block has ended."""

    start: float
    seconds: float = 0.0


@contextmanager
def stopwatch() -> Iterator[Stopwatch]:
    """Times the enclosed block: ``with stopwatch() as sw: ...; sw.seconds``."""
    sw = Stopwatch(clock())
    try:
        yield sw
    finally:
        sw.seconds = clock() - sw.start


def slowest(ep, seconds: Union[float, Sequence[float]]) -> Union[float, list]:
    """The largest value over the ranks of ``ep`` (an all-reduce of the maximum), for one
    time or element-wise for a list of times."""
    many = not isinstance(seconds, (int, float))
    t = torch.tensor(list(seconds) if many else [seconds], dtype=torch.float64, device=ep.device)
    if ep.world_size > 1 and t.numel():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ep.group)
    return t.tolist() if many else t.item()


def sum_over_ranks(ep, t: torch.Tensor) -> torch.Tensor:
    """``t`` summed element-wise over the ranks of ``ep``, in place (an all-reduce; ``t``
    itself in a world of one)."""
    if ep.world_size > 1 and t.numel():
        dist.all_reduce(t, group=ep.group)
    return t


def mean_over_ranks(ep, values: Sequence[float]) -> list:
    """Element-wise mean over the ranks of ``ep`` of a list of floats (every rank has the
    same length)."""
    t = sum_over_ranks(ep, torch.tensor(list(values), dtype=torch.float64, device=ep.device))
    return (t / ep.world_size).tolist()


def gather_objects(ep, obj) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank (``[obj]`` in a world
    of one): results and routing gathered after the timed work, never inside it."""
    if ep.world_size == 1:
        return [obj]
    out = [None] * ep.world_size
    dist.all_gather_object(out, obj, group=ep.group)
    return out


def iterations(ep, warmup: int, iters: int, before=None) -> Iterator[int]:
    """Warm-up then timed iterations, each started together on every rank (``before()``,
    if given, runs first, e.g. clearing a recorder): yields the sample index, negative
    during warm-up."""
    for it in range(warmup + iters):
        if before is not None:
            before()
        barrier(ep)
        yield it - warmup
