"""system=scmoe: ScMoE's overlapped schedule (harness implementation, from the paper,
arXiv 2404.05019; it has no public code).

In a shortcut-connected model (:mod:`occult.models.shortcut`, ``model=scmoe_proxy``) the
routed experts of MoE block l read block l-1's representation, so block l's dispatch can
start as soon as that representation exists, one block early. This system's exchange is
naive EP's (counts, one row per (token, expert) pair, the reverse all-to-all, the
gate-weighted sum at home), cut in two:

  start_moe   route -> counts (a blocking exchange of [P, e] ints) -> the dispatch's
              asynchronous all-to-all, left in flight (called in block l-1, right after
              its representation is computed)
  (the start is timed as the span ``dispatch``: the counts and launching the all-to-all)
  finish_moe  wait for the rows (the time this wait blocks is the span ``exposed_comm``:
              communication that block l-1's remaining work and block l's attention and
              shared expert did not hide), the experts, the combine (blocking)

The backward runs the dispatch's transposed all-to-all when the received rows' gradients
are ready (not overlapped). Outside a shortcut-connected model (layer tasks, the parity
suite, a standard model) ``dispatch`` is start then wait at once: naive EP through the
same code. Exact top-k MoE; the overlapped model equals the same model run step by step
(tests/test_models.py).

Shapes: T tokens, K top-k, D hidden, P ranks, e local experts, R rows sent, Q received.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from occult.ep import Exchange, SystemConfig, exchange_counts
from occult.ep.accounting import backward_span, span
from occult.ep.comm import PendingExchange, start_all_to_all
from occult.ep.measure import between, mark
from occult.ep.permute import expert_major_order, gather_rows, inverse_permutation, sort_pairs_by_destination

from .naive import NaiveDispatcher, NaiveHandle
from occult.ep.capabilities import Capabilities


@dataclass(frozen=True)
class Started:
    """A dispatch in flight: the rows sent (their gradient comes back through them), the
    pending all-to-all, how to group what arrives, and what the combine needs."""

    rows_RD: torch.Tensor
    pending: PendingExchange
    perm_Q: torch.Tensor
    counts_e: torch.Tensor
    handle: NaiveHandle


class _Arrived(torch.autograd.Function):
    """The rows of a started dispatch, once they arrive: forward waits for them; backward
    sends their gradients back along the transposed splits."""

    @staticmethod
    def forward(ctx, rows_RD, pending: PendingExchange, handle: NaiveHandle, ep):
        ctx.handle, ctx.ep = handle, ep
        return pending.wait()

    @staticmethod
    def backward(ctx, grad_QD):
        h = ctx.handle
        back = start_all_to_all(grad_QD, h.recv_P, h.send_P, ctx.ep, Exchange(h.layer, "dispatch", h.recorder),
                                "backward")
        return back.wait(), None, None, None


class ScMoEDispatcher(NaiveDispatcher):
    """Naive EP's exchange with its dispatch startable ahead of the layer (``start_moe`` /
    ``finish_moe``) for a shortcut-connected model's overlapped schedule."""

    capabilities = Capabilities(
        impl="harness", precision="float64", expert_parallel=True, exact_forward=True, exact_backward=True,
        static_dispatch="it has no fixed-buffer dispatch (only naive EP's and Occult's exchanges have one)",
        co_execution=True,
        yields=True,
        traffic_plan=True,
        migration=True,
        replica_rules=(), payloads=("fp32",), dropped_pairs=False,
        shortcut_overlap=True)

    @dataclass
    class Config(SystemConfig):
        def payload_of(self, phase: str) -> str:
            """Rows cross as they are (naive's combine asks)."""
            return "fp32"

    def start_moe(self, x_TD, topk_ids_TK, topk_weights_TK, *, layer=0, recorder=None) -> Started:
        """Counts, then the dispatch's all-to-all started and left in flight."""
        K = topk_ids_TK.shape[1]
        order_R, send_Pe = sort_pairs_by_destination(topk_ids_TK, self.placement)
        recv_Pe = exchange_counts(send_Pe, self.ep, Exchange(layer, "counts", recorder))
        # device-to-host sync: split sizes go to the collective as Python ints
        send_P, recv_P = send_Pe.sum(1).tolist(), recv_Pe.sum(1).tolist()
        token_R = order_R // K
        rows_RD = gather_rows(x_TD, token_R)
        pending = start_all_to_all(rows_RD, send_P, recv_P, self.ep, Exchange(layer, "dispatch", recorder))
        perm_Q = expert_major_order(recv_Pe)
        handle = NaiveHandle(token_R, topk_weights_TK.flatten()[order_R], inverse_permutation(perm_Q),
                             send_P, recv_P, x_TD.shape[0], layer, recorder)
        return Started(rows_RD, pending, perm_Q, recv_Pe.sum(0), handle)

    def arrived(self, started: Started) -> torch.Tensor:
        """The started dispatch's rows, grouped by local expert (waits). [Q, D]."""
        got_QD = _Arrived.apply(started.rows_RD, started.pending, started.handle, self.ep)
        return gather_rows(got_QD, started.perm_Q)

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK, *, layer=0, recorder=None):
        started = self.start_moe(x_TD, topk_ids_TK, topk_weights_TK, layer=layer, recorder=recorder)
        return self.arrived(started), started.counts_e, started.handle

    def finish_moe(self, started: Started, experts) -> torch.Tensor:
        """Wait (timed: ``exposed_comm``), experts, combine: [T, D]."""
        rec, layer = started.handle.recorder, started.handle.layer
        t0 = mark()
        routed_QD = self.arrived(started)
        if rec is not None:
            rec.log_span(layer, "exposed_comm", "forward", between(t0, mark()))
        with span(rec, layer, "experts"):
            y_QD = self.run_experts(experts, routed_QD, started.counts_e, started.handle)
        backward_span(rec, layer, "experts", routed_QD, y_QD)
        with span(rec, layer, "combine"):
            return self.combine(y_QD, started.handle)
