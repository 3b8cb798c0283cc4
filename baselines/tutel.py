"""system=tutel: Tutel's expert parallelism, run by the tutel library itself.

Tutel (microsoft/tutel 0.3, pinned commit :data:`TUTEL_COMMIT`, installed by ``make
venv``) is a capacity scheme: every expert gets C slots from every rank, a dense,
zero-padded [E, C, D] buffer moves in an equal-split all-to-all. Its ``moe_layer``
owns a gate whose logits it always softmaxes (and renormalises), so it cannot take
the harness's routing; this adapter drives the library's own lower layer instead,
the calls ``moe_layer.forward`` makes on a CPU tensor:

  routing   ``tutel.impls.fast_dispatch.extract_critical`` (``tutel.moe.top_k_routing``):
            Tutel's queue position of every (token, k) pair (first choices of
            every token, then second choices, ...; ``fast_cumsum_sub_one``) and its
            capacity C; fed with scores whose top-k order is exactly the harness's
            top-k ids (``K - k`` at id k, 0 elsewhere), its gate values replaced by
            the harness's gate weights (the only thing the scores would set), no
            gate normalisation and no auxiliary loss (``loss_fn=None``: the
            harness's router owns routing)
  encode    ``tutel.moe.fast_encode``: every kept pair's token into its slot [E, C, D]
  exchange  ``tutel.net.all_to_all(y, 1, 0)``: rank p gets its e experts' C slots
            from every rank, [e, P*C, D] (e*C rows per peer whatever the load)
  experts   the harness's ``GroupedExperts`` of this rank on all P*C rows of each
            local expert, padding included (Tutel's ``expert_local`` on the same layout)
  exchange  ``tutel.net.all_to_all(y, 0, 1)`` back to [E, C, D]
  decode    ``tutel.moe.fast_decode``: each token's kept slots, gate-weighted and summed
            (``is_postscore=True``: the gate is applied here, once)

Capacity, Tutel's rule (``capacity_factor`` cf, T the most tokens on any rank,
``inequivalent_tokens=True`` so that ranks may hold different T):

* cf = 0 (default): dropless, C = the most pairs any rank sends one expert
  (a max all-reduce). Exact top-k MoE.
* cf > 0: C = ``K * int(cf * ceil(T / E))``; pairs at queue position >= C are dropped
  (their gate weight is lost, the others are not renormalised).
* cf < 0: dropless capped at the capacity of -cf, ``min(need, K * int(-cf * ceil(T / E)))``.

C is then rounded up to a multiple of ``a2a_ffn_overlap_degree`` (Tutel's alignment).
That is all the degree does here: Tutel's layer takes its pipelined path (the
all-to-all split into that many chunks, overlapped with expert compute) only for
CUDA tensors, and that path needs the NCCL kernels of a CUDA build. This adapter
refuses a degree above 1 on CUDA tensors instead of running something else.

Precision: Tutel's CPU kernels encode and decode in float32 (non-float16 inputs are
cast to float32 and the result cast back), so ``precision = "float32"``: the parity
check holds it to float32's tolerance. ``system=tutel_harness`` is the same scheme in
the harness's own float64-exact code.

Accounting: the collectives run inside Tutel and are observed
(:mod:`occult.ep.observe`): the rows per peer are the equal split of the encoded
buffer that went into ``tutel.net.all_to_all`` (e*C rows of D values), logged for
phase ``dispatch`` and ``combine``, forward and backward (backward through autograd
probes on each exchange's input and output); a logged time spans Tutel's
``all_to_all`` call, the reshapes around its collective included. Tutel's routing
all-reduces (the most tokens on any rank, and for cf <= 0 the largest load) are logged
as phase ``counts``, one row of the reduced tensor per peer, by wrapping
``fast_dispatch.simple_all_reduce`` for the duration of the routing call. Counters per
call: ``dropped_pairs`` (pairs beyond capacity on this rank) and ``padding_rows``
(zero rows this rank sends: E*C - kept pairs).

A rank without tokens: Tutel's routing reads the last token's queue position and
fails on none, so such a rank routes one placeholder token (zeros, experts 0..K-1,
gate weight 0). It occupies slots of this rank only, changes C only when no rank has
a token, adds nothing to any output, is not counted in the counters, and its output
row is dropped.

Shapes: T tokens, S samples Tutel routes (T, or 1 for a rank without tokens), K top-k,
D hidden, E experts, P ranks, e local experts, C capacity, X = P*C rows per local expert.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata
from types import SimpleNamespace

import torch

from occult.columns import column
from occult.ep import SplitDispatcher
from occult.ep.measure import barrier
from occult.ep.observe import CallTrace, log_observed, observed_start, probe
from occult.ep.plan import returned, sends

from baselines.tutel_harness import TutelHarnessDispatcher, capacity_of_facts
from occult.ep.capabilities import Capabilities

TUTEL_VERSION = "0.3"
TUTEL_COMMIT = "82af7aad9fc3ec981395ba97e7242a480984a55e"
# Tutel's overlap path splits the exchange into at most this many chunks
# (tutel.impls.communicate.AllToAllStatus.max_num_split)
MAX_OVERLAP_DEGREE = 32


def load_tutel() -> SimpleNamespace:
    """Tutel's modules this adapter calls (``moe``, ``net``, ``fast_dispatch``), checked for
    the functions it uses; an ImportError says how to install the library."""
    try:
        from tutel import moe, net
        from tutel.impls import fast_dispatch
        version = metadata.version("tutel")
    except ImportError as exc:
        raise ImportError(
            f"system=tutel runs the tutel library (microsoft/tutel {TUTEL_VERSION} at commit "
            f"{TUTEL_COMMIT}), which is not installed ({exc}). `make venv` installs it: from the "
            "wheel folder TUTEL_WHEELS (default ../shared/wheels) when there is one, else from its "
            "source repository (README, 'Tutel').") from exc
    needed = {"tutel.moe": (moe, ("fast_encode", "fast_decode")), "tutel.net": (net, ("all_to_all",)),
              "tutel.impls.fast_dispatch": (fast_dispatch, ("extract_critical", "simple_all_reduce"))}
    missing = [f"{mod}.{n}" for mod, (m, names) in needed.items() for n in names if not hasattr(m, n)]
    if version != TUTEL_VERSION or missing:
        raise ImportError(f"system=tutel drives tutel {TUTEL_VERSION} (commit {TUTEL_COMMIT}); found tutel "
                          f"{version}" + (f" without {missing}" if missing else "") + ". Reinstall it with "
                          "`make venv` (README, 'Tutel').")
    return SimpleNamespace(moe=moe, net=net, fast_dispatch=fast_dispatch)


@contextmanager
def observed_all_reduces(fast_dispatch, trace: CallTrace):
    """While the block runs, every all-reduce of Tutel's routing (``simple_all_reduce`` of
    ``tutel.impls.fast_dispatch``) is timed and logged as phase ``counts``: one row of the
    reduced tensor to each peer. The library's function is put back on exit."""
    rec, inner = trace.recorder, fast_dispatch.simple_all_reduce
    if rec is None:
        yield
        return

    def observed(input, group=None, op=torch.distributed.ReduceOp.SUM, inplace=False):
        wait = barrier(trace.ep) if rec.sync_collectives else 0.0
        t0 = observed_start(rec)
        out = inner(input, group=group, op=op, inplace=inplace)
        log_observed(rec, trace.layer, "counts", "forward", [1] * trace.ep.world_size,
                     input.numel() * input.element_size(), t0, wait)
        return out

    fast_dispatch.simple_all_reduce = observed
    try:
        yield
    finally:
        fast_dispatch.simple_all_reduce = inner


def placeholder_ids(topk_ids_TK: torch.Tensor) -> torch.Tensor:
    """The top-k ids Tutel routes: the rank's, or for a rank without tokens one placeholder
    sample's (experts 0..K-1): [S, K]."""
    if topk_ids_TK.shape[0]:
        return topk_ids_TK
    K = topk_ids_TK.shape[1]
    return torch.arange(K, dtype=topk_ids_TK.dtype, device=topk_ids_TK.device).unsqueeze(0)


def with_placeholder(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor):
    """The samples Tutel routes: the rank's tokens, or for a rank without tokens one
    placeholder (zeros, experts 0..K-1, gate weight 0): ``(x_SD, ids_SK, w_SK)``."""
    if x_TD.shape[0]:
        return x_TD, topk_ids_TK, topk_weights_TK
    K = topk_ids_TK.shape[1]
    return (torch.cat([x_TD, x_TD.new_zeros(1, x_TD.shape[1])]), placeholder_ids(topk_ids_TK),
            torch.cat([topk_weights_TK, topk_weights_TK.new_zeros(1, K)]))


def aligned(capacity: int, alignment: int) -> int:
    """C rounded up to a multiple of ``alignment`` (Tutel's ``extract_critical``)."""
    return -(-capacity // alignment) * alignment


def tutel_routing(fast_dispatch, ids_SK: torch.Tensor, w_SK: torch.Tensor, num_experts: int,
                  capacity_factor: float, alignment: int, group) -> tuple:
    """Tutel's routing tuple ``(E, indices_K, locations_K, gates_K, C, load_E)`` for the
    harness's top-k ids and gate weights (see the module docstring): queue positions and
    C from ``extract_critical``, gates = the columns of ``w_SK``. Every rank must call it
    (it all-reduces)."""
    S, K = ids_SK.shape
    order_SE = torch.zeros(S, num_experts, device=ids_SK.device)
    rank_K = K - torch.arange(K, dtype=order_SE.dtype, device=ids_SK.device)
    order_SE.scatter_(1, ids_SK, rank_K.expand(S, K).contiguous())
    (E, indices_K, locations_K, _, capacity, load_E), _ = fast_dispatch.extract_critical(
        order_SE, K, loss_fn=None, capacity_factor=capacity_factor, batch_prioritized_routing=False,
        normalize_gate=False, alignment=alignment, group=group, inequivalent_tokens=True)
    if not torch.equal(torch.stack(indices_K, 1).to(ids_SK.dtype), ids_SK):
        raise RuntimeError("system=tutel: Tutel's routing did not keep the harness's top-k ids "
                           "(a token's top-k experts must be distinct)")
    gates_K = [w_S.contiguous() for w_S in w_SK.unbind(1)]    # Tutel's kernels need contiguous gates
    return E, indices_K, locations_K, gates_K, int(capacity), load_E


@dataclass(frozen=True)
class TutelHandle:
    """What combine needs, and the call's load figures."""

    crit: tuple            # Tutel's routing tuple (tutel_routing)
    num_tokens: int        # T (the placeholder of a rank without tokens is not one)
    capacity: int          # C
    dropped_pairs: int     # (token, k) pairs beyond capacity on this rank
    padding_rows: int      # zero rows this rank sends: E*C - kept pairs
    trace: CallTrace


class TutelDispatcher(SplitDispatcher):
    """Tutel's encode, all-to-all and decode (the library), on the harness's routing and experts.

    ``capacity_factor``: 0 dropless (default, exact), > 0 Tutel's fixed capacity with
    drops, < 0 dropless capped at the capacity of -cf. ``a2a_ffn_overlap_degree``: Tutel's
    overlap degree (on this CPU: C rounded up to a multiple of it, see the module docstring).
    """

    capabilities = Capabilities(
        impl="library", precision="float32", expert_parallel=True, exact_forward=True, exact_backward=True,
        static_dispatch="it has no fixed-buffer dispatch (only naive EP's and Occult's exchanges have one)",
        co_execution=True,
        yields=("its collectives run inside the library, which does not hand them to another strand "
                "(exposed_comm = their whole time)"),
        traffic_plan=True,
        migration=True,
        replica_rules=(), payloads=("fp32",), dropped_pairs=False,
        shortcut_overlap=False)

    @dataclass
    class Config(TutelHarnessDispatcher.Config):
        # capacity_factor as the harness's twin (the same capacity and drop rule, tested
        # against it). Tutel's a2a_ffn_overlap_degree: C is rounded up to a multiple of it;
        # Tutel pipelines (chunks the exchange) only on CUDA, which this adapter refuses for
        # degrees above 1. A column of every row (-1: no such field)
        a2a_ffn_overlap_degree: int = column(1, absent=-1)

        def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
            super().check(num_experts=num_experts, top_k=top_k, world_size=world_size)
            if not 1 <= self.a2a_ffn_overlap_degree <= MAX_OVERLAP_DEGREE:
                raise ValueError(f"system.a2a_ffn_overlap_degree={self.a2a_ffn_overlap_degree!r}: allowed "
                                 f"integers 1..{MAX_OVERLAP_DEGREE} (Tutel's limit)")

    def __init__(self, ep, placement, config):
        super().__init__(ep, placement, config)
        if not placement.is_contiguous():
            raise ValueError("system=tutel: Tutel's [E, C, D] buffer sends expert i to rank i // e (the "
                             f"contiguous placement); this layer's placement is {placement.groups()}. "
                             "Use the default placement with system=tutel.")
        self._tutel = load_tutel()

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK, *, layer=0, recorder=None):
        degree = self.config.a2a_ffn_overlap_degree
        if x_TD.is_cuda and degree > 1:
            # refused, not run untested: Tutel's overlap path is the library's own CUDA schedule
            raise ValueError(
                f"system.a2a_ffn_overlap_degree={degree} on CUDA tensors: Tutel's layer would take its "
                "pipelined path (tutel.impls.overlap, NCCL streams), which this adapter does not drive; "
                f"allowed values on CUDA: [1] (on CPU: 1..{MAX_OVERLAP_DEGREE}, capacity alignment only)")
        tutel, P, e = self._tutel, self.ep.world_size, self.placement.num_local
        T, K = topk_ids_TK.shape
        D = x_TD.shape[1]
        x_SD, ids_SK, w_SK = with_placeholder(x_TD, topk_ids_TK, topk_weights_TK)
        trace = CallTrace(layer, recorder, self.ep)
        with observed_all_reduces(tutel.fast_dispatch, trace):
            crit = tutel_routing(tutel.fast_dispatch, ids_SK, w_SK, self.placement.num_experts,
                                 self.config.capacity_factor, degree, self.ep.group)
        C = self._checked(crit[4])      # the same C on every rank: they all stop here when it is 0
        kept = sum(int((loc_S[:T] < C).sum()) for loc_S in crit[2])
        y_ECD = tutel.moe.fast_encode(x_SD.contiguous(), crit)
        trace.rows_P, trace.row_bytes = [e * C] * P, D * y_ECD.element_size()
        y_ECD = probe(y_ECD, lambda: trace.stop("dispatch", "backward"))
        trace.start("dispatch", "forward")
        recv_eXD = tutel.net.all_to_all(y_ECD, 1, 0, group=self.ep.group)
        trace.stop("dispatch", "forward")
        recv_eXD = probe(recv_eXD, lambda: trace.start("dispatch", "backward"))
        handle = TutelHandle(crit, T, C, T * K - kept, self.placement.num_experts * C - kept, trace)
        counts_e = torch.full((e,), P * C, dtype=torch.long, device=x_TD.device)
        return recv_eXD.reshape(e * P * C, D), counts_e, handle

    def combine(self, y_RD, handle: TutelHandle):
        tutel, tr = self._tutel, handle.trace
        e, D = self.placement.num_local, y_RD.shape[1]
        y_eXD = probe(y_RD.reshape(e, -1, D), lambda: tr.stop("combine", "backward"))
        tr.start("combine", "forward")
        back_ECD = tutel.net.all_to_all(y_eXD, 0, 1, group=self.ep.group)
        tr.stop("combine", "forward")
        back_ECD = probe(back_ECD, lambda: tr.start("combine", "backward"))
        return tutel.moe.fast_decode(back_ECD.contiguous(), handle.crit)[:handle.num_tokens]

    def _checked(self, capacity: int) -> int:
        """``capacity``, unless it is 0: Tutel's all-to-all cannot move an empty buffer."""
        if capacity == 0:
            cf = self.config.capacity_factor
            raise ValueError(f"system.capacity_factor={cf!r}: Tutel's capacity K * int({abs(cf)} * ceil(T / E)) "
                             f"is 0 at this call's T tokens per rank and E = {self.placement.num_experts}, "
                             "and its all-to-all cannot move an empty buffer; allowed: 0 (dropless) or a "
                             "factor with |cf| * ceil(T / E) >= 1")
        return capacity

    def plan_facts(self, topk_ids_TK, topk_weights_TK):
        """(samples Tutel routes, most pairs for one expert) of this rank: what its all-reduces
        take the maximum of."""
        ids_SK = placeholder_ids(topk_ids_TK)
        need_E = torch.bincount(ids_SK.flatten(), minlength=self.placement.num_experts)
        return torch.stack([torch.tensor(ids_SK.shape[0], device=need_E.device), need_E.max()])

    def plan(self, topk_ids_TK, topk_weights_TK, *, rank, shape, facts_PX=None, training=True):
        """A second statement of what the library sends (its collectives run inside it; the
        parity worlds check this against the rows observed from its buffers): Tutel's routing
        all-reduces (phase ``counts``: the most samples of any rank, and for cf <= 0 the largest
        load; one int64 each), then ``dispatch`` and ``combine``, e C rows to every rank, C being
        the harness twin's capacity rounded up to ``a2a_ffn_overlap_degree``."""
        P, e, K = self.ep.world_size, self.placement.num_local, topk_ids_TK.shape[1]
        cf = self.config.capacity_factor
        C = self._checked(aligned(capacity_of_facts(cf, K, facts_PX, self.placement.num_experts),
                                  self.config.a2a_ffn_overlap_degree))
        x_bytes = shape.bytes_of(shape.hidden)
        reduces = [sends("counts", rank, [1] * P, facts_PX.element_size(), differentiable=False)
                   for _ in range(1 if cf > 0 else 2)]
        return reduces + [sends("dispatch", rank, [e * C] * P, x_bytes), returned("combine", 1, x_bytes)]

    def stats(self, handle: TutelHandle) -> dict:
        """This rank's load figures of one call: pairs dropped beyond capacity, padding rows sent."""
        return {"dropped_pairs": handle.dropped_pairs, "padding_rows": handle.padding_rows}
