"""system=tutel_harness: Tutel's capacity-based expert parallelism, the harness's implementation.

``system=tutel`` runs the Tutel library itself (:mod:`baselines.tutel`); this is the same
scheme written with the harness's own accounted collectives, kept because it computes
in the problem's dtype (float64 in the parity suite, checked at 1e-9, where the library
computes its encode and decode in float32), its rows are counted by
:mod:`occult.ep.comm` itself, and it is a second, independent statement of Tutel's
capacity and drop rule that the library's results are checked against.

Tutel (like GShard) gives every expert a fixed number of slots per sending
rank, fills a dense, padded buffer and moves it with an *equal-split*
all-to-all, so the bytes on the wire do not depend on the routing:

  sender    queue position of every (token, k) pair in its expert, Tutel's
            priority: all first choices (k = 0) in token order, then all
            second choices, ... (Tutel's ``extract_critical``: the locations
            of choice k start after every choice < k of that expert);
            pairs at position >= C are **dropped** and contribute nothing;
            scatter the kept rows into buf_PeCD = [P, e, C, D] (one block of C
            slots per destination rank and local expert, zeros elsewhere)
  exchange  equal-split all-to-all: e*C rows to every rank whatever the load
  receiver  [P, e, C, D] -> [e, P, C, D]: the experts run on every received
            row, padding included (counts_e = P*C for each local expert)
  exchange  equal-split all-to-all back
  sender    gate-weighted sum of the kept pairs at home (Tutel's decode)

Capacity C, rows per (sending rank, expert), from ``capacity_factor`` cf as
Tutel computes it: ``C = K * int(cf * ceil(T / E))`` for cf > 0, with T the
largest token count of any rank (Tutel's ``inequivalent_tokens=True``; the
equal-split exchange needs one C on every rank). cf = 0 is dropless: C is
the most rows any (rank, expert) pair needs. cf < 0 is Tutel's capped
dropless mode: ``min(needed, K * int(-cf * ceil(T / E)))``. T and the need
travel in one small counts exchange (Tutel uses a max all-reduce for cf <= 0);
it is logged with phase ``counts``.

**Exactness**: with cf = 0 (the default) nothing
is dropped and the result is exact top-k MoE, which is why the class says
``exact = True``. With cf != 0 pairs beyond capacity are dropped and the
output is top-k MoE *without those pairs*; :meth:`TutelHarnessDispatcher.stats`
reports dropped pairs and padding rows for every call.

Shapes: T tokens, K top-k, D hidden, E experts, P ranks, e local experts,
C capacity, Q kept (token, k) pairs, R buffer rows (P*e*C).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from occult.ep import Exchange, Placement, Recorder, SplitDispatcher, SystemConfig, all_to_all_rows, exchange_counts
from occult.ep.permute import gather_rows, scatter_add_rows, weighted_scatter_add
from occult.ep.plan import metadata_sends, returned, sends
from occult.ep.capabilities import Capabilities



@dataclass(frozen=True)
class TutelHandle:
    """What combine needs, and the call's load figures."""

    token_Q: torch.Tensor      # home token of each kept pair
    weight_Q: torch.Tensor     # its gate weight
    row_Q: torch.Tensor        # its row in the send buffer [P*e*C]
    capacity: int              # C
    num_tokens: int
    dropped_pairs: int         # (token, k) pairs beyond capacity on this rank
    padding_rows: int          # rows of zeros this rank sends (P*e*C - kept pairs)
    layer: int
    recorder: Optional[Recorder]


def queue_positions(topk_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each pair's position in its expert's queue, in Tutel's priority order.

    Pairs are taken k-major (index k*T + t): every token's k-th choice comes
    before any token's (k+1)-th, tokens in order within one k. Returns
    ``pos_KT`` (flattened [K, T]: [K*T]) and ``need_E`` [E], the pairs each expert got.
    """
    ids_KT = topk_ids_TK.t().reshape(-1)
    need_E = torch.bincount(ids_KT, minlength=num_experts)
    start_E = torch.cumsum(need_E, 0) - need_E
    order_KT = torch.argsort(ids_KT, stable=True)
    pos_KT = torch.empty_like(ids_KT)
    pos_KT[order_KT] = torch.arange(ids_KT.numel(), device=ids_KT.device) - start_E[ids_KT[order_KT]]
    return pos_KT, need_E


def capacity_rows(capacity_factor: float, top_k: int, max_tokens: int, num_experts: int,
                  max_need: int) -> int:
    """Tutel's capacity C per (sending rank, expert) (see the module docstring)."""
    per_expert = -(-max_tokens // num_experts)
    if capacity_factor > 0:
        return top_k * int(capacity_factor * per_expert)
    if capacity_factor == 0:
        return max_need
    return min(max_need, top_k * int(-capacity_factor * per_expert))


def capacity_of_facts(capacity_factor: float, top_k: int, every_PX: torch.Tensor, num_experts: int) -> int:
    """C from every rank's (tokens, most pairs for one expert) [P, 2] (the same on every rank)."""
    max_tokens, max_need = every_PX.max(0).values.tolist()
    return capacity_rows(capacity_factor, top_k, max_tokens, num_experts, max_need)


def kept_pairs(topk_ids_TK: torch.Tensor, pos_KT: torch.Tensor, capacity: int, placement: Placement
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs that fit in capacity: their token, their k, and their row in the send
    buffer [P, e, C] (block = destination device * e + local slot, then the queue
    position). Each has shape [Q]; ``pos_KT`` is k-major as :func:`queue_positions` gives it."""
    T = max(topk_ids_TK.shape[0], 1)
    kept_Q = torch.nonzero(pos_KT < capacity).flatten()     # k-major pair indices
    ids_Q = topk_ids_TK.t().reshape(-1)[kept_Q]
    block_Q = placement.device_E[ids_Q] * placement.num_local + placement.slot_E[ids_Q]
    return kept_Q % T, kept_Q // T, block_Q * capacity + pos_KT[kept_Q]


def swap_blocks(rows_RD: torch.Tensor, a: int, b: int, capacity: int) -> torch.Tensor:
    """Rows laid out [a, b, C, D] -> [b, a, C, D] (a copy): [a*b*C, D] -> [a*b*C, D]."""
    D = rows_RD.shape[1]
    return rows_RD.reshape(a, b, capacity, D).transpose(0, 1).reshape(a * b * capacity, D)


class TutelHarnessDispatcher(SplitDispatcher):
    """Tutel's capacity-padded, equal-split scheme.

    ``capacity_factor``: cf > 0 fixed capacity (drops overflow), 0 dropless
    (default, exact), < 0 dropless capped at the cf > 0 capacity of |cf|.
    """

    capabilities = Capabilities(
        impl="harness", precision="float64", expert_parallel=True, exact_forward=True, exact_backward=True,
        static_dispatch="it has no fixed-buffer dispatch (only naive EP's and Occult's exchanges have one)",
        co_execution=True,
        yields=True,
        traffic_plan=True,
        migration=True,
        replica_rules=(), payloads=("fp32",), dropped_pairs=False,
        shortcut_overlap=False)

    @dataclass
    class Config(SystemConfig):
        # C = K * int(cf * ceil(T / E)) rows per (rank, expert); overflow pairs are dropped
        # (first choices first, tokens in order). 0: dropless, C = the most any (rank,
        # expert) needs (exact). < 0: dropless capped at the capacity of |cf|.
        capacity_factor: float = 0.0

        def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
            super().check(num_experts=num_experts, top_k=top_k, world_size=world_size)
            if not math.isfinite(self.capacity_factor):
                raise ValueError(f"system.capacity_factor={self.capacity_factor!r}: must be a finite number "
                                 "(> 0 fixed capacity, 0 dropless, < 0 dropless capped at |cf|)")

        def is_exact(self) -> bool:
            return self.capacity_factor == 0

        def lossless_options(self) -> dict:
            """Dropless (capacity_factor 0): the capacity scheme without its drops, what the
            run's parity gate checks a dropping config with."""
            return {} if self.is_exact() else {"capacity_factor": 0.0}

    def plan_facts(self, topk_ids_TK, topk_weights_TK):
        """(T, most pairs for one expert) of this rank: what C is the maximum of."""
        _, need_E = queue_positions(topk_ids_TK, self.placement.num_experts)
        return torch.stack([torch.tensor(topk_ids_TK.shape[0], device=need_E.device), need_E.max()])

    def _capacity(self, topk_ids_TK: torch.Tensor, layer: int, recorder: Optional[Recorder]) -> int:
        """C, equal on every rank: exchanges (T, most pairs for one expert) with every rank."""
        mine_X = self.plan_facts(topk_ids_TK, None)
        every_PX = exchange_counts(mine_X.expand(self.ep.world_size, 2).contiguous(), self.ep,
                                   Exchange(layer, "counts", recorder))
        return capacity_of_facts(self.config.capacity_factor, topk_ids_TK.shape[1], every_PX,
                                 self.placement.num_experts)

    def plan(self, topk_ids_TK, topk_weights_TK, *, rank, shape, facts_PX=None, training=True):
        """``counts`` ((T, largest load) to every rank), ``dispatch`` (e C rows to every rank
        whatever the load) and ``combine`` (the dispatch returned)."""
        P, e = self.ep.world_size, self.placement.num_local
        C = capacity_of_facts(self.config.capacity_factor, topk_ids_TK.shape[1], facts_PX, self.placement.num_experts)
        x_bytes = shape.bytes_of(shape.hidden)
        return [metadata_sends("counts", rank, [1] * P, 2 * facts_PX.element_size()),
                sends("dispatch", rank, [e * C] * P, x_bytes), returned("combine", 1, x_bytes)]

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK, *, layer=0, recorder=None):
        T, K = topk_ids_TK.shape
        P, e = self.placement.num_devices, self.placement.num_local
        pos_KT, _ = queue_positions(topk_ids_TK, self.placement.num_experts)
        C = self._capacity(topk_ids_TK, layer, recorder)
        token_Q, k_Q, row_Q = kept_pairs(topk_ids_TK, pos_KT, C, self.placement)
        # index the weights row-major (t*K + k): their gradient then reaches the router
        # in the [T, K] layout the reference gives it, so the float32 router rounds alike
        weight_Q = topk_weights_TK.reshape(-1)[token_Q * K + k_Q]
        buf_RD = scatter_add_rows(P * e * C, row_Q, gather_rows(x_TD, token_Q))
        splits_P = [e * C] * P
        recv_RD = all_to_all_rows(buf_RD, splits_P, splits_P, self.ep, Exchange(layer, "dispatch", recorder))
        kept = token_Q.numel()
        handle = TutelHandle(token_Q, weight_Q, row_Q, C, T, T * K - kept, P * e * C - kept, layer, recorder)
        counts_e = torch.full((e,), P * C, dtype=torch.long, device=x_TD.device)
        return swap_blocks(recv_RD, P, e, C), counts_e, handle

    def combine(self, y_RD, handle: TutelHandle):
        P, e, C = self.ep.world_size, self.placement.num_local, handle.capacity
        splits_P = [e * C] * P
        back_RD = all_to_all_rows(swap_blocks(y_RD, e, P, C), splits_P, splits_P, self.ep,
                                  Exchange(handle.layer, "combine", handle.recorder))
        return weighted_scatter_add(handle.num_tokens, handle.token_Q, gather_rows(back_RD, handle.row_Q),
                                    handle.weight_Q)

    def stats(self, handle: TutelHandle) -> dict:
        """This rank's load figures of one call: pairs dropped beyond capacity, padding rows sent."""
        return {"dropped_pairs": handle.dropped_pairs, "padding_rows": handle.padding_rows}
