"""The expert-parallel MoE layer and the single-device reference.

    route -> optional routing transform -> the system's forward_moe (for a split
    dispatcher: dispatch -> grouped experts -> combine)

Shapes: T tokens on this rank, D hidden, E experts, K top-k, e local experts.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .accounting import Recorder, span
from .dispatcher import Dispatcher
from .experts import GroupedExperts, swiglu
from .router import GateRule, RoutingTransform, TopKRouter


class MoELayer(nn.Module):
    """One MoE layer on one rank: replicated router, this rank's experts, a dispatcher."""

    def __init__(self, router: TopKRouter, experts: GroupedExperts, dispatcher: Dispatcher,
                 layer_idx: int = 0, transform: Optional[RoutingTransform] = None):
        super().__init__()
        self.router = router
        self.experts = experts
        self.dispatcher = dispatcher
        self.layer_idx = layer_idx
        self.transform = transform

    @classmethod
    def from_global(cls, router_weight_ED: torch.Tensor, expert_weights: dict, top_k: int,
                    dispatcher: Dispatcher, renormalize: bool = False, layer_idx: int = 0,
                    transform: Optional[RoutingTransform] = None, rule: Optional[GateRule] = None,
                    bias_E: Optional[torch.Tensor] = None) -> "MoELayer":
        """Builds the rank's layer from the full weights, keeping only its own experts
        (``rule``, ``bias_E``: the router's gate rule and correction bias; default softmax
        top-k, renormalised when ``renormalize``)."""
        local = dispatcher.local_expert_ids
        experts = GroupedExperts(*(expert_weights[k][local].clone() for k in ("w_gate", "w_up", "w_down")))
        router = TopKRouter(router_weight_ED.clone(), top_k, renormalize, rule, bias_E)
        return cls(router, experts, dispatcher, layer_idx, transform)

    def forward(self, x_TD: torch.Tensor, recorder: Optional[Recorder] = None,
                forced_ids_TK: Optional[torch.Tensor] = None) -> torch.Tensor:
        with span(recorder, self.layer_idx, "route"):
            probs_TE, choice_TE, topk_ids_TK, topk_weights_TK = self.router.route(x_TD, forced_ids_TK)
        return routed_experts(x_TD, probs_TE, topk_ids_TK, topk_weights_TK, self.dispatcher, self.experts,
                              self.layer_idx, recorder, self.transform, choice_TE=choice_TE)


def routed_experts(x_TD: torch.Tensor, probs_TE: torch.Tensor, topk_ids_TK: torch.Tensor,
                   topk_weights_TK: torch.Tensor, dispatcher: Dispatcher, experts: GroupedExperts,
                   layer_idx: int, recorder: Optional[Recorder] = None,
                   transform: Optional[RoutingTransform] = None,
                   logits_TE: Optional[torch.Tensor] = None,
                   choice_TE: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The routed part of every EP MoE layer, after the router: the routing transform
    (the layer's own, else the system's), then the system's ``forward_moe``: [T, D] -> [T, D].

    ``probs_TE``: every expert's gate weight at the token's normalisation; ``choice_TE``:
    the router's selection scores (default ``probs_TE``), for a transform that ranks
    experts as the router does (:mod:`occult.ep.router`)."""
    rec, li = recorder, layer_idx
    if (transform or dispatcher.routing_transform(li)) is not None:
        with span(rec, li, "route"):
            topk_ids_TK, topk_weights_TK = transformed_routing(dispatcher, li, probs_TE, topk_ids_TK,
                                                               topk_weights_TK, transform, choice_TE)
    if rec is not None:
        rec.log_routing(li, topk_ids_TK, topk_weights_TK, logits_TE)
    return dispatcher.forward_moe(x_TD, topk_ids_TK, topk_weights_TK, experts, layer=li, recorder=rec)


def transformed_routing(dispatcher: Dispatcher, layer_idx: int, probs_TE: Optional[torch.Tensor],
                        topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                        transform: Optional[RoutingTransform] = None,
                        choice_TE: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing the system's exchange runs with: the router's top-k ids and weights after
    the routing transform (the layer's own, else the system's; none: unchanged); a transform
    that ranks as the router does also gets ``choice_TE`` (default ``probs_TE``). Also what
    the traffic simulator plans with (:mod:`occult.ep.plan`)."""
    transform = transform or dispatcher.routing_transform(layer_idx)
    if transform is None:
        return topk_ids_TK, topk_weights_TK
    extra = {"choice_TE": probs_TE if choice_TE is None else choice_TE} \
        if getattr(transform, "takes_choice", False) else {}
    return transform(probs_TE, topk_ids_TK, topk_weights_TK, dispatcher.placement, **extra)


def reference_moe(x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                  expert_weights: dict) -> torch.Tensor:
    """Single-device top-k MoE: ``out_t = sum_k w_tk * expert_{id_tk}(x_t)``, [T, D] -> [T, D].

    Deliberately plain (a loop over experts) so that it is obviously right: the
    ground truth of every parity test.
    """
    out_TD = torch.zeros_like(x_TD)
    for expert in torch.unique(topk_ids_TK).tolist():
        if expert < 0:                  # a dropped pair (a routing transform's NO_EXPERT)
            continue
        tok, slot = torch.nonzero(topk_ids_TK == expert, as_tuple=True)
        y = swiglu(x_TD[tok], expert_weights["w_gate"][expert], expert_weights["w_up"][expert],
                   expert_weights["w_down"][expert])
        out_TD = out_TD.index_add(0, tok, y * topk_weights_TK[tok, slot].unsqueeze(1))
    return out_TD


class ReferenceMoE(nn.Module):
    """The single-device MoE layer (no expert parallelism): router plus all E experts."""

    def __init__(self, router_weight_ED: torch.Tensor, expert_weights: dict, top_k: int,
                 renormalize: bool = False, rule: Optional[GateRule] = None,
                 bias_E: Optional[torch.Tensor] = None):
        super().__init__()
        self.router = TopKRouter(router_weight_ED.clone(), top_k, renormalize, rule, bias_E)
        self.w_gate = nn.Parameter(expert_weights["w_gate"].clone())
        self.w_up = nn.Parameter(expert_weights["w_up"].clone())
        self.w_down = nn.Parameter(expert_weights["w_down"].clone())

    def forward(self, x_TD: torch.Tensor, forced_ids_TK: Optional[torch.Tensor] = None) -> torch.Tensor:
        _, topk_ids_TK, topk_weights_TK = self.router(x_TD, forced_ids_TK)
        weights = {"w_gate": self.w_gate, "w_up": self.w_up, "w_down": self.w_down}
        return reference_moe(x_TD, topk_ids_TK, topk_weights_TK, weights)
