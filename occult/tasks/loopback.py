"""This machine's loopback inside a world of P ranks, the inputs of the cost model (what
task=calibrate measures, and task=layer with ``task.calibrate=true``).

Equal-split ``all_to_all_single`` calls at a few message sizes (each after a
burst of compute and a barrier, as in a layer: with more ranks than cores a
rank that computed up to the barrier is often descheduled when the collective
starts, which a tight loop of collectives would miss), then the shared grouped
SwiGLU experts at two row counts, all ranks at once. :mod:`analysis.calibration`
fits a latency/bandwidth line and a matmul rate to these rows.

Runs as its own sweep point (``task=calibrate``: :mod:`occult.tasks.calibrate`; ``python run.py
experiment=calibrate`` fits a profile from P = 2, 4, 8) or inside a ``task=layer`` run
(``task.calibrate=true``), right before the timed iterations, so that the check of the
cost model sees the load its measurements saw.

Rows: ``calib_bytes`` (bytes per rank of size index ``layer``),
``calib_a2a_time`` (ms, per rank and repetition), ``calib_expert_rows``,
``calib_local_experts``, ``calib_expert_hidden`` and ``calib_expert_ffn`` (the
experts' D and F) and ``calib_expert_time`` (ms, per rank, of row-count index
``layer``).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ..ep.measure import barrier, clock
from ..records import row

# bytes each rank sends to the other ranks together per call (the range task=layer moves:
# 1 KiB rows, up to K x T = 4096 rows per rank), split equally over the peers
RANK_BYTES = (0, 64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20)
HIDDEN, FFN, EXPERTS = 256, 128, 64      # task=layer's default width (layer_small)
EXPERT_ROWS = (512, 4096)               # rows per rank: T x K for K = 1 and 8 at T = 512
# compute before each timed collective, cycled over the repetitions: in a layer a collective
# follows anything from a permutation (well under 1 ms) to the experts (tens of ms), and with
# more ranks than cores the time a collective takes depends on how long its ranks computed
WORK_MS = (0.5, 2.0, 5.0, 20.0)


def _sent_bytes(rank_bytes: int, world_size: int) -> int:
    """Bytes a rank really sends for a target of ``rank_bytes`` (whole float32 values per peer)."""
    return rank_bytes // 4 // max(world_size - 1, 1) * 4 * (world_size - 1)


def _busy(ms: float, a_NN: torch.Tensor) -> None:
    """Matmuls for ``ms`` milliseconds (the compute a layer does between collectives)."""
    end = clock() + ms / 1e3
    while clock() < end:
        a_NN @ a_NN


def _time_a2a(ctx, rank_bytes: int, reps: int, work_ms=WORK_MS) -> list[float]:
    """Seconds of ``reps`` equal-split all-to-alls sending ``rank_bytes`` to the peers together,
    each after compute (``work_ms``: milliseconds, or a sequence cycled over the calls) and a
    barrier."""
    P = ctx.world_size
    n = rank_bytes // 4 // max(P - 1, 1)
    send = torch.randn(n * P, device=ctx.device)
    recv = torch.empty(n * P, device=ctx.device)
    a_NN = torch.randn(128, 128, device=ctx.device)
    work = tuple(work_ms) if isinstance(work_ms, (tuple, list)) else (work_ms,)
    out = []
    for i in range(reps + 1):                         # one warm-up call
        _busy(work[(i - 1) % len(work)], a_NN)
        barrier(ctx.ep)
        t0 = clock()
        dist.all_to_all_single(recv, send, [n] * P, [n] * P, group=ctx.ep.group)
        out.append(clock() - t0)
    return out[1:]


def _grouped_seconds(local_experts: int, rows: int, reps: int, device="cpu") -> float:
    """Median seconds of the shared grouped SwiGLU experts (occult.ep.experts) on ``rows``
    rows spread evenly over ``local_experts`` experts."""
    from ..ep.experts import grouped_swiglu
    g = torch.Generator(device="cpu").manual_seed(0)
    e = local_experts
    x, wg, wu, wd = (torch.randn(*shape, generator=g, device="cpu").to(device)
                     for shape in ((rows, HIDDEN), (e, HIDDEN, FFN), (e, HIDDEN, FFN), (e, FFN, HIDDEN)))
    counts = torch.full((e,), rows // e, dtype=torch.long, device=device)
    counts[: rows - int(counts.sum())] += 1
    took = []
    for _ in range(reps + 1):
        t0 = clock()
        grouped_swiglu(x, counts, wg, wu, wd)
        took.append(clock() - t0)
    return float(np.median(took[1:]))


def calibration_rows(ctx, sizes=RANK_BYTES, reps: int = 8) -> list:
    """On every rank: all-to-all times per size, then the expert matmul rate (all ranks at once)."""
    rows = []
    for i, size in enumerate(sizes):
        if ctx.rank == 0:
            rows.append(row("calib_bytes", _sent_bytes(size, ctx.world_size), "bytes", layer=i))
        for s, sec in enumerate(_time_a2a(ctx, size, reps)):
            rows.append(row("calib_a2a_time", sec * 1e3, "ms", layer=i, rank=ctx.rank, sample=s))
    barrier(ctx.ep)
    e = max(EXPERTS // ctx.world_size, 1)
    for i, n in enumerate(EXPERT_ROWS):
        if ctx.rank == 0:
            rows.append(row("calib_expert_rows", n, "rows", layer=i))
            rows.append(row("calib_local_experts", e, "experts", layer=i))
            rows.append(row("calib_expert_hidden", HIDDEN, "D", layer=i))
            rows.append(row("calib_expert_ffn", FFN, "F", layer=i))
        rows.append(row("calib_expert_time", _grouped_seconds(e, n, reps, ctx.device) * 1e3, "ms", layer=i, rank=ctx.rank))
    return rows
