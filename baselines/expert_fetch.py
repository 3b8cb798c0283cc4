"""system=expert_fetch: move the experts to the tokens (Janus's data-centric paradigm).

Instead of sending tokens to the devices that hold their experts, every rank fetches the
weights of the remote experts its own tokens chose, computes all of its tokens' (token,
expert) pairs itself, and in training sends the gradients of the fetched weights back to
their owners (Janus, "A Unified Distributed Training Framework for Sparse
Mixture-of-Experts Models": the data-centric side of its unified framework).

  request   ``fetch_request``: rank r tells each owner which of its experts r's tokens
            chose (a [P, e] 0/1 matrix, row j to rank j)
  fetch     ``fetch_weights``: each owner sends the requested experts' weights, one row per
            expert (its gate, up and down matrices flattened: 3 D F elements); rank r then
            holds every expert its tokens need, its own and the fetched ones
  compute   all of r's pairs, grouped by expert, gate-weighted and summed at home: no
            token ever leaves its rank
  backward  the transposed ``fetch_weights`` exchange returns each fetched expert's
            gradient to its owner, where the gradients of all ranks are summed into the
            owner's weights (Janus's gradient return)

Accounted as weight bytes: rows of ``fetch_weights`` are experts, ``3 D F`` elements each.
The trade: a rank receives at most ``E - e`` experts whatever its batch, against naive EP's
``K T (P - 1) / P`` token rows, so fetching wins when a rank's tokens outweigh the experts
it would fetch (large batches, small experts; about ``3 F`` tokens per fetched expert at
equal element sizes) and loses badly otherwise. Not modelled: Janus's expert cache across
micro-batches and its hierarchical (intra-node first) fetch.

Exact top-k MoE with the owners' weights; every pair is computed once and weighted once.

Shapes: T tokens, K top-k, D hidden, F expert FFN, E experts, P ranks, e local experts,
W weight elements of one expert (3 D F), U experts this rank computes (its own first,
then the fetched ones), Q (token, expert) pairs of this rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from occult.ep import Dispatcher, Exchange, SystemConfig, all_to_all_rows, exchange_counts
from occult.ep.plan import forwarded, metadata_sends
from occult.ep.accounting import span
from occult.ep.experts import expert_rows, grouped_swiglu, weights_of_rows
from occult.ep.permute import gather_rows, weighted_scatter_add
from occult.ep.capabilities import Capabilities


def pairs_by_expert(topk_ids_TK: torch.Tensor, row_of_E: torch.Tensor, num_rows: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (token, k) pairs grouped by the weight-table row of their expert:
    ``(order_Q, token_Q, counts_U)`` (``order_Q`` indexes the flattened [T*K] pairs)."""
    K = topk_ids_TK.shape[1]
    row_Q = row_of_E[topk_ids_TK].flatten()
    order_Q = torch.argsort(row_Q, stable=True)
    return order_Q, order_Q // K, torch.bincount(row_Q, minlength=num_rows)


class ExpertFetchDispatcher(Dispatcher):
    """Janus's data-centric expert parallelism (no options)."""

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
        pass

    def _fetch(self, topk_ids_TK: torch.Tensor, experts, layer: int, rec) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights of every expert this rank's tokens need that another rank owns:
        ``(fetched_ids_F, rows_FW)``, in (owner, slot) order."""
        ep = self.ep
        want_Pe, by_slot_Pe = self._wanted(topk_ids_TK, ep.rank)
        asked_Pe = exchange_counts(want_Pe.long(), ep, Exchange(layer, "fetch_request", rec)) > 0
        # device-to-host sync: split sizes go to the collective as Python ints
        send_P, recv_P = asked_Pe.sum(1).tolist(), want_Pe.sum(1).tolist()
        _, slot_S = torch.nonzero(asked_Pe, as_tuple=True)          # by requester, then slot
        rows_FW = all_to_all_rows(gather_rows(expert_rows(experts), slot_S), send_P, recv_P, ep,
                                  Exchange(layer, "fetch_weights", rec))
        return by_slot_Pe[want_Pe], rows_FW

    def _wanted(self, topk_ids_TK: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts of every owner that ``rank``'s tokens need (bool [P, e], by owner and
        slot; none of its own, which are there already) and every owner's experts by slot [P, e]."""
        pl = self.placement
        P, e = self.ep.world_size, pl.num_local
        need_E = torch.zeros(pl.num_experts, dtype=torch.bool, device=topk_ids_TK.device)
        need_E[topk_ids_TK.flatten()] = True
        by_slot_Pe = pl.global_order().view(P, e)
        want_Pe = need_E[by_slot_Pe]
        want_Pe[rank] = False
        return want_Pe, by_slot_Pe

    def plan(self, topk_ids_TK, topk_weights_TK, *, rank, shape, facts_PX=None, training=True):
        """``fetch_request`` (the [P, e] request, one int64 row to each owner) and
        ``fetch_weights`` (each owner sends the requested experts: 3 D F weights a row)."""
        want_Pe, _ = self._wanted(topk_ids_TK, rank)
        P, e = want_Pe.shape
        rows_PP = torch.zeros(P, P, dtype=torch.long, device=want_Pe.device)
        rows_PP[:, rank] = want_Pe.sum(1)
        return [metadata_sends("fetch_request", rank, [1] * P, e * rows_PP.element_size()),
                forwarded("fetch_weights", torch.arange(P, device=rows_PP.device), rows_PP,
                          shape.bytes_of(3 * shape.hidden * shape.ffn))]

    def forward_moe(self, x_TD, topk_ids_TK, topk_weights_TK, experts, *, layer=0, recorder=None):
        rec, pl = recorder, self.placement
        with span(rec, layer, "dispatch"):
            fetched_F, rows_FW = self._fetch(topk_ids_TK, experts, layer, rec)
        with span(rec, layer, "experts"):
            ids_U = torch.cat([self.local_expert_ids, fetched_F])
            row_of_E = torch.full((pl.num_experts,), -1, dtype=torch.long, device=x_TD.device)
            row_of_E[ids_U] = torch.arange(ids_U.numel(), device=x_TD.device)
            order_Q, token_Q, counts_U = pairs_by_expert(topk_ids_TK, row_of_E, ids_U.numel())
            table_UW = torch.cat([expert_rows(experts), rows_FW])
            D, F = experts.w_gate.shape[1:]
            y_QD = grouped_swiglu(gather_rows(x_TD, token_Q), counts_U, *weights_of_rows(table_UW, D, F))
        with span(rec, layer, "combine"):
            weight_Q = topk_weights_TK.flatten()[order_Q]
            return weighted_scatter_add(x_TD.shape[0], token_Q, y_QD, weight_Q)
