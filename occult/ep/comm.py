"""Accounted collectives: the one place where systems talk to other ranks.

Every collective logs, on the call's :class:`Recorder`, the rows it sent to each peer
(from the split sizes that went into it), the bytes per row, which collective it was and
how long it took; its backward (where it is differentiable) runs the transposed
collective and logs it too, as pass ``backward``.

* :func:`all_to_all_rows` (variable splits; backward: the transposed all-to-all) and
  :func:`exchange_counts` (the small metadata exchange before it);
* :func:`all_gather_rows` (every rank's rows to every rank; backward: a reduce-scatter
  of the gradients);
* :func:`reduce_scatter_rows` (block j of every rank's rows is summed on rank j;
  backward: an all-gather);
* :func:`broadcast_rows` (one rank's rows to every rank; backward: a reduce of the
  gradients to that rank);
* :func:`start_all_to_all` (an all-to-all that runs while the caller computes, for
  pipelined schedules; not differentiable by itself);
* :func:`all_to_all_fixed` (equal splits of a fixed-shape buffer whose valid rows are
  marked in the buffer itself: static-shape dispatch, no counts exchange, no host read;
  it logs the wire rows it sent and, as device tensors read after the step, the valid
  ones: :meth:`Recorder.settle`).

What is logged is each collective's *logical* traffic, per (source, destination) pair:
an all-gather sends the rank's rows to every peer, a broadcast sends the source's rows to
every peer, a reduce sends every rank's rows to the destination, a reduce-scatter sends
block j to rank j. How a backend moves them (rings, trees) is the backend's business; the
cost model (:mod:`analysis.pricing`) prices each kind. Rows a rank keeps for itself
are logged as sent to itself (free in every model).

Backends: gloo (this CPU) has all-gather only for equal row counts, so an all-gather of
unequal counts runs as an all-to-all whose send splits are the rank's own row count to
every peer (the same rows move; logged the same way). gloo has reduce-scatter and
reduce, so those are the backend's own collectives.

Shapes: R rows, D the rest of a row's shape, P ranks.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.distributed as dist

from .accounting import Recorder
from .measure import barrier, between, clock, mark
from .payload import decode, encode, meta_bytes_per_row
from .context import current, entered

ALL_TO_ALL, ALL_GATHER, REDUCE_SCATTER, BROADCAST, REDUCE = (
    "all_to_all", "all_gather", "reduce_scatter", "broadcast", "reduce")
# the collective each kind's backward runs (the autograd functions below): the same traffic,
# transposed (what the traffic plans of :mod:`occult.ep.plan` follow)
BACKWARD_KIND = {ALL_TO_ALL: ALL_TO_ALL, ALL_GATHER: REDUCE_SCATTER, REDUCE_SCATTER: ALL_GATHER,
                 BROADCAST: REDUCE, REDUCE: BROADCAST}


@dataclass(frozen=True)
class EPGroup:
    """The expert-parallel group a dispatcher talks to (static, per process).

    ``devices_per_node``: ranks per node (``cluster.devices_per_node``; 0: every rank in
    one node). Ranks ``[n * G, (n + 1) * G)`` form node n. ``single_rank_collectives``: in a
    world of one rank, run the backend's collectives anyway (the rank sends to itself
    through NCCL or gloo) instead of local copies (``cluster.single_rank_collectives``:
    ``make gpu-check`` on one GPU, where NCCL refuses two ranks).
    """

    rank: int = 0
    world_size: int = 1
    group: Optional[object] = None   # a torch.distributed ProcessGroup, None = default / single process
    device: str = "cpu"              # where this rank computes: "cpu" (gloo) or "cuda:<local rank>" (NCCL)
    devices_per_node: int = 0
    single_rank_collectives: bool = False

    def __post_init__(self) -> None:
        G = self.devices_per_node
        if G < 0 or (G and self.world_size % G):
            raise ValueError(f"cluster.devices_per_node={G}: allowed values are 0 (one node) or a divisor of "
                             f"the world size {self.world_size}")

    @property
    def per_node(self) -> int:
        """Ranks per node, G (the whole world when ``devices_per_node`` is 0)."""
        return self.devices_per_node or self.world_size

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.per_node

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    @property
    def local_only(self) -> bool:
        """Whether collectives are local copies: one rank, unless ``single_rank_collectives``."""
        return self.world_size == 1 and not self.single_rank_collectives


@dataclass(frozen=True)
class Exchange:
    """Where a collective is logged: layer, phase name and recorder (may be None);
    ``meta_cols``: trailing values of each row that are metadata (e.g. gate weights
    riding with a hidden state), logged apart as ``meta_bytes``; ``metadata``: the whole
    row is (routing ids, counts, plans: the cost model keeps such rows at their size
    instead of re-sizing them to a model's width)."""

    layer: int
    phase: str
    recorder: Optional[Recorder]
    meta_cols: int = 0
    metadata: bool = False


def _row_bytes(x: torch.Tensor) -> int:
    return int(torch.Size(x.shape[1:]).numel() * x.element_size())


def _log(where: Exchange, direction: str, collective: str, rows_P, x: torch.Tensor, t0: float,
         wait: float, meta_row_bytes: Optional[int] = None, replay=None,
         seconds: Optional[float] = None, valid_P: Optional[torch.Tensor] = None) -> None:
    """Logs a collective that started at ``t0`` and has ended (``seconds``: its time, when
    the caller measured it). ``meta_row_bytes``: of each row's bytes, the metadata (default:
    ``where.meta_cols`` values; every byte for a ``where.metadata`` exchange); ``replay``: a
    callable that runs the same exchange again as the bare collective and returns its
    seconds (called only with ``Recorder.raw_replay``); ``valid_P``: of ``rows_P``, the valid
    rows (a device tensor, kept as it is until :meth:`Recorder.settle`)."""
    rec = where.recorder
    strand = current().strand
    if rec is not None and strand is not None and seconds is None:
        # a co-executed strand: its start and end are marks, read once every strand has ended
        # (the valid rows of a fixed buffer with them)
        end = mark()
        strand.later(lambda: _log(where, direction, collective, rows_P, x, t0, wait, meta_row_bytes,
                                  seconds=between(t0, end), valid_P=valid_P))
        return
    if rec is not None:
        seconds = rec.since(t0) if seconds is None else seconds
        if where.metadata:
            meta_row_bytes = _row_bytes(x)
        raw = replay() if replay is not None and rec.raw_replay else -1.0
        rec.log_collective(layer=where.layer, phase=where.phase, direction=direction, rows_P=rows_P,
                           row_bytes=_row_bytes(x), seconds=seconds, wait_seconds=wait,
                           meta_row_bytes=(where.meta_cols * x.element_size() if meta_row_bytes is None
                                           else meta_row_bytes), raw_seconds=raw, collective=collective,
                           valid_P=valid_P)


def _start(ep: EPGroup, where: Exchange) -> tuple[float, object]:
    """(barrier wait, start) of a collective (the barrier only with sync_collectives; no
    clock read without a recorder: on CUDA it synchronises the device, which a CUDA graph's
    capture may not, :mod:`occult.ep.graphs`; in a co-executed strand, or for a recorder
    that times by marks (a static step's), the start is a mark: :mod:`occult.ep.strands`)."""
    rec = where.recorder
    if rec is None:
        return 0.0, 0.0
    if current().strand is not None:
        return 0.0, mark()
    wait = barrier(ep) if rec.sync_collectives else 0.0
    return wait, rec.now()


@contextmanager
def collective_guard(guard):
    """While the block runs, ``guard.before()`` precedes every collective of this module and
    ``guard.after()`` follows it (an asynchronous one's wait: :func:`start_all_to_all`;
    ``guard`` None: nothing): the run context's ``guard`` (:mod:`occult.ep.context`; a
    gradient all-reduce scheduler that yields the links to the MoE layers' exchanges,
    task.grad_sync=lina; process-wide, as the autograd engine runs a CUDA backward's
    collectives on a thread of its own)."""
    with entered(guard=guard):
        yield


def _backend(where: Exchange, direction: str, fn, *args, **kwargs) -> None:
    """Runs one backend collective ``fn(*args, **kwargs)``; in a co-executed strand
    (:mod:`occult.ep.strands`) asynchronously, the turn handed to the other strands while
    it is in flight; between a guard's ``before`` and ``after`` (:func:`collective_guard`):
    what the run context (:func:`occult.ep.context.current`) says now."""
    state = current()
    guard, strand = state.guard, state.strand
    if guard is not None:
        guard.before()
    if strand is None:
        fn(*args, **kwargs)
    else:
        strand.await_work(fn(*args, async_op=True, **kwargs), where, direction)
    if guard is not None:
        guard.after()


def _a2a(x_RD: torch.Tensor, send_P: list, recv_P: list, ep: EPGroup, where: Exchange,
         direction: str) -> torch.Tensor:
    x_RD = x_RD.contiguous()
    out = x_RD.new_empty((sum(recv_P),) + tuple(x_RD.shape[1:]))
    if ep.local_only:
        out.copy_(x_RD)
    else:
        _backend(where, direction, dist.all_to_all_single, out, x_RD, list(recv_P), list(send_P), group=ep.group)
    return out


def _exchange(x_RD: torch.Tensor, send_P: list, recv_P: list, ep: EPGroup, where: Exchange,
              direction: str, meta_row_bytes: Optional[int] = None, valid_P=None) -> torch.Tensor:
    """One all-to-all of rows; ``send_P[j]`` rows go to rank j, ``recv_P[j]`` come from rank j.
    ``meta_row_bytes``: of each row's bytes, the metadata (default: ``where.meta_cols`` values);
    ``valid_P``: a callable of the output rows giving the valid rows sent to each rank (a
    device tensor [P]; fixed buffers, :func:`all_to_all_fixed`)."""
    wait, t0 = _start(ep, where)
    x_RD = x_RD.contiguous()
    out = _a2a(x_RD, send_P, recv_P, ep, where, direction)
    _log(where, direction, ALL_TO_ALL, send_P, x_RD, t0, wait, meta_row_bytes,
         replay=lambda: _raw_seconds(x_RD, out, send_P, recv_P, ep),
         valid_P=None if valid_P is None or where.recorder is None else valid_P(out))
    return out


def _raw_seconds(x_RD: torch.Tensor, out: torch.Tensor, send_P: list, recv_P: list, ep: EPGroup) -> float:
    """The same exchange again as a plain ``all_to_all_single`` (its output buffer made
    before the clock), after a barrier: what the collective costs without the harness."""
    if ep.local_only:
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


class _FixedRows(torch.autograd.Function):
    """The equal-split all-to-all of a fixed buffer; its backward sends the gradients of the
    received rows back the same way (the rows that were valid there logged as valid)."""

    @staticmethod
    def forward(ctx, x_RW, ep, where, valid, valid_back):
        P = ep.world_size
        splits = [x_RW.shape[0] // P] * P
        marks: dict = {}

        def sent(out):
            marks["back"] = valid_back(out) if callable(valid_back) else valid_back
            return _valid_per_rank(valid(x_RW) if callable(valid) else valid, P)
        ctx.ep, ctx.where, ctx.splits, ctx.marks = ep, where, splits, marks
        return _exchange(x_RW, splits, splits, ep, where, "forward", valid_P=sent)

    @staticmethod
    def backward(ctx, grad_RW):
        back = ctx.marks.get("back")
        valid_P = None if back is None else (lambda _: _valid_per_rank(back, ctx.ep.world_size))
        grad = _exchange(grad_RW, ctx.splits, ctx.splits, ctx.ep, ctx.where, "backward", valid_P=valid_P)
        return grad, None, None, None, None


def _valid_per_rank(valid_R: torch.Tensor, P: int) -> torch.Tensor:
    """Valid rows of each rank's equal block of a fixed buffer: bool [P * S] -> long [P] (on the
    buffer's device: nothing read on the host)."""
    return valid_R.reshape(P, -1).sum(1)


def all_to_all_fixed(x_RW: torch.Tensor, valid, ep: EPGroup, where: Exchange, valid_back=None) -> torch.Tensor:
    """Equal-split all-to-all of a fixed buffer, differentiable: [P * S, W] -> [P * S, W], block
    j (rows ``[j S, (j + 1) S)``) to rank j; what rank j sent arrives in block j. No counts
    exchange and no host read: the valid rows are marked in the buffer itself (the sender's
    encoding, e.g. a slot id or gate weights >= 0), padding rows travel too (what a
    low-latency kernel would not send).

    Logs the wire rows (``rows``: S to every rank) and, beside them, the valid rows sent to
    each rank: ``valid`` (bool [P * S], or a callable of the buffer giving it) in the forward,
    ``valid_back`` (of the received rows, or a callable of them) in the backward, kept on the
    device until :meth:`Recorder.settle`."""
    P = ep.world_size
    if x_RW.shape[0] % P:
        raise ValueError(f"all_to_all_fixed: {x_RW.shape[0]} rows do not split into {P} equal blocks")
    if x_RW.requires_grad:
        return _FixedRows.apply(x_RW, ep, where, valid, valid_back)
    splits = [x_RW.shape[0] // P] * P
    return _exchange(x_RW, splits, splits, ep, where, "forward",
                     valid_P=lambda out: _valid_per_rank(valid(x_RW) if callable(valid) else valid, P))


def exchange_counts(counts_PX: torch.Tensor, ep: EPGroup, where: Exchange,
                    peers_P: Optional[list] = None) -> torch.Tensor:
    """Send row j of ``counts_PX`` (int64, [P, X]) to rank j; returns what each rank sent us.

    This is the metadata exchange that precedes variable-split all-to-alls
    (a device-to-host sync follows when the caller turns counts into splits).
    ``peers_P`` (bools, the same pattern on both sides of every pair): exchange with those
    ranks only (a staged exchange talks to some peers); the rows of the others are zeros.
    """
    P = ep.world_size
    where = replace(where, metadata=True)
    if peers_P is None:
        return _exchange(counts_PX, [1] * P, [1] * P, ep, where, "forward")
    splits = [int(bool(p)) for p in peers_P]
    mask_P = torch.tensor(splits, dtype=torch.bool, device=counts_PX.device)
    got_QX = _exchange(counts_PX[mask_P], splits, splits, ep, where, "forward")
    out_PX = torch.zeros_like(counts_PX)
    out_PX[mask_P] = got_QX
    return out_PX


# ---------------------------------------------------------------------------
# all-gather and reduce-scatter (each other's backward)
# ---------------------------------------------------------------------------


def _gather(x_RD: torch.Tensor, counts_P: list, ep: EPGroup, where: Exchange, direction: str) -> torch.Tensor:
    """Every rank's rows, in rank order: [counts_P[rank], ...] -> [sum(counts_P), ...]."""
    P, mine = ep.world_size, counts_P[ep.rank]
    wait, t0 = _start(ep, where)
    x_RD = x_RD.contiguous()
    if ep.local_only:
        out = x_RD.clone()
    elif len(set(counts_P)) == 1:
        out = x_RD.new_empty((sum(counts_P),) + tuple(x_RD.shape[1:]))
        _backend(where, direction, dist.all_gather_single, out, x_RD, group=ep.group)
    else:   # unequal counts: gloo's all-gather refuses them; the same rows through an all-to-all
        out = _a2a(x_RD.repeat((P,) + (1,) * (x_RD.dim() - 1)), [mine] * P, counts_P, ep, where, direction)
    _log(where, direction, ALL_GATHER, [mine] * P, x_RD, t0, wait)
    return out


def _scatter_sum(x_RD: torch.Tensor, counts_P: list, ep: EPGroup, where: Exchange,
                 direction: str) -> torch.Tensor:
    """Block j of every rank's rows, summed on rank j: [sum(counts_P), ...] -> [counts_P[rank], ...]."""
    wait, t0 = _start(ep, where)
    x_RD = x_RD.contiguous()
    if ep.local_only:
        out = x_RD.clone()
    else:
        out = x_RD.new_empty((counts_P[ep.rank],) + tuple(x_RD.shape[1:]))
        _backend(where, direction, dist.reduce_scatter, out, list(torch.split(x_RD, counts_P)), group=ep.group)
    _log(where, direction, REDUCE_SCATTER, counts_P, x_RD, t0, wait)
    return out


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD, counts_P, ep, where):
        ctx.counts_P, ctx.ep, ctx.where = counts_P, ep, where
        return _gather(x_RD, counts_P, ep, where, "forward")

    @staticmethod
    def backward(ctx, grad_RD):
        return _scatter_sum(grad_RD, ctx.counts_P, ctx.ep, ctx.where, "backward"), None, None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_RD, counts_P, ep, where):
        ctx.counts_P, ctx.ep, ctx.where = counts_P, ep, where
        return _scatter_sum(x_RD, counts_P, ep, where, "forward")

    @staticmethod
    def backward(ctx, grad_RD):
        return _gather(grad_RD, ctx.counts_P, ctx.ep, ctx.where, "backward"), None, None, None


def all_gather_rows(x_RD: torch.Tensor, counts_P: list, ep: EPGroup, where: Exchange) -> torch.Tensor:
    """Every rank's rows on every rank, in rank order, differentiable (backward: the
    gradients of each rank's rows, summed over ranks, go back to it):
    [counts_P[rank], ...] -> [sum(counts_P), ...]. ``counts_P``: every rank's row count."""
    counts_P = [int(c) for c in counts_P]
    if x_RD.shape[0] != counts_P[ep.rank]:
        raise ValueError(f"all_gather_rows: {x_RD.shape[0]} rows but counts_P[{ep.rank}]={counts_P[ep.rank]}")
    if x_RD.requires_grad:
        return _AllGatherRows.apply(x_RD, counts_P, ep, where)
    return _gather(x_RD, counts_P, ep, where, "forward")


def reduce_scatter_rows(x_RD: torch.Tensor, counts_P: list, ep: EPGroup, where: Exchange) -> torch.Tensor:
    """Rows ``[sum(counts_P[:j]), sum(counts_P[:j+1]))`` of every rank, summed on rank j,
    differentiable (backward: an all-gather): [sum(counts_P), ...] -> [counts_P[rank], ...]."""
    counts_P = [int(c) for c in counts_P]
    if x_RD.requires_grad:
        return _ReduceScatterRows.apply(x_RD, counts_P, ep, where)
    return _scatter_sum(x_RD, counts_P, ep, where, "forward")


# ---------------------------------------------------------------------------
# broadcast and reduce (each other's backward)
# ---------------------------------------------------------------------------


def _broadcast(buf_RD: torch.Tensor, src: int, ep: EPGroup, where: Exchange, direction: str) -> torch.Tensor:
    """``src``'s rows on every rank (``buf_RD``: the rows on ``src``, a buffer of their shape elsewhere)."""
    P = ep.world_size
    wait, t0 = _start(ep, where)
    out = buf_RD.contiguous().clone()
    if not ep.local_only:
        # src: a global rank (the group spans the world)
        _backend(where, direction, dist.broadcast, out, src=src, group=ep.group)
    rows_P = [out.shape[0] if ep.rank == src else 0] * P
    _log(where, direction, BROADCAST, rows_P, out, t0, wait)
    return out


def _reduce(x_RD: torch.Tensor, dst: int, ep: EPGroup, where: Exchange, direction: str) -> torch.Tensor:
    """The sum over ranks of ``x_RD`` on ``dst`` (zeros elsewhere: only ``dst`` holds the rows)."""
    P = ep.world_size
    wait, t0 = _start(ep, where)
    out = x_RD.contiguous().clone()
    if not ep.local_only:
        _backend(where, direction, dist.reduce, out, dst=dst, group=ep.group)
    rows_P = [out.shape[0] if j == dst else 0 for j in range(P)]
    _log(where, direction, REDUCE, rows_P, out, t0, wait)
    return out if ep.rank == dst else torch.zeros_like(out)


class _BroadcastRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buf_RD, src, ep, where):
        ctx.src, ctx.ep, ctx.where = src, ep, where
        return _broadcast(buf_RD, src, ep, where, "forward")

    @staticmethod
    def backward(ctx, grad_RD):
        return _reduce(grad_RD, ctx.src, ctx.ep, ctx.where, "backward"), None, None, None


def broadcast_rows(buf_RD: torch.Tensor, src: int, ep: EPGroup, where: Exchange, *,
                   requires_grad: bool) -> torch.Tensor:
    """Rank ``src``'s rows on every rank: ``buf_RD`` is the rows on ``src`` and a buffer of
    the same shape elsewhere (its values unused). With ``requires_grad`` (which every rank
    must pass alike) it is differentiable: the backward sums every rank's gradient of the
    rows on ``src`` (a reduce; the other ranks' gradient of their buffer is zero). Every
    rank's output then takes part in the backward, so that every rank runs the reduce,
    even where ``src``'s rows themselves need no gradient (a frozen weight)."""
    if requires_grad:
        if ep.rank != src or not buf_RD.requires_grad:
            buf_RD = buf_RD.detach().requires_grad_(True)
        return _BroadcastRows.apply(buf_RD, int(src), ep, where)
    return _broadcast(buf_RD.detach(), int(src), ep, where, "forward")


# ---------------------------------------------------------------------------
# an all-to-all that runs while the caller computes
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PendingExchange:
    """An all-to-all in flight (:func:`start_all_to_all`); :meth:`wait` returns its rows."""

    out_RD: torch.Tensor
    work: Optional[object]
    send_P: list
    where: Exchange
    direction: str
    send_RD: torch.Tensor      # the rows being sent (kept alive until the collective ends)
    start: object              # a measure.mark: the device timeline is not waited for
    wait_s: float

    def wait(self) -> torch.Tensor:
        """The rows, once they have arrived (on CUDA the current stream waits for them, the
        host only to read the time); logs the collective (its time: from start to here)."""
        if self.work is not None:
            self.work.wait()
        guard = current().guard
        if guard is not None:
            guard.after()
        if self.where.recorder is not None:
            _log(self.where, self.direction, ALL_TO_ALL, self.send_P, self.send_RD, 0.0, self.wait_s,
                 seconds=between(self.start, mark()))
        return self.out_RD


def start_all_to_all(x_RD: torch.Tensor, send_P: list, recv_P: list, ep: EPGroup, where: Exchange,
                     direction: str = "forward") -> PendingExchange:
    """Starts a variable-split all-to-all (not differentiable: a pipelined schedule's own
    autograd function calls it in both passes) and returns at once; the caller computes,
    then :meth:`PendingExchange.wait` s. Logged like :func:`all_to_all_rows`, its time
    being the interval from start to the end of the wait."""
    send_P, recv_P = [int(s) for s in send_P], [int(r) for r in recv_P]
    rec = where.recorder
    wait = barrier(ep) if rec is not None and rec.sync_collectives else 0.0
    guard = current().guard
    if guard is not None:
        guard.before()
    start = mark()
    x_RD = x_RD.detach().contiguous()
    out = x_RD.new_empty((sum(recv_P),) + tuple(x_RD.shape[1:]))
    work = None
    if ep.local_only:
        out.copy_(x_RD)
    else:
        work = dist.all_to_all_single(out, x_RD, recv_P, send_P, group=ep.group, async_op=True)
    return PendingExchange(out, work, send_P, where, direction, x_RD, start, wait)
