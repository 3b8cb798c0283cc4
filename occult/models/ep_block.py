"""The expert-parallel replacement of a transformers MoE block.

It keeps the model's own router module (``block.gate``: its gate rule, and the
module transformers records router logits from) and shared experts, holds only
the routed experts that the placement gives this rank, and runs the routed part
through a dispatcher (:func:`occult.ep.layer.routed_experts`). The router chooses the
experts and their weights; the model's :class:`occult.ep.router.GateRule` (the same
rule, restated by the harness and tested equal to the router) gives the routing
transforms every expert's weight and the router's selection scores.

Shapes: B batch, S sequence, T = B*S tokens on this rank, D hidden, E experts, K top-k.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..ep import Dispatcher, GateRule, GroupedExperts
from ..ep.accounting import active_recorder, span
from ..ep.layer import routed_experts
from .families import Family, expert_weights_from_block

SHARED_MODULES = ("shared_expert", "shared_expert_gate", "shared_experts")


class EPMoEBlock(nn.Module):
    def __init__(self, hf_block: nn.Module, family: Family, dispatcher: Dispatcher, layer_idx: int,
                 rule: Optional[GateRule] = None):
        super().__init__()
        self.rule = rule if rule is not None else GateRule()
        self.gate = hf_block.gate
        weights = expert_weights_from_block(hf_block)
        local = dispatcher.local_expert_ids
        self.experts = GroupedExperts(*(weights[k][local].detach().clone().contiguous()
                                        for k in ("w_gate", "w_up", "w_down")))
        for name in SHARED_MODULES:
            if hasattr(hf_block, name):
                setattr(self, name, getattr(hf_block, name))
        self.family = family
        self.dispatcher = dispatcher
        self.layer_idx = layer_idx

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        x_TD = hidden_states.reshape(-1, shape[-1])
        rec = active_recorder()
        with span(rec, self.layer_idx, "route"):
            logits_TE, topk_weights_TK, topk_ids_TK = self.gate(x_TD)
            scores_TE = self.rule.scores(logits_TE)
            probs_TE = self.rule.expert_weights(scores_TE, topk_ids_TK)
            choice_TE = self.rule.choice(scores_TE, getattr(self.gate, "e_score_correction_bias", None))
        out_TD = routed_experts(x_TD, probs_TE, topk_ids_TK, topk_weights_TK.to(x_TD.dtype), self.dispatcher,
                                self.experts, self.layer_idx, rec, logits_TE=logits_TE, choice_TE=choice_TE)
        if self.family.shared_output is not None:
            with span(rec, self.layer_idx, "shared_experts"):
                out_TD = out_TD + self.family.shared_output(self, x_TD)
        return out_TD.reshape(shape)


def ep_placements(model: nn.Module) -> dict:
    """``{layer: Placement}`` of the model's expert-parallel blocks (empty for a model
    without them, e.g. the no-EP reference)."""
    return {m.layer_idx: m.dispatcher.placement for m in model.modules() if isinstance(m, EPMoEBlock)}
