"""system=pipelined: a layer's dispatch -> experts -> combine cut into chunks that overlap.

PipeMoE's adaptive pipelining, FasterMoE's smart schedule and EPS-MoE's chunked prefill:
this rank's tokens are split into r chunks (``degree``); chunk i's experts run while the
other chunks' all-to-alls are in flight (asynchronous collectives), forward and backward.

  plan      ``counts``: one exchange of the per-(chunk, destination, local expert) pair
            counts [P, r e]; with ``degree=auto`` first ``pipeline_plan``, an all-gather of
            every rank's per-destination row counts, so that every rank picks the same r
  schedule  dispatch(0); then for each chunk i: wait for dispatch(i), start dispatch(i+1),
            run chunk i's experts, start combine(i); at the end wait for the combines. Every
            rank issues the collectives in the same order (d0 d1 c0 d2 c1 ... ); backward runs
            the transposed schedule (each chunk's gradients come back while the previous
            chunk's expert backward runs, and its input gradients leave while the next runs)
  combine   gate-weighted sum at home, as naive EP (one row per (token, expert))

``degree=auto`` picks r in (1, 2, 4, 8) with PipeMoE's alpha-beta rule
(:func:`occult.ep.links.pipeline_seconds`): a chunk's all-to-all costs ``alpha + beta x
bytes / r`` (latency and bandwidth of the profile named by ``profile``, the busiest rank's
bytes), its experts ``rows x 6 D F / (r x FLOPs)`` plus the profile's per-expert call
overhead, and r minimises ``d + e + c + (r - 1) max(d + c, e)``. More chunks hide more of
the exchange behind compute but pay the latency and the per-expert overhead r times, so
the rule picks r > 1 only where compute and communication are of the same size.

Reported: a span ``exposed_comm`` per layer (the chunk loop's time minus the expert spans
in it: communication that compute did not hide), beside ``dispatch``, ``experts`` and
``combine``; counters ``pipeline_degree`` (chunks) and ``pipeline_calls``. The
collectives' ``a2a_time`` is the time from start to the end of the wait (in flight, overlapped with compute). On this machine's 2
shared cores there is little to overlap with: gloo moves the bytes with the same cores
that run the experts, so the measured overlap is an upper bound of nothing much (see the
README); the cost model projects it onto GPU profiles with the same pipeline model.

Exact top-k MoE: the chunks are a partition of the (token, expert) pairs.

Shapes: T tokens, K top-k, D hidden, F expert FFN, P ranks, e local experts, r chunks,
R rows sent (all chunks, chunk-major then destination, local expert), Q rows received by
one chunk, grouped by local expert.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from occult.ep import Dispatcher, Exchange, Recorder, SystemConfig, exchange_counts
from occult.ep.accounting import span
from occult.ep.comm import ALL_GATHER, all_gather_rows, start_all_to_all
from occult.ep.plan import RowShape, metadata_sends, returned, sends
from occult.ep.experts import grouped_swiglu
from occult.ep.links import Link, pipeline_seconds
from occult.ep.profiles import link_at
from occult.ep.measure import between, mark
from occult.ep.permute import expert_major_order, gather_rows, inverse_permutation, weighted_scatter_add
from occult.ep.capabilities import Capabilities

DEGREES = ("1", "2", "4", "auto")
AUTO_DEGREES = (1, 2, 4, 8)


@dataclass(frozen=True)
class ChunkPlan:
    """The splits of every chunk (host lists), its expert-major order on the receiver and its
    per-expert counts."""

    send_P: tuple          # per chunk: rows to each rank
    recv_P: tuple          # per chunk: rows from each rank
    perm_Q: tuple          # per chunk: received (source-major) rows -> expert-major
    counts_e: tuple        # per chunk: rows per local expert (host tensors: split sizes)
    ep: object
    layer: int
    recorder: Optional[Recorder]
    training: bool

    @property
    def degree(self) -> int:
        return len(self.send_P)


def auto_degree(rows_PP: torch.Tensor, link: Link, row_bytes: int, hidden: int, ffn: int, local_experts: int) -> int:
    """PipeMoE's alpha-beta choice of the number of chunks for one layer, from every rank's
    rows to every rank ``rows_PP`` (the same on every rank, so every rank picks the same)."""
    remote_PP = rows_PP.double() * (1 - torch.eye(rows_PP.shape[0], dtype=torch.float64, device=rows_PP.device))
    busiest = float(torch.maximum(remote_PP.sum(0), remote_PP.sum(1)).max()) * row_bytes
    expert_rows = float(rows_PP.sum(0).max())
    best, best_r = float("inf"), 1
    for r in AUTO_DEGREES:
        a2a = link.latency_s + busiest / r / link.slowest_Bps
        experts = expert_rows * 6.0 * hidden * ffn / r / link.flops + local_experts * link.expert_call_s
        t = pipeline_seconds(a2a, experts, a2a, r)
        if t < best:
            best, best_r = t, r
    return best_r


class _PipelinedExperts(torch.autograd.Function):
    """Rows in send order (all chunks) -> the experts' outputs back in send order, each chunk's
    exchange overlapping the other chunks' expert compute, forward and backward."""

    @staticmethod
    def forward(ctx, x_RD, w_gate, w_up, w_down, plan: ChunkPlan):
        ctx.plan = plan
        weights = [w.detach().requires_grad_(plan.training) for w in (w_gate, w_up, w_down)]
        ctx.leaves, ctx.outputs, ctx.weights = [], [], weights
        rec, layer, r = plan.recorder, plan.layer, plan.degree
        chunks = torch.split(x_RD.detach(), [sum(s) for s in plan.send_P])
        start = lambda c, rows: start_all_to_all(rows, plan.send_P[c], plan.recv_P[c], plan.ep,
                                                 Exchange(layer, "dispatch", rec))
        # marks, not clock reads: a synchronising read would wait for the collectives too
        t0, computing = mark(), []
        pending, back = [start(0, chunks[0])], []
        for c in range(r):
            got_RD = pending[c].wait()
            if c + 1 < r:
                pending.append(start(c + 1, chunks[c + 1]))
            t1 = mark()
            y_QD = _chunk_experts(ctx, got_RD, weights, plan, c)
            computing.append((t1, mark()))
            back.append(start_all_to_all(gather_rows(y_QD, inverse_permutation(plan.perm_Q[c])), plan.recv_P[c],
                                         plan.send_P[c], plan.ep, Exchange(layer, "combine", rec)))
        out_RD = torch.cat([p.wait() for p in back])
        if rec is not None:
            expert_s = sum(between(a, b) for a, b in computing)
            rec.log_span(layer, "experts", "forward", expert_s)
            rec.log_span(layer, "exposed_comm", "forward", between(t0, mark()) - expert_s)
        return out_RD

    @staticmethod
    def backward(ctx, grad_RD):
        plan = ctx.plan
        rec, layer, r = plan.recorder, plan.layer, plan.degree
        grads = torch.split(grad_RD.contiguous(), [sum(s) for s in plan.send_P])
        start = lambda c, rows: start_all_to_all(rows, plan.send_P[c], plan.recv_P[c], plan.ep,
                                                 Exchange(layer, "combine", rec), "backward")
        pending, back = [start(0, grads[0])], []
        weight_grads = [torch.zeros_like(w) for w in ctx.weights]
        for c in range(r):
            g_RD = pending[c].wait()
            if c + 1 < r:
                pending.append(start(c + 1, grads[c + 1]))
            g_x, *g_w = torch.autograd.grad(ctx.outputs[c], [ctx.leaves[c], *ctx.weights],
                                             gather_rows(g_RD, plan.perm_Q[c]), allow_unused=True)
            for acc, g in zip(weight_grads, g_w):
                if g is not None:
                    acc += g
            back.append(start_all_to_all(g_x, plan.recv_P[c], plan.send_P[c], plan.ep,
                                         Exchange(layer, "dispatch", rec), "backward"))
        ctx.outputs = ctx.leaves = None
        return (torch.cat([p.wait() for p in back]), *weight_grads, None)


def _chunk_experts(ctx, got_RD: torch.Tensor, weights: list, plan: ChunkPlan, c: int) -> torch.Tensor:
    """Chunk c's experts on its received rows: [Q, D] in expert-major order (its graph kept for
    the backward when training)."""
    with torch.enable_grad() if plan.training else torch.no_grad():
        leaf_RD = got_RD.requires_grad_(plan.training)
        y_QD = grouped_swiglu(gather_rows(leaf_RD, plan.perm_Q[c]), plan.counts_e[c], *weights)
    if plan.training:
        ctx.leaves.append(leaf_RD)
        ctx.outputs.append(y_QD)
    return y_QD.detach()


class PipelinedDispatcher(Dispatcher):
    """``degree``: chunks per layer (``1``, ``2``, ``4`` or ``auto``); ``profile``: the machine
    whose links and throughput ``auto``'s rule weighs."""

    capabilities = Capabilities(
        impl="harness", precision="float64", expert_parallel=True, exact_forward=True, exact_backward=True,
        static_dispatch="it has no fixed-buffer dispatch (only naive EP's and Occult's exchanges have one)",
        co_execution=("its chunks already overlap the layer's exchanges with its experts, through collectives of "
                      "its own that a strand does not hand over, and its exposed_comm spans would join the strands'"),
        yields=True,
        traffic_plan=True,
        migration=True,
        replica_rules=(), payloads=("fp32",), dropped_pairs=False,
        shortcut_overlap=False)

    @dataclass
    class Config(SystemConfig):
        degree: str = "auto"             # 1 | 2 | 4 | auto (PipeMoE's alpha-beta rule)
        # the machine the auto rule assumes (a conf/profile name or YAML): the paper's
        # 4 x RTX A6000 by default; sim_cpu_loopback is this machine (P = 2, 4, 8)
        profile: str = "sim_a6000x4"

        def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
            super().check(num_experts=num_experts, top_k=top_k, world_size=world_size)
            if str(self.degree) not in DEGREES:
                raise ValueError(f"system.degree={self.degree!r}: allowed values are {list(DEGREES)}")
            if self.degree == "auto":
                try:
                    link_at(self.profile, world_size)
                except (FileNotFoundError, ValueError) as exc:
                    raise ValueError(f"system.profile={self.profile!r}: {exc}") from exc

    def _pair_keys(self, topk_ids_TK: torch.Tensor) -> torch.Tensor:
        """Each (token, k) pair's (destination, local slot) key [T*K]."""
        pl = self.placement
        return (pl.device_E[topk_ids_TK] * pl.num_local + pl.slot_E[topk_ids_TK]).flatten()

    def plan_facts(self, topk_ids_TK, topk_weights_TK):
        """``degree=auto``: this rank's rows to every rank [P] (what the rule weighs); else None."""
        if self.config.degree != "auto":
            return None
        return torch.bincount(self._pair_keys(topk_ids_TK) // self.placement.num_local, minlength=self.ep.world_size)

    def _degree_of(self, rows_PP: Optional[torch.Tensor], shape: RowShape) -> int:
        """The number of chunks: the configured one, or PipeMoE's choice from every rank's rows
        to every rank (:meth:`plan_facts` of every rank)."""
        if self.config.degree != "auto":
            return int(self.config.degree)
        return auto_degree(rows_PP, link_at(self.config.profile, self.ep.world_size), shape.bytes_of(shape.hidden),
                           shape.hidden, shape.ffn, self.placement.num_local)

    def _degree(self, topk_ids_TK: torch.Tensor, shape: RowShape, layer: int, rec) -> int:
        """The number of chunks, from every rank's per-destination rows (an all-gather, so
        every rank decides alike) when ``degree=auto``."""
        ep, rows_P = self.ep, self.plan_facts(topk_ids_TK, None)
        rows_PP = None if rows_P is None else all_gather_rows(
            rows_P.view(1, -1), [1] * ep.world_size, ep, Exchange(layer, "pipeline_plan", rec, metadata=True))
        return self._degree_of(rows_PP, shape)

    def _chunks(self, topk_ids_TK: torch.Tensor, degree: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pairs' keys in (chunk, destination, local slot) order [T*K] and their counts
        [r, P, e]: the chunks are ``degree`` runs of this rank's tokens."""
        T, K = topk_ids_TK.shape
        P, e = self.ep.world_size, self.placement.num_local
        chunk_R = (torch.arange(T, device=topk_ids_TK.device) * degree // max(T, 1)).repeat_interleave(K)
        key_R = chunk_R * (P * e) + self._pair_keys(topk_ids_TK)
        return key_R, torch.bincount(key_R, minlength=degree * P * e).view(degree, P, e)

    def plan(self, topk_ids_TK, topk_weights_TK, *, rank, shape, facts_PX=None, training=True):
        """``pipeline_plan`` (``degree=auto``: an all-gather of the rows to every rank),
        ``counts`` (the [P, r e] counts of every chunk) and each chunk's ``dispatch`` and
        ``combine`` (the chunk's dispatch returned)."""
        P, e = self.ep.world_size, self.placement.num_local
        r = self._degree_of(facts_PX, shape)
        _, send_rPe = self._chunks(topk_ids_TK, r)
        x_bytes = shape.bytes_of(shape.hidden)
        out = [] if facts_PX is None else [
            metadata_sends("pipeline_plan", rank, [1] * P, P * facts_PX.element_size(), kind=ALL_GATHER)]
        out.append(metadata_sends("counts", rank, [1] * P, r * e * send_rPe.element_size()))
        for c in range(r):
            out += [sends("dispatch", rank, send_rPe[c].sum(1), x_bytes), returned("combine", 1, x_bytes)]
        return out

    def _plan(self, x_TD, topk_ids_TK, experts, training: bool, layer: int, rec) -> tuple[ChunkPlan, torch.Tensor]:
        """Chunks of this rank's tokens, pairs ordered by (chunk, destination, local expert);
        one counts exchange for all chunks. Returns the plan and ``order_R`` (into the
        flattened [T*K] pairs)."""
        ep = self.ep
        P, e = ep.world_size, self.placement.num_local
        shape = RowShape(x_TD.shape[1], experts.w_gate.shape[2], x_TD.dtype)
        r = self._degree(topk_ids_TK, shape, layer, rec)
        key_R, send_rPe = self._chunks(topk_ids_TK, r)
        order_R = torch.argsort(key_R, stable=True)
        recv_Pre = exchange_counts(send_rPe.permute(1, 0, 2).reshape(P, r * e), ep, Exchange(layer, "counts", rec))
        recv_rPe = recv_Pre.view(P, r, e).permute(1, 0, 2)
        # device-to-host sync: split sizes go to the collectives as Python ints
        plan = ChunkPlan(tuple(s.sum(1).tolist() for s in send_rPe), tuple(s.sum(1).tolist() for s in recv_rPe),
                         tuple(expert_major_order(s.contiguous()) for s in recv_rPe),
                         # per-expert split sizes on the host: the chunk loop then never waits for the device
                         tuple(s.sum(0).cpu() for s in recv_rPe), ep, layer, rec, training)
        return plan, order_R

    def forward_moe(self, x_TD, topk_ids_TK, topk_weights_TK, experts, *, layer=0, recorder=None):
        rec, K = recorder, topk_ids_TK.shape[1]
        training = torch.is_grad_enabled() and (x_TD.requires_grad or experts.w_gate.requires_grad)
        with span(rec, layer, "dispatch"):
            plan, order_R = self._plan(x_TD, topk_ids_TK, experts, training, layer, rec)
            token_R = order_R // K
            x_RD = gather_rows(x_TD, token_R)
        if rec is not None:
            rec.log_counter(layer, "pipeline_degree", plan.degree)
            rec.log_counter(layer, "pipeline_calls", 1)      # counters add up over calls (decode steps)
        y_RD = _PipelinedExperts.apply(x_RD, experts.w_gate, experts.w_up, experts.w_down, plan)
        with span(rec, layer, "combine"):
            return weighted_scatter_add(x_TD.shape[0], token_R, y_RD, topk_weights_TK.flatten()[order_R])
