"""The router's gate rules, the top-k router, and the routing-transform hook.

A gate rule (:class:`GateRule`) is a model family's way from router logits to a token's
experts and their gate weights:

* **scores** ``s_TE``: ``softmax`` over the experts (OLMoE, Qwen, Mixtral, gpt-oss,
  DeepSeek-MoE), ``sigmoid`` (DeepSeek-V3, Kimi K2) or ``sqrtsoftplus``
  (DeepSeek-V4: sqrt(softplus(logit))); always in float32, as transformers does;
* **selection**: the top-k of ``s_TE`` plus the router's correction bias ``b_E`` where it
  has one (DeepSeek-V3's ``noaux_tc``: the bias steers the choice, never the weights),
  optionally **group-limited**: the experts in ``n_group`` equal contiguous groups, a
  group's score the sum of its two best choice scores, the top-k taken inside the
  ``topk_group`` best groups;
* **weights**: the chosen experts' scores, renormalised to sum 1 when ``normalize``
  (gpt-oss's softmax over the top-k logits is exactly softmax scores renormalised),
  times ``scaling`` (DeepSeek's ``routed_scaling_factor``).

Routing transforms (collaboration pruning, the group limit) rewrite a token's choice
after the router: ``(probs_TE, topk_ids_TK, topk_weights_TK, placement) ->
(topk_ids_TK, topk_weights_TK)``, where ``probs_TE`` is every expert's weight at the
token's normalisation (:meth:`GateRule.expert_weights`: the softmax probabilities for
a softmax rule without renormalisation, so ``topk_weights_TK`` is its gather). A
transform that ranks experts as the router does sets ``takes_choice = True`` and is
also given ``choice_TE=`` (the router's selection scores, bias included). ``None``
means identity. A transform may drop pairs: an id of NO_EXPERT (weight 0) is a slot
the token does not use; systems that accept dropped pairs say so
(``SystemConfig.accepts_dropped_pairs``).

Shapes: T tokens, D hidden, E experts, K top-k, G groups, e experts per group.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as nnf
from torch import nn

from .placement import Placement

NO_EXPERT = -1
RoutingTransform = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Placement],
                            tuple[torch.Tensor, torch.Tensor]]
SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")


def group_mask(choice_TE: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """The experts each token may choose under a group limit: the ``topk_group`` of
    ``n_group`` equal contiguous expert groups with the highest sum of their two best
    choice scores (one-expert groups: that expert's score): [T, E] -> [T, E] bool."""
    T, E = choice_TE.shape
    per = E // n_group
    grouped_TGe = choice_TE.view(T, n_group, per)
    score_TG = grouped_TGe.topk(min(2, per), dim=-1).values.sum(-1)
    keep_TG = torch.zeros_like(score_TG, dtype=torch.bool).scatter_(
        1, torch.topk(score_TG, topk_group, dim=-1).indices, True)
    return keep_TG.unsqueeze(-1).expand(T, n_group, per).reshape(T, E)


@dataclass(frozen=True)
class GateRule:
    """A family's gate: scores, (group-limited) selection, weights; see the module."""

    scoring: str = "softmax"
    normalize: bool = False
    scaling: float = 1.0
    n_group: int = 1
    topk_group: int = 1

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"model.scoring_func={self.scoring!r}: allowed values are {list(SCORINGS)}")

    def check(self, num_experts: int, top_k: int) -> None:
        """Raises ``ValueError`` (one line, naming the field) unless the groups divide the
        experts and the chosen groups can hold K experts."""
        G, M = self.n_group, self.topk_group
        if G < 1 or num_experts % G:
            allowed = [g for g in range(1, num_experts + 1) if num_experts % g == 0]
            raise ValueError(f"model.n_group={G}: allowed values divide model.num_experts={num_experts}: {allowed}")
        if not 1 <= M <= G:
            raise ValueError(f"model.topk_group={M}: allowed values are 1..model.n_group={G}")
        if M * (num_experts // G) < top_k:
            need = -(-top_k // (num_experts // G))
            raise ValueError(f"model.topk_group={M}: {M} group(s) x {num_experts // G} experts cannot hold "
                             f"model.top_k={top_k}; allowed values are {need}..{G}")

    @property
    def group_limited(self) -> bool:
        return self.topk_group < self.n_group

    def scores(self, logits_TE: torch.Tensor) -> torch.Tensor:
        """``s_TE`` in float32: [T, E] -> [T, E]."""
        z_TE = logits_TE.float()
        if self.scoring == "softmax":
            return torch.softmax(z_TE, dim=-1)
        if self.scoring == "sigmoid":
            return torch.sigmoid(z_TE)
        return nnf.softplus(z_TE).sqrt()

    def choice(self, scores_TE: torch.Tensor, bias_E: Optional[torch.Tensor] = None) -> torch.Tensor:
        """What the selection ranks by: the scores plus the correction bias: [T, E]."""
        return scores_TE if bias_E is None else scores_TE + bias_E.float()

    def select(self, choice_TE: torch.Tensor, top_k: int) -> torch.Tensor:
        """The top-k of the choice scores, inside the best groups: [T, E] -> [T, K]."""
        c_TE = choice_TE.detach()
        if self.group_limited:
            c_TE = c_TE.masked_fill(~group_mask(c_TE, self.n_group, self.topk_group), -torch.inf)
        return torch.topk(c_TE, top_k, dim=-1).indices

    def weigh(self, scores_TE: torch.Tensor, topk_ids_TK: torch.Tensor) -> torch.Tensor:
        """The chosen experts' gate weights: [T, E], [T, K] -> [T, K] (float32). Dropped
        slots (``NO_EXPERT``) weigh 0 and count in no normalisation."""
        live_TK = topk_ids_TK >= 0
        w_TK = scores_TE.gather(1, topk_ids_TK.clamp_min(0)) * live_TK
        if self.normalize:
            w_TK = w_TK / (w_TK.sum(dim=1, keepdim=True) + 1e-20)
        return w_TK * self.scaling

    def expert_weights(self, scores_TE: torch.Tensor, topk_ids_TK: torch.Tensor) -> torch.Tensor:
        """Every expert's gate weight at the normalisation of the token's chosen experts
        (what routing transforms gather from; its gather at ``topk_ids_TK`` is
        :meth:`weigh`): [T, E] -> [T, E]."""
        if not self.normalize:
            return scores_TE * self.scaling
        chosen_T1 = (scores_TE.gather(1, topk_ids_TK.clamp_min(0)) * (topk_ids_TK >= 0)).sum(1, keepdim=True)
        return scores_TE * (self.scaling / (chosen_T1 + 1e-20))

    def route(self, logits_TE: torch.Tensor, top_k: int, bias_E: Optional[torch.Tensor] = None):
        """``(scores_TE, choice_TE, topk_ids_TK, topk_weights_TK)`` of router logits."""
        scores_TE = self.scores(logits_TE)
        choice_TE = self.choice(scores_TE, bias_E)
        topk_ids_TK = self.select(choice_TE, top_k)
        return scores_TE, choice_TE, topk_ids_TK, self.weigh(scores_TE, topk_ids_TK)


SOFTMAX_TOPK = GateRule()


def gate_weights(probs_TE: torch.Tensor, topk_ids_TK: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """The gate weight of each chosen expert under a softmax rule: its router probability,
    optionally renormalised."""
    return GateRule(normalize=renormalize).weigh(probs_TE, topk_ids_TK)


class TopKRouter(nn.Module):
    """Linear router with a gate rule (default: softmax top-k, the rule OLMoE uses);
    ``bias_E``: the correction bias of a rule that selects with one (a buffer, no
    gradient)."""

    def __init__(self, weight_ED: torch.Tensor, top_k: int, renormalize: bool = False,
                 rule: Optional[GateRule] = None, bias_E: Optional[torch.Tensor] = None):
        super().__init__()
        self.weight = nn.Parameter(weight_ED)
        self.top_k = top_k
        self.rule = rule if rule is not None else GateRule(normalize=renormalize)
        self.register_buffer("bias_E", None if bias_E is None else bias_E.clone())

    def forward(self, x_TD: torch.Tensor, forced_ids_TK: Optional[torch.Tensor] = None):
        """Returns ``(probs_TE, topk_ids_TK, topk_weights_TK)``; ``probs_TE`` are the
        experts' weights at the token's normalisation (:meth:`GateRule.expert_weights`).

        ``forced_ids_TK`` replaces the router's choice (synthetic routing); the
        gate weights still come from the router, so it still gets gradients.
        """
        probs_TE, _, topk_ids_TK, topk_weights_TK = self.route(x_TD, forced_ids_TK)
        return probs_TE, topk_ids_TK, topk_weights_TK

    def route(self, x_TD: torch.Tensor, forced_ids_TK: Optional[torch.Tensor] = None):
        """As :meth:`forward`, with the selection scores (bias included) second:
        ``(probs_TE, choice_TE, topk_ids_TK, topk_weights_TK)``."""
        scores_TE, choice_TE, topk_ids_TK, _ = self.rule.route(x_TD @ self.weight.t(), self.top_k, self.bias_E)
        if forced_ids_TK is not None:
            topk_ids_TK = forced_ids_TK
        topk_weights_TK = self.rule.weigh(scores_TE, topk_ids_TK).to(x_TD.dtype)
        return self.rule.expert_weights(scores_TE, topk_ids_TK), choice_TE, topk_ids_TK, topk_weights_TK
