"""Communication accounting and phase timing, taken from what really happened.

A :class:`Recorder` is handed to a layer call; every collective that a
dispatcher runs through :mod:`occult.ep.comm` logs the split sizes it passed to
the collective (rows and bytes per source and destination rank, per layer,
phase and pass) and how long it took. Routing metrics (C_T, intra-collaboration
ratio) are computed from the top-k ids and the placement, by pure functions.

Shapes: T tokens, K top-k, E experts, P devices.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from .context import current, entered
from .measure import Interval, between, clock, mark
from .placement import Placement
from .strands import current_strand


@dataclass(frozen=True)
class CommEvent:
    """One collective seen from one rank: what it sent to each peer."""

    layer: int
    phase: str            # e.g. "dispatch", "combine", "counts", "dispatch_meta"
    direction: str        # "forward" or "backward"
    src_rank: int
    rows_P: tuple         # rows sent to each destination rank
    row_bytes: int        # bytes per row
    seconds: float        # the collective itself (an Interval of marks until Recorder.settle reads it)
    wait_seconds: float = 0.0   # barrier before it (only with Recorder.sync_collectives)
    meta_row_bytes: int = 0     # of row_bytes, the metadata riding with each row
    raw_seconds: float = -1.0   # the same exchange as a plain all_to_all_single (Recorder.raw_replay)
    collective: str = "all_to_all"   # all_to_all | all_gather | reduce_scatter | broadcast | reduce
    # of rows_P, the valid rows (a fixed buffer's: the rest is padding); None: every row is
    # valid. A device tensor until Recorder.settle reads it, after the step
    valid_P: object = None


@dataclass
class Recorder:
    """Collects :class:`CommEvent` s and timed spans during layer calls.

    It is the one mutable object of a measurement; layers and dispatchers keep
    no per-call state of their own.
    """

    rank: int = 0
    # barrier before every collective, timed apart, so that a2a times measure the
    # transfer and not the wait for the slowest peer (adds a barrier per collective)
    sync_collectives: bool = False
    # after each collective, the same split sizes again as a plain all_to_all_single (timed
    # apart, after a barrier): the harness's own overhead per collective (benchmarks only)
    raw_replay: bool = False
    # time spans and collectives between device marks (CUDA events; the host clock on a CPU
    # rank), read after the step by settle, instead of the synchronised clock: a static step's
    # timing, which may not wait for the device (occult.ep.static, occult.ep.host_sync)
    marks: bool = False
    comm: list = field(default_factory=list)
    spans: list = field(default_factory=list)     # (layer, name, direction, seconds)
    routing: list = field(default_factory=list)   # (layer, topk_ids_TK, weights_TK, logits_TE)
    counters: list = field(default_factory=list)  # (layer, name, value), from Dispatcher.stats

    def log_collective(self, *, layer: int, phase: str, direction: str, rows_P, row_bytes: int,
                       seconds: float, wait_seconds: float = 0.0, meta_row_bytes: int = 0,
                       raw_seconds: float = -1.0, collective: str = "all_to_all", valid_P=None) -> None:
        """``valid_P``: of ``rows_P``, the valid rows, as a device tensor (kept as it is: read on
        the host by :meth:`settle`, after the step) or host integers; ``seconds``: a float, or an
        :class:`~occult.ep.measure.Interval` of marks (read by :meth:`settle`)."""
        seconds = seconds if isinstance(seconds, Interval) else float(seconds)
        self.comm.append(CommEvent(layer, phase, direction, self.rank, tuple(int(r) for r in rows_P),
                                   int(row_bytes), seconds, float(wait_seconds), int(meta_row_bytes),
                                   float(raw_seconds), collective, valid_P))

    def now(self):
        """The start of something this recorder times: a mark (:attr:`marks`) or the clock."""
        return mark() if self.marks else clock()

    def since(self, start):
        """The time from ``start`` (:meth:`now`) to here: seconds, or with :attr:`marks` an
        :class:`~occult.ep.measure.Interval` that :meth:`settle` reads."""
        return Interval(start, mark()) if self.marks else clock() - start

    def settle(self) -> None:
        """Reads what the step left on the device, after it, off its critical path: the
        intervals between marks (:attr:`marks`) and the valid-row counts of fixed buffers
        (:func:`occult.ep.comm.all_to_all_fixed`, all in one copy).
        :func:`occult.tasks.common.timing_rows` and :func:`~occult.tasks.common.comm_rows` call it."""
        read = lambda s: s.seconds() if isinstance(s, Interval) else s
        self.spans[:] = [(layer, name, direction, read(s)) for layer, name, direction, s in self.spans]
        self.comm[:] = [replace(ev, seconds=read(ev.seconds)) if isinstance(ev.seconds, Interval) else ev
                        for ev in self.comm]
        pending = [i for i, ev in enumerate(self.comm) if torch.is_tensor(ev.valid_P)]
        if not pending:
            return
        counts = torch.stack([self.comm[i].valid_P.long() for i in pending]).cpu().tolist()
        for i, valid in zip(pending, counts):
            self.comm[i] = replace(self.comm[i], valid_P=tuple(int(v) for v in valid))

    def log_span(self, layer: int, name: str, direction: str, seconds: float) -> None:
        """A timed span measured by the caller (e.g. a pipelined schedule's time not hidden by
        compute: the time of its chunk loop minus the expert spans inside it)."""
        self.spans.append((layer, name, direction, float(seconds)))

    @contextmanager
    def span(self, layer: int, name: str, direction: str = "forward"):
        """Times the enclosed block on this rank (:meth:`now` and :meth:`since`: the clock, or
        marks; in a co-executed strand between marks, read once every strand has ended: the
        span then holds the turns the other strands took inside it, :mod:`occult.ep.strands`)."""
        strand = current_strand()
        t0 = mark() if strand is not None else self.now()
        try:
            yield
        finally:
            if strand is not None:
                end = mark()
                strand.later(lambda: self.spans.append((layer, name, direction, between(t0, end))))
            else:
                self.spans.append((layer, name, direction, self.since(t0)))

    def log_counter(self, layer: int, name: str, value: float) -> None:
        self.counters.append((layer, name, float(value)))

    def log_routing(self, layer: int, topk_ids_TK: torch.Tensor, topk_weights_TK=None, logits_TE=None) -> None:
        """Keeps the layer's top-k ids (and, when given, gate weights and router logits)."""
        keep = lambda t: None if t is None else t.detach().clone()
        self.routing.append((layer, keep(topk_ids_TK), keep(topk_weights_TK), keep(logits_TE)))

    def clear(self) -> None:
        self.comm.clear()
        self.spans.clear()
        self.routing.clear()
        self.counters.clear()


@contextmanager
def recording(recorder: "Recorder | None"):
    """Makes ``recorder`` the active one for layers called without an explicit recorder
    (whole models, whose forward signature the harness does not own): the run context's
    ``recorder`` (:func:`occult.ep.context.entered`)."""
    with entered(recorder=recorder):
        yield recorder


def active_recorder() -> "Recorder | None":
    """The run context's recorder (None: nothing records)."""
    return current().recorder


def span(recorder: "Recorder | None", layer: int, name: str, direction: str = "forward"):
    """``recorder.span(...)``, or a no-op when there is no recorder."""
    return nullcontext() if recorder is None else recorder.span(layer, name, direction)


def backward_span(recorder: "Recorder | None", layer: int, name: str, inputs, output: torch.Tensor) -> None:
    """Times the backward of the block that made ``output`` from ``inputs`` (a tensor or a
    dataclass of tensors, e.g. rows handed over unmaterialised): from the moment the
    output's gradient is ready to the moment every input that needs one has its own,
    logged as span ``(layer, name, "backward")``. Tensor hooks, registered on this call's
    tensors (nothing is kept on the recorder until the backward runs); a no-op without a
    recorder or when nothing needs a gradient."""
    if recorder is None or not output.requires_grad:
        return
    if isinstance(inputs, torch.Tensor):
        tensors = [inputs]
    else:
        tensors = [getattr(inputs, f) for f in getattr(inputs, "__dataclass_fields__", {})]
    waiting = [t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad]
    if not waiting:
        return
    started: list = []
    left = [len(waiting)]

    def start(grad):
        started.append(recorder.now())

    def end(grad):
        left[0] -= 1
        if left[0] == 0 and started:
            recorder.spans.append((layer, name, "backward", recorder.since(started[0])))

    output.register_hook(start)
    for t in waiting:
        t.register_hook(end)


def devices_per_token(topk_ids_TK: torch.Tensor, placement: Placement, home_T=None) -> torch.Tensor:
    """Distinct devices among each token's top-k experts: shape [T] (long; dropped pairs,
    id -1, count for no device; on a slot placement the device of the copy that serves the
    pair, its replica rule counted per sending rank ``home_T``). Sorts each token's K devices
    and counts the changes: no [T, P] table, so a world of a million tokens over 256 devices
    costs O(T K)."""
    return _distinct_devices(topk_ids_TK, placement, home_T)[0]


def _distinct_devices(topk_ids_TK: torch.Tensor, placement: Placement, home_T=None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(distinct_T, dev_TK)``: each token's distinct devices (long [T]) and the device of each
    of its pairs (long [T, K], -1 for a dropped pair)."""
    keep_TK = topk_ids_TK >= 0
    dev_TK = torch.where(keep_TK, placement.pair_devices(topk_ids_TK, home_T), -1)
    if dev_TK.shape[1] == 0:
        return torch.zeros(dev_TK.shape[0], dtype=torch.long, device=dev_TK.device), dev_TK
    sorted_TK = dev_TK.sort(dim=1).values
    first_T = (sorted_TK[:, 0] >= 0).long()
    changes_T = ((sorted_TK[:, 1:] != sorted_TK[:, :-1]) & (sorted_TK[:, 1:] >= 0)).sum(1)
    return first_T + changes_T, dev_TK


def device_hits(topk_ids_TK: torch.Tensor, placement: Placement, home_T=None) -> torch.Tensor:
    """hit_TP[t, p]: token t has at least one of its top-k experts on device p (bool [T, P];
    dropped pairs, id -1, hit nothing). On a slot placement a pair hits the device of the
    copy that serves it (its replica rule, counted per sending rank ``home_T``)."""
    T, K = topk_ids_TK.shape
    dev = topk_ids_TK.device
    hit_TP = torch.zeros(T, placement.num_devices, dtype=torch.bool, device=dev)
    keep_TK = topk_ids_TK >= 0
    tok_TK = torch.arange(T, device=dev).unsqueeze(1).expand(T, K)
    hit_TP[tok_TK[keep_TK], placement.pair_devices(topk_ids_TK, home_T)[keep_TK]] = True
    return hit_TP


@dataclass(frozen=True)
class TokenDevices:
    """Per token, what C_T and the intra-collaboration ratio are made of ([T] each, long):
    distinct devices among its top-k experts, those other than its home device, ordered
    pairs of its kept (non-dropped) experts on one device, and ordered pairs of kept experts."""

    distinct_T: torch.Tensor
    remote_T: torch.Tensor
    same_pairs_T: torch.Tensor
    pairs_T: torch.Tensor

    def ct_all(self) -> float:
        return self.distinct_T.float().mean().item() if self.distinct_T.numel() else float("nan")

    def ct_remote(self) -> float:
        return self.remote_T.float().mean().item() if self.remote_T.numel() else float("nan")

    def intra_ratio(self) -> float:
        pairs = int(self.pairs_T.sum())
        return int(self.same_pairs_T.sum()) / pairs if pairs else float("nan")

    def rows(self, start: int, stop: int) -> "TokenDevices":
        """The tokens ``[start, stop)``."""
        return TokenDevices(self.distinct_T[start:stop], self.remote_T[start:stop], self.same_pairs_T[start:stop],
                            self.pairs_T[start:stop])


def token_devices(topk_ids_TK: torch.Tensor, placement: Placement, home_T: Optional[torch.Tensor] = None
                  ) -> TokenDevices:
    """:class:`TokenDevices` of tokens ``topk_ids_TK`` (dropped pairs, id -1, count for nothing)
    whose home devices are ``home_T`` (None: remote counts are the distinct counts; a slot
    placement's replica rule then counts every pair as one sender's). O(T K) small operations,
    no [T, P] table."""
    distinct_T, dev_TK = _distinct_devices(topk_ids_TK, placement, home_T)
    T, K = dev_TK.shape
    remote_T = distinct_T
    if home_T is not None:
        remote_T = distinct_T - (dev_TK == home_T.to(dev_TK.device).unsqueeze(1)).any(1).long()
    kept_T = (dev_TK >= 0).sum(1)
    # experts of a token per device: lengths of the runs of equal devices in its sorted row
    sorted_TK = dev_TK.sort(dim=1).values
    starts_TK = torch.ones_like(sorted_TK, dtype=torch.bool)
    starts_TK[:, 1:] = sorted_TK[:, 1:] != sorted_TK[:, :-1]
    run_TK = starts_TK.long().cumsum(1) - 1 + torch.arange(T, device=dev_TK.device).unsqueeze(1) * K
    count_R = torch.bincount(run_TK.flatten(), weights=(sorted_TK >= 0).flatten().double(), minlength=T * K)
    same_T = (count_R * (count_R - 1)).view(T, K).sum(1).round().long()
    return TokenDevices(distinct_T, remote_T, same_T, kept_T * (kept_T - 1))


def ct_all(topk_ids_TK: torch.Tensor, placement: Placement, home_T=None) -> float:
    """C_T counting the copy a token sends to its own device: mean distinct devices per token
    (``home_T``: each token's rank, read only by a slot placement's replica rule)."""
    if topk_ids_TK.shape[0] == 0:
        return float("nan")
    return devices_per_token(topk_ids_TK, placement, home_T).float().mean().item()


def ct_remote(topk_ids_TK: torch.Tensor, placement: Placement, home_T: torch.Tensor) -> float:
    """C_T without the home device: mean distinct *other* devices per token.

    ``home_T`` is each token's home device (the rank it lives on).
    """
    return token_devices(topk_ids_TK, placement, home_T).ct_remote()


def intra_ratio(topk_ids_TK: torch.Tensor, placement: Placement, home_T=None) -> float:
    """Share of co-activated expert pairs (same token) hosted on the same device."""
    if topk_ids_TK.shape[0] == 0 or topk_ids_TK.shape[1] < 2:
        return float("nan")
    return token_devices(topk_ids_TK, placement, home_T).intra_ratio()


def ct_bounds(num_experts: int, top_k: int, world_size: int) -> tuple[int, int]:
    """Occult Eq. 5: ceil(K*P/E) <= C_T <= min(K, P)."""
    return -(-top_k * world_size // num_experts), min(top_k, world_size)
