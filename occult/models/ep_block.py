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
        out_TD = self.routed(x_TD)
        if self.family.shared_output is not None:
            with span(active_recorder(), self.layer_idx, "shared_experts"):
                out_TD = out_TD + self.family.shared_output(self, x_TD)
        return out_TD.reshape(shape)

    def _route(self, x_TD: torch.Tensor, rec) -> tuple:
        """The router's choice: ``(probs_TE, topk_ids_TK, topk_weights_TK, logits_TE, choice_TE)``."""
        with span(rec, self.layer_idx, "route"):
            logits_TE, topk_weights_TK, topk_ids_TK = self.gate(x_TD)
            scores_TE = self.rule.scores(logits_TE)
            probs_TE = self.rule.expert_weights(scores_TE, topk_ids_TK)
            choice_TE = self.rule.choice(scores_TE, getattr(self.gate, "e_score_correction_bias", None))
        return probs_TE, topk_ids_TK, topk_weights_TK.to(x_TD.dtype), logits_TE, choice_TE

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts alone, through the system: [..., D] -> [..., D]."""
        x_TD = x.reshape(-1, x.shape[-1])
        rec = active_recorder()
        probs_TE, ids_TK, w_TK, logits_TE, choice_TE = self._route(x_TD, rec)
        out_TD = routed_experts(x_TD, probs_TE, ids_TK, w_TK, self.dispatcher, self.experts, self.layer_idx, rec,
                                logits_TE=logits_TE, choice_TE=choice_TE)
        return out_TD.reshape(x.shape)

    def start(self, x: torch.Tensor):
        """Routes ``x`` and starts its dispatch, for a system that can start one ahead of the
        layer (its record's ``shortcut_overlap``: ``start_moe``; :mod:`occult.models.shortcut`):
        what :meth:`finish` takes, or None (the system cannot, or the layer transforms its routing)."""
        li = self.layer_idx
        can = self.dispatcher.config.capabilities().shortcut_overlap
        if not can or self.dispatcher.routing_transform(li) is not None:
            return None
        x_TD = x.reshape(-1, x.shape[-1])
        rec = active_recorder()
        _, ids_TK, w_TK, logits_TE, _ = self._route(x_TD, rec)
        if rec is not None:
            rec.log_routing(li, ids_TK, w_TK, logits_TE)
        with span(rec, li, "dispatch"):       # what starting blocks (counts, launching the all-to-all)
            return self.dispatcher.start_moe(x_TD, ids_TK, w_TK, layer=li, recorder=rec), x.shape

    def finish(self, started) -> torch.Tensor:
        """The routed experts' output of a started dispatch (:meth:`start`): [..., D]."""
        pending, shape = started
        return self.dispatcher.finish_moe(pending, self.experts).reshape(shape)


def ep_placements(model: nn.Module) -> dict:
    """``{layer: Placement}`` of the model's expert-parallel blocks (empty for a model
    without them, e.g. the no-EP reference)."""
    return {m.layer_idx: m.dispatcher.placement for m in model.modules() if isinstance(m, EPMoEBlock)}
