"""system=shadow: FasterMoE's dynamic shadowing (the replication of Lina and FlexMoE).

Per batch and layer, the most popular experts are *shadowed*: their owners broadcast
their weights to every rank, every rank computes its own tokens' pairs of those experts
itself, and in training the shadows' gradients are reduced back to the owners. Every
other pair goes the naive-EP way (one row per (token, expert) to the expert's device).

  plan      ``shadow_plan``: an all-gather of every rank's per-expert pair counts [P, E];
            every rank applies FasterMoE's rule to the same counts, so all agree on the
            shadowed set (the batch's placement gains replicas: a shadowed expert is on
            every device, :meth:`occult.ep.Placement.with_replicas`)
  weights   ``shadow_weights``: one broadcast per owner of shadowed experts, one row per
            expert (3 D F elements); in backward its transpose, a reduce, sums every
            rank's gradient of the shadow into the owner's weights
  tokens    ``counts``, ``dispatch``, ``combine``: naive EP for the pairs of the other
            experts; the shadowed pairs never leave their rank

FasterMoE's rule (its ``global_policy``, written for its two-matrix experts and re-stated
here for SwiGLU experts of three D x F matrices): sort the experts by their global load
B_0 >= B_1 >= ...; the layer is modelled as paced by its busiest unshadowed expert, with
latency ``B x (c x comp + f x feat)``, where ``comp`` is one (token, expert)'s expert FLOPs
(6 D F) over the device's matmul throughput, ``feat`` one token row's bytes over the link
bandwidth, and (c, f) = (3, 4) in training (forward and backward compute, four token
exchanges) or (1, 2) in inference. Shadowing the top i + 1 experts adds (i + 1) weight
transfers (3 D F elements over the link; twice in training, the gradient reduce) and
leaves B_{i+1} as the busiest; experts are shadowed one by one while that latency drops.
Like FasterMoE's rule it ignores per-collective latency and the shadows' own compute.
The link and throughput are those of a projection profile (``profile``): the paper's
4 x RTX A6000 by default (so that a run here shadows what the rule would shadow there, and
its bytes project onto that machine); ``sim_cpu_loopback`` is this machine's measured loopback.

Exact top-k MoE: a shadow computes with its owner's weights, and its gradients are
summed into the owner's.

Shapes: T tokens, K top-k, D hidden, F expert FFN, E experts, P ranks, e local experts,
W = 3 D F weight elements of one expert, R rows sent (naive part), Q rows received grouped
by local expert, V shadowed pairs of this rank, S shadowed experts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from baselines.naive import pair_exchange_plan
from occult.ep import Dispatcher, Exchange, SystemConfig, all_to_all_rows, exchange_counts
from occult.ep.accounting import span
from occult.ep.comm import ALL_GATHER, BROADCAST, all_gather_rows, broadcast_rows
from occult.ep.plan import RowShape, metadata_sends, sends
from occult.ep.experts import expert_rows, grouped_swiglu, weights_of_rows
from occult.ep.links import Link
from occult.ep.profiles import link_at
from occult.ep.permute import (expert_major_order, gather_rows, inverse_permutation, sort_pairs_by_destination,
                               weighted_scatter_add)
from occult.ep.capabilities import Capabilities


@dataclass(frozen=True)
class ShadowCosts:
    """What FasterMoE's rule weighs, in seconds: one (token, expert)'s expert compute, one
    token row over the link, one expert's weights over the link."""

    comp_s: float
    feat_s: float
    model_s: float

    @staticmethod
    def of(link: Link, hidden: int, ffn: int, element_bytes: int) -> "ShadowCosts":
        bandwidth = link.slowest_Bps
        return ShadowCosts(6.0 * hidden * ffn / link.flops, hidden * element_bytes / bandwidth,
                           3.0 * hidden * ffn * element_bytes / bandwidth)


def fastermoe_shadowed(load_E: torch.Tensor, costs: ShadowCosts, training: bool) -> torch.Tensor:
    """FasterMoE's greedy rule on the global per-expert loads ``load_E`` (pairs): bool [E],
    the experts to shadow (a host-side decision: every rank computes it from the same loads)."""
    comp_x, feat_x, model_x = (3.0, 4.0, 2.0) if training else (1.0, 2.0, 1.0)
    per_pair = comp_x * costs.comp_s + feat_x * costs.feat_s
    loads, order = torch.sort(load_E.detach().cpu().double(), descending=True)
    shadowed = torch.zeros(load_E.numel(), dtype=torch.bool, device="cpu")
    best, weights_s = per_pair * float(loads[0]) if loads.numel() else 0.0, 0.0
    for i in range(loads.numel() - 1):
        weights_s += model_x * costs.model_s
        latency = per_pair * float(loads[i + 1]) + weights_s
        if latency >= best:
            break
        best = latency
        shadowed[order[i]] = True
    return shadowed.to(load_E.device)


class ShadowDispatcher(Dispatcher):
    """FasterMoE's dynamic shadowing; ``profile``: the machine (a conf/profile name or a YAML
    path) whose link bandwidth and matmul throughput the shadowing rule assumes."""

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
        # the machine whose link bandwidth and matmul throughput the rule weighs (a conf/profile
        # name or a YAML path): the paper's 4 x RTX A6000 by default, whatever the world size;
        # sim_cpu_loopback is this machine, measured at P = 2, 4, 8
        profile: str = "sim_a6000x4"

        def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
            super().check(num_experts=num_experts, top_k=top_k, world_size=world_size)
            try:
                link_at(self.profile, world_size)
            except (FileNotFoundError, ValueError) as exc:
                raise ValueError(f"system.profile={self.profile!r}: {exc}") from exc

    def plan_facts(self, topk_ids_TK, topk_weights_TK):
        """This rank's pairs per expert [E] (what every rank tells every other)."""
        return torch.bincount(topk_ids_TK.flatten(), minlength=self.placement.num_experts)

    def _shadowed_of(self, load_PE: torch.Tensor, shape: RowShape, training: bool) -> torch.Tensor:
        """The experts shadowed for this batch (bool [E]), from every rank's pair counts."""
        costs = ShadowCosts.of(link_at(self.config.profile, self.ep.world_size), shape.hidden, shape.ffn,
                               shape.element_bytes)
        return fastermoe_shadowed(load_PE.sum(0), costs, training)

    def _shadowed(self, topk_ids_TK: torch.Tensor, experts, training: bool, layer: int, rec) -> torch.Tensor:
        """The experts shadowed for this batch (bool [E]): every rank's pair counts, all-gathered."""
        ep = self.ep
        load_PE = all_gather_rows(self.plan_facts(topk_ids_TK, None).view(1, -1), [1] * ep.world_size, ep,
                                  Exchange(layer, "shadow_plan", rec, metadata=True))
        return self._shadowed_of(load_PE, RowShape(experts.w_gate.shape[1], experts.w_gate.shape[2],
                                                   experts.w_gate.dtype), training)

    def _owners(self, shadowed_E: torch.Tensor) -> tuple[torch.Tensor, list]:
        """The shadowed experts by owner then slot [S], and their owners in order (the same list
        on every rank: one broadcast each)."""
        pl = self.placement
        ids_S = pl.global_order()[shadowed_E[pl.global_order()]]
        return ids_S, torch.unique(pl.device_E[ids_S]).tolist()

    def _naive_pairs(self, topk_ids_TK: torch.Tensor, shadowed_E: torch.Tensor, rank: int):
        """This batch's placement (every shadowed expert also on every rank): which pairs
        ``rank`` computes itself (bool [T, K]) and how the others go the naive way
        (:func:`sort_pairs_by_destination`: ``order_R``, ``send_Pe``)."""
        shadow_TK = self.placement.with_replicas(shadowed_E).replicas_EP[topk_ids_TK, rank]
        return (shadow_TK, *sort_pairs_by_destination(topk_ids_TK, self.placement, ~shadow_TK))

    def plan(self, topk_ids_TK, topk_weights_TK, *, rank, shape, facts_PX=None, training=True):
        """``shadow_plan`` (an all-gather of the [E] pair counts), one ``shadow_weights``
        broadcast per owner of shadowed experts (a row of 3 D F weights per expert), then naive
        EP's ``counts``, ``dispatch`` and ``combine`` for the pairs of the other experts."""
        P, E = self.ep.world_size, self.placement.num_experts
        shadowed_E = self._shadowed_of(facts_PX, shape, training)
        ids_S, owners = self._owners(shadowed_E)
        out = [metadata_sends("shadow_plan", rank, [1] * P, E * facts_PX.element_size(), kind=ALL_GATHER)]
        for owner in owners:
            mine = int((self.placement.device_E[ids_S] == owner).sum()) if owner == rank else 0
            out.append(sends("shadow_weights", rank, [mine] * P, shape.bytes_of(3 * shape.hidden * shape.ffn),
                             kind=BROADCAST, differentiable=training))
        _, _, send_Pe = self._naive_pairs(topk_ids_TK, shadowed_E, rank)
        return out + pair_exchange_plan(send_Pe, rank, shape)

    def _shadow_weights(self, shadowed_E: torch.Tensor, experts, training: bool, layer: int, rec
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """The shadowed experts' weights on every rank: ``(ids_S, rows_SW)``, by owner then slot;
        one broadcast per owner (differentiable in training: its backward reduces to the owner)."""
        ep, pl = self.ep, self.placement
        ids_S, owners = self._owners(shadowed_E)
        own_rows = expert_rows(experts)
        pieces = []
        for owner in owners:
            mine = ids_S[pl.device_E[ids_S] == owner]
            rows = gather_rows(own_rows, pl.slot_E[mine]) if owner == ep.rank else \
                own_rows.new_empty((mine.numel(), own_rows.shape[1]))
            pieces.append(broadcast_rows(rows, owner, ep, Exchange(layer, "shadow_weights", rec),
                                         requires_grad=training))
        rows_SW = torch.cat(pieces) if pieces else own_rows[:0]
        return ids_S, rows_SW

    def forward_moe(self, x_TD, topk_ids_TK, topk_weights_TK, experts, *, layer=0, recorder=None):
        rec, ep, K = recorder, self.ep, topk_ids_TK.shape[1]
        training = torch.is_grad_enabled() and experts.w_gate.requires_grad
        with span(rec, layer, "dispatch"):
            shadowed_E = self._shadowed(topk_ids_TK, experts, training, layer, rec)
            ids_S, rows_SW = self._shadow_weights(shadowed_E, experts, training, layer, rec)
            if rec is not None:
                rec.log_counter(layer, "shadowed_experts", ids_S.numel())
            # this batch's placement: every shadowed expert also on every rank; the pairs of a
            # replica are computed here, the others go the naive way
            shadow_TK, order_R, send_Pe = self._naive_pairs(topk_ids_TK, shadowed_E, ep.rank)
            recv_Pe = exchange_counts(send_Pe, ep, Exchange(layer, "counts", rec))
            # device-to-host sync: split sizes go to the collective as Python ints
            send_P, recv_P = send_Pe.sum(1).tolist(), recv_Pe.sum(1).tolist()
            token_R = order_R // K
            x_recv_RD = all_to_all_rows(gather_rows(x_TD, token_R), send_P, recv_P, ep,
                                        Exchange(layer, "dispatch", rec))
            perm_Q = expert_major_order(recv_Pe)
        with span(rec, layer, "experts"):
            y_QD = experts(gather_rows(x_recv_RD, perm_Q), recv_Pe.sum(0))
            shadow_TD = self._shadow_outputs(x_TD, topk_ids_TK, topk_weights_TK, shadow_TK, ids_S, rows_SW,
                                             experts)
        with span(rec, layer, "combine"):
            back_RD = all_to_all_rows(gather_rows(y_QD, inverse_permutation(perm_Q)), recv_P, send_P, ep,
                                      Exchange(layer, "combine", rec))
            out_TD = weighted_scatter_add(x_TD.shape[0], token_R, back_RD, topk_weights_TK.flatten()[order_R])
            return out_TD + shadow_TD

    def _shadow_outputs(self, x_TD, topk_ids_TK, topk_weights_TK, shadow_TK, ids_S, rows_SW, experts):
        """This rank's shadowed pairs, computed here with the broadcast weights and
        gate-weighted: [T, D] (zeros when nothing is shadowed)."""
        K, E = topk_ids_TK.shape[1], self.placement.num_experts
        row_of_E = torch.zeros(E, dtype=torch.long, device=x_TD.device)
        row_of_E[ids_S] = torch.arange(ids_S.numel(), device=x_TD.device)
        pair_V = torch.nonzero(shadow_TK.flatten(), as_tuple=True)[0]
        row_V = row_of_E[topk_ids_TK.flatten()[pair_V]]
        order_V = torch.argsort(row_V, stable=True)
        pair_V, row_V = pair_V[order_V], row_V[order_V]
        D, F = experts.w_gate.shape[1:]
        y_VD = grouped_swiglu(gather_rows(x_TD, pair_V // K), torch.bincount(row_V, minlength=ids_S.numel()),
                              *weights_of_rows(rows_SW, D, F))
        return weighted_scatter_add(x_TD.shape[0], pair_V // K, y_VD, topk_weights_TK.flatten()[pair_V])
