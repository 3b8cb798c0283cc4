"""When a training step averages the replicated weights' gradients: ``task.grad_sync``.

Under expert parallelism every rank holds a replica of the non-expert weights (attention,
norms, routers, embeddings, shared experts); their gradients are averaged over ranks by an
all-reduce, while the backward's all-to-alls move the experts' activations' gradients. How
the two kinds of collective share the links is the schedule:

* ``end``: one all-reduce of every replicated gradient after the backward (the harness's
  default; nothing competes with the all-to-alls, and nothing of the all-reduce is hidden).
* ``overlap``: as PyTorch's DDP does, the gradients are grouped into buckets of about
  :data:`BUCKET_BYTES` in the order the backward produces them (the reverse of the
  parameters' order), and each bucket's all-reduce starts, asynchronously and on a second
  process group, as soon as its last gradient is accumulated (a post-accumulate hook), in
  bucket order on every rank. It runs while the backward goes on, competing with the
  all-to-alls for the links (here: for gloo's threads and the two cores).
* ``lina`` (Lina, ATC'23): the all-reduce is cut into partitions of
  :data:`PARTITION_BYTES`, and the all-to-all has priority. Lina pre-empts a running
  all-reduce at the granularity of its partitions; gloo (and NCCL) cannot pre-empt a
  collective, so the priority is a schedule: at most one partition is in flight; before
  every backward collective of the MoE layers starts, the partition in flight is waited
  for (so the all-to-all never shares the links with more than that one small partition's
  remainder; the wait is inside the all-to-all's timed interval), and the next partition
  starts only between all-to-alls (when one ends, or when a gradient is accumulated after
  that and none is in flight yet): one partition per gap between two MoE collectives, in a
  fixed order on every rank (the points are the schedule's, never a poll of the backend,
  which would differ between ranks and deadlock them). What has not started by the end of
  the backward starts then, one call per bucket (no all-to-all is left to yield to).

Every mode sums a copied expert's gradient over its copies (a slot placement), averages
the replicated gradients and divides the experts' by P: the same step (a test holds the
three modes' gradients equal to the single-device model's). What is measured
(:meth:`GradSync.backward`): span ``grad_sync`` (layer -1, pass backward), the time from the
end of the backward to the averaged gradients, the all-reduce left exposed; the backward
all-to-alls' ``a2a_time`` rows carry the competition.

Shapes: none (flat gradient buffers).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..ep.comm import collective_guard
from ..ep.measure import clock
from ..ep.replicas import sum_replica_gradients
from .ep_block import EPMoEBlock

GRAD_SYNCS = ("end", "overlap", "lina")
# DDP's default bucket is 25 MB for models of billions of weights; the CPU proxies' replicated
# weights are a few MB, so that buckets of 1 MB give several per step
BUCKET_BYTES = 1 << 20
# Lina's partitions: small enough that an all-to-all waits for little, large enough that the
# gaps carry much of the all-reduce (our choice for the proxies, whose replicated weights are a
# few MB: the OLMoE proxy's naive backward has 8 gaps between MoE collectives, one partition each)
PARTITION_BYTES = 256 << 10


def expert_parameters(model: nn.Module) -> set:
    """ids of the parameters that belong to this rank's routed experts."""
    return {id(p) for m in model.modules() if isinstance(m, EPMoEBlock)
            for p in m.experts.parameters()}


def replicated_parameters(model: nn.Module) -> list:
    """The weights every rank holds a replica of (all but this rank's routed experts)."""
    experts = expert_parameters(model)
    return [p for p in model.parameters() if p.requires_grad and id(p) not in experts]


def buckets_of(params: list, limit: int) -> list:
    """``params`` in backward order (reversed) grouped into runs of about ``limit`` bytes."""
    out, size = [[]], 0
    for p in reversed(params):
        if out[-1] and size + p.numel() * p.element_size() > limit:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel() * p.element_size()
    return [b for b in out if b]


def _flat(params: list) -> torch.Tensor:
    """The gradients of ``params`` in one flat buffer (zeros for a weight without one)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def _unflatten(params: list, flat: torch.Tensor, world_size: int) -> None:
    """Each weight's gradient: its part of ``flat`` (the sum over ranks) over the world size."""
    flat /= world_size
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n


def _merged(parts: list) -> list:
    """Consecutive partitions ``(flat, start, stop)`` of one buffer joined into one."""
    out: list = []
    for flat, s, e in parts:
        if out and out[-1][0] is flat and out[-1][2] == s:
            out[-1] = (flat, out[-1][1], e)
        else:
            out.append((flat, s, e))
    return out


class _Pending:
    """One step's buckets under ``overlap`` or ``lina``: which gradients have arrived, the
    flat buffers and the all-reduces in flight (made per backward, dropped after it)."""

    def __init__(self, buckets: list, group, lina: bool, partition_bytes: int):
        self.buckets, self.group, self.lina, self.partition_bytes = buckets, group, lina, partition_bytes
        self.missing = [len(b) for b in buckets]
        self.bucket_of = {id(p): i for i, b in enumerate(buckets) for p in b}
        self.flats: list = [None] * len(buckets)
        self.works: list = []
        self.next_bucket = 0
        self.parts: list = []          # lina: (flat, start, stop) ready to start, in order
        self.in_flight = None

    def arrived(self, p) -> None:
        """A gradient was accumulated: complete buckets become flat buffers, in order."""
        i = self.bucket_of.get(id(p))
        if i is None:
            return
        self.missing[i] -= 1
        self._take_complete()
        if self.lina:
            self.pump()

    def _take_complete(self) -> None:
        while self.next_bucket < len(self.buckets) and self.missing[self.next_bucket] == 0:
            self._take(self.next_bucket)

    def _take(self, i: int) -> None:
        flat = self.flats[i] = _flat(self.buckets[i])
        self.next_bucket = i + 1
        if not self.lina:
            self.works.append(dist.all_reduce(flat, group=self.group, async_op=True))
            return
        n = max(1, self.partition_bytes // flat.element_size())
        self.parts += [(flat, s, min(s + n, flat.numel())) for s in range(0, flat.numel(), n)]

    def pump(self) -> None:
        """lina: starts the next partition if none is in flight (between all-to-alls). Whether
        one is in flight is decided by the schedule alone (a partition stops being in flight
        when the next MoE collective waits for it), never by polling the backend: every rank
        then starts the same partitions at the same points of its backward."""
        if self.in_flight is None and self.parts:
            flat, s, e = self.parts.pop(0)
            self.in_flight = dist.all_reduce(flat[s:e], group=self.group, async_op=True)
            self.works.append(self.in_flight)

    def before(self) -> None:
        """lina, before a backward collective of the MoE layers: the partition in flight ends first."""
        if self.in_flight is not None:
            self.in_flight.wait()
            self.in_flight = None

    def after(self) -> None:
        self.pump()

    def finish(self) -> list:
        """Every remaining bucket (a weight without a gradient: zeros) and partition started
        in order; waits for all; returns the flat buffers."""
        self.started_in_backward = len(self.works)
        for i in range(self.next_bucket, len(self.buckets)):
            self._take(i)
        if self.lina:       # no all-to-all is left to yield to: each bucket's rest in one call
            for flat, s, e in _merged(self.parts):
                self.works.append(dist.all_reduce(flat[s:e], group=self.group, async_op=True))
            self.parts = []
        for w in self.works:
            w.wait()
        return self.flats


class GradSync:
    """Averages a rank model's replicated gradients over ranks by ``mode`` (:data:`GRAD_SYNCS`).
    Built once per model, on every rank at the same point (``overlap`` and ``lina`` make a
    second process group, where their all-reduces run beside the all-to-alls)."""

    def __init__(self, ctx, model: nn.Module, mode: str = "end", bucket_bytes: int = BUCKET_BYTES,
                 partition_bytes: int = PARTITION_BYTES):
        if mode not in GRAD_SYNCS:
            raise ValueError(f"task.grad_sync={mode!r}: allowed values are {list(GRAD_SYNCS)}")
        self.ctx, self.model, self.mode, self.partition_bytes = ctx, model, mode, partition_bytes
        self.params = replicated_parameters(model)
        P = ctx.world_size
        self.group = dist.new_group(list(range(P))) if mode != "end" and P > 1 else None
        self.buckets = buckets_of(self.params, bucket_bytes)

    def backward(self, losses: list, rec=None) -> dict:
        """Runs the backward of each of ``losses`` (a micro-batch's, weighted: their sum is the
        step's loss) in turn, then synchronises; ``overlap`` and ``lina`` start their
        all-reduces during the last backward. Logs span ``grad_sync`` on ``rec``; returns
        ``{"allreduces": n, "started_in_backward": m}`` (all-reduce calls of the step, and
        how many of them started before the backward ended)."""
        for loss in losses[:-1]:
            loss.backward()
        pending = None
        if self.group is not None:
            pending = _Pending(self.buckets, self.group, self.mode == "lina", self.partition_bytes)
        with self._hooks(pending):
            losses[-1].backward()
        t0 = clock()
        self._finish(pending)
        if rec is not None:
            rec.log_span(-1, "grad_sync", "backward", clock() - t0)
        if pending is None:
            return {"allreduces": int(self.ctx.world_size > 1), "started_in_backward": 0}
        return {"allreduces": len(pending.works), "started_in_backward": pending.started_in_backward}

    @contextmanager
    def _hooks(self, pending: Optional[_Pending]):
        """During the backward: each gradient's arrival told to ``pending``; under lina also
        the MoE layers' collectives (:func:`occult.ep.comm.collective_guard`)."""
        if pending is None:
            yield
            return
        handles = [p.register_post_accumulate_grad_hook(pending.arrived) for p in self.params]
        try:
            with collective_guard(pending if pending.lina else None):
                yield
        finally:
            for h in handles:
                h.remove()

    def _finish(self, pending: Optional[_Pending]) -> None:
        ctx, model = self.ctx, self.model
        for block in model.modules():          # a replicated expert's gradient: the sum over its copies
            if isinstance(block, EPMoEBlock):
                sum_replica_gradients(block.experts, block.dispatcher.placement, ctx.ep)
        P = ctx.world_size
        if P == 1:
            return
        if pending is None:
            flat = _flat(self.params)
            dist.all_reduce(flat, group=ctx.ep.group)
            _unflatten(self.params, flat, P)
        else:
            for params, flat in zip(self.buckets, pending.finish()):
                _unflatten(params, flat, P)
        experts = expert_parameters(model)
        for p in model.parameters():
            if id(p) in experts and p.grad is not None:
                p.grad /= P


def sync_gradients(ctx, model: nn.Module) -> None:
    """Sums each copied expert's gradient over its copies (a slot placement's, :mod:`occult.ep.replicas`),
    averages replicated weights' gradients over ranks (one all-reduce) and scales the
    experts' by 1/P, so that the step is the step of the mean loss over all ranks
    (``task.grad_sync=end`` after a backward that has run)."""
    GradSync(ctx, model, "end")._finish(None)
