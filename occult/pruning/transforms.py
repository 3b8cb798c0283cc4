"""Collaboration pruning: routing transforms that let each token use experts on at
most ``budget`` devices (Occult's N_d'), so that C_T <= budget.

Both transforms match :data:`occult.ep.router.RoutingTransform`:
``(probs_TE, topk_ids_TK, topk_weights_TK, placement) -> (topk_ids_TK, topk_weights_TK)``;
the MoE layer calls them between the router and the dispatcher.

- :class:`ScorePruning` (routing-score-based): per token, keep the ``budget``
  devices with the highest device score, then take the top-k experts among the
  experts on them. Device score = the sum (default) or the max of the token's
  router probabilities over the device's experts *(open: the paper's choice is
  not known here)*. With ``max``, a budget >= min(K, P) never changes the
  routing; with ``sum``, only a budget >= P is guaranteed not to (a device
  with many small probabilities can outrank one holding a single top-k expert).
  The choice is rebuilt from ``probs_TE``: it assumes the incoming ids are the
  router's top-k (forced synthetic routing is not).
- :class:`SimilarityPruning`: keep the original top-k; the allowed devices are
  the ``budget`` devices that hold the most of the token's top-k router
  probability (devices holding any top-k expert always rank above those that
  hold none); every selected expert on a disallowed device is replaced by the
  most similar *unselected* expert on an allowed device, slot by slot in the
  router's order, each substitute used once per token. Similarity is an
  E x E matrix, the cosine similarity of the experts' router-logit columns
  over a profiling set (:func:`expert_similarity`).

Experts that stay keep their slot and their incoming gate weight; a substitute
takes the slot of the expert it replaces. Its gate weight follows
``weight_rule`` *(open: the paper's choice is not known here)*:

- ``own``: the substitute's own router probability (default for ``score``,
  which is plain top-k within the allowed devices);
- ``replaced``: the replaced expert's incoming weight (default for
  ``similarity``);
- ``renormalize``: kept weights and substitutes' own probabilities, rescaled so
  that the token's weights sum to the original sum.

- :class:`GroupLimit`: DeepSeek-V3's group-limited routing with the devices as the
  groups: per token, the ``topk_group`` devices whose two best experts' selection
  scores sum highest, then the top-k of the selection scores among their experts.
  It ranks as the router does (``takes_choice``: the router's selection scores,
  DeepSeek-V3's correction bias included); with ``topk_group`` = P it is the router's
  own top-k.

Gate weights are gathered from ``probs_TE`` (every expert's weight at the token's
normalisation, :meth:`occult.ep.router.GateRule.expert_weights`; or are the incoming
weights, which the router gathered from it), so the router keeps its gradient. Tokens
whose routing does not change keep their ids and weights bit for bit.

Shapes: T tokens, E experts, K top-k, P devices, e = E / P local experts,
N profiling tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from ..ep.placement import Placement
from ..ep.router import group_mask

WEIGHT_RULES = ("own", "replaced", "renormalize")
DEVICE_SCORES = ("sum", "max")
PRUNING_KINDS = ("score", "similarity")


def min_budget(top_k: int, num_local: int) -> int:
    """The smallest feasible device budget: ceil(K / e)."""
    return math.ceil(top_k / num_local)


def check_budget(budget: int, top_k: Optional[int] = None, num_local: Optional[int] = None,
                 world_size: Optional[int] = None) -> None:
    """Raises ``ValueError`` unless ``budget`` is an integer >= 1 whose devices can hold K
    experts (budget * e >= K; checked when ``top_k`` and ``num_local`` are given) and at
    most the world size (checked when ``world_size`` is given)."""
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"system.budget={budget!r}: allowed values are integers >= 1 (devices per token)")
    if world_size is not None and budget > world_size:
        raise ValueError(
            f"system.budget={budget} is above cluster.world_size={world_size}: a token can use at most "
            f"{world_size} devices, so this budget would not prune anything; allowed values are "
            f"1..{world_size} (budget={world_size} is the unpruned routing)")
    if top_k is not None and num_local is not None and budget * num_local < top_k:
        raise ValueError(
            f"system.budget={budget} is infeasible: {budget} device(s) x {num_local} experts per device "
            f"= {budget * num_local} < top_k={top_k}; the minimum feasible budget is "
            f"{min_budget(top_k, num_local)}")


def _check_choice(field: str, value: str, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"system.{field}={value!r}: allowed values are {list(allowed)}")


def expert_similarity(logits_NE: torch.Tensor, center: bool = False) -> torch.Tensor:
    """Cosine similarity of the experts' router-logit columns: [N, E] -> [E, E] (float32).

    ``center=True`` subtracts each token's mean logit first (softmax ignores that
    shift); the default is the plain cosine the paper describes.
    """
    if logits_NE.dim() != 2 or logits_NE.shape[0] == 0:
        raise ValueError(f"logits_NE must have shape [N, E] with N >= 1, got {tuple(logits_NE.shape)}")
    x_NE = logits_NE.detach().double()
    if center:
        x_NE = x_NE - x_NE.mean(dim=1, keepdim=True)
    x_NE = x_NE / x_NE.norm(dim=0, keepdim=True).clamp_min(1e-12)
    return (x_NE.t() @ x_NE).float()


def device_scores(probs_TE: torch.Tensor, placement: Placement, how: str = "sum") -> torch.Tensor:
    """Each device's score for each token: sum or max of the token's probabilities over the
    device's experts: [T, E] -> [T, P]."""
    _check_choice("device_score", how, DEVICE_SCORES)
    T, P = probs_TE.shape[0], placement.num_devices
    grouped_TPe = probs_TE[:, placement.global_order().to(probs_TE.device)].view(T, P, placement.num_local)
    return grouped_TPe.sum(-1) if how == "sum" else grouped_TPe.amax(-1)


def _top_devices(score_TP: torch.Tensor, budget: int) -> torch.Tensor:
    """The ``budget`` highest-scoring devices of each token, as a mask: [T, P] -> [T, P] bool."""
    top_TB = torch.topk(score_TP, min(budget, score_TP.shape[1]), dim=1).indices
    return torch.zeros_like(score_TP, dtype=torch.bool).scatter_(1, top_TB, True)


def _selected_mask(topk_ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Which experts each token selected: [T, K] -> [T, E] bool."""
    mask_TE = torch.zeros(topk_ids_TK.shape[0], num_experts, dtype=torch.bool, device=topk_ids_TK.device)
    return mask_TE.scatter_(1, topk_ids_TK, True)


def _gate_weights(probs_TE: torch.Tensor, weights_in_TK: torch.Tensor, ids_out_TK: torch.Tensor,
                  replaced_TK: torch.Tensor, rule: str) -> torch.Tensor:
    """Gate weights of the pruned choice: [T, K] (dtype of ``weights_in_TK``).

    Kept slots keep their incoming weight; a substitute (``replaced_TK``) gets its own
    probability (``own``), the replaced expert's weight (``replaced``), or its own
    probability with the token's weights rescaled to the original sum (``renormalize``).
    """
    if rule == "replaced":
        return weights_in_TK
    own_TK = torch.where(replaced_TK, probs_TE.gather(1, ids_out_TK).to(weights_in_TK.dtype), weights_in_TK)
    if rule == "own":
        return own_TK
    changed_T1 = replaced_TK.any(dim=1, keepdim=True)
    scale_T1 = weights_in_TK.float().sum(1, keepdim=True) / own_TK.float().sum(1, keepdim=True)
    return torch.where(changed_T1, (own_TK.float() * scale_T1).to(weights_in_TK.dtype), weights_in_TK)


def _check_inputs(probs_TE: torch.Tensor, topk_ids_TK: torch.Tensor, placement: Placement, budget: int) -> None:
    """Shapes agree with the placement, and the budget can hold K experts."""
    if probs_TE.shape[1] != placement.num_experts:
        raise ValueError(f"probs_TE has {probs_TE.shape[1]} experts, the placement {placement.num_experts}")
    check_budget(budget, topk_ids_TK.shape[1], placement.num_local)


@dataclass(frozen=True)
class ScorePruning:
    """Routing-score-based pruning: the ``budget`` best devices by device score, then top-k
    among their experts. ``device_score``: ``sum`` | ``max``; ``weight_rule``: see module."""

    budget: int
    device_score: str = "sum"
    weight_rule: str = "own"

    def __post_init__(self) -> None:
        check_budget(self.budget)
        _check_choice("device_score", self.device_score, DEVICE_SCORES)
        _check_choice("weight_rule", self.weight_rule, WEIGHT_RULES)

    def allowed_devices(self, probs_TE: torch.Tensor, placement: Placement) -> torch.Tensor:
        """Devices each token may use: [T, E] -> [T, P] bool."""
        return _top_devices(device_scores(probs_TE.detach(), placement, self.device_score), self.budget)

    def __call__(self, probs_TE, topk_ids_TK, topk_weights_TK, placement):
        _check_inputs(probs_TE, topk_ids_TK, placement, self.budget)
        allowed_TE = self.allowed_devices(probs_TE, placement)[:, placement.device_E.to(probs_TE.device)]
        ids_out_TK, replaced_TK = _rechoose(probs_TE.detach().masked_fill(~allowed_TE, -torch.inf), topk_ids_TK)
        return ids_out_TK, _gate_weights(probs_TE, topk_weights_TK, ids_out_TK, replaced_TK, self.weight_rule)


def _rechoose(masked_TE: torch.Tensor, topk_ids_TK: torch.Tensor) -> tuple:
    """The top-k of ``masked_TE`` (disallowed experts at -inf) as a rewrite of the incoming
    choice: experts that stay keep their slot, the j-th dropped slot (in slot order) takes
    the j-th best entering expert. Returns ``(ids_out_TK, replaced_TK)``."""
    E, K = masked_TE.shape[1], topk_ids_TK.shape[1]
    new_TE = _selected_mask(torch.topk(masked_TE, K, dim=1).indices, E)
    kept_TK = new_TE.gather(1, topk_ids_TK)
    entering_TK = torch.topk(masked_TE.masked_fill(~(new_TE & ~_selected_mask(topk_ids_TK, E)), -torch.inf),
                             K, dim=1).indices
    rank_TK = (torch.cumsum((~kept_TK).long(), dim=1) - 1).clamp_min(0)
    return torch.where(kept_TK, topk_ids_TK, entering_TK.gather(1, rank_TK)), ~kept_TK


@dataclass(frozen=True)
class GroupLimit:
    """DeepSeek-V3's group limit over devices: the ``topk_group`` devices with the highest
    sum of their two best selection scores, then the top-k inside them (see module).
    ``weight_rule``: ``renormalize`` (default: DeepSeek-V3 renormalises the weights of
    whatever it chose, and a rescale to the original sum is that renormalisation under a
    renormalising rule) | ``own`` | ``replaced``."""

    topk_group: int
    weight_rule: str = "renormalize"
    takes_choice = True

    def __post_init__(self) -> None:
        if isinstance(self.topk_group, bool) or not isinstance(self.topk_group, int) or self.topk_group < 1:
            raise ValueError(f"system.topk_group={self.topk_group!r}: allowed values are integers >= 1 "
                             "(devices per token)")
        _check_choice("weight_rule", self.weight_rule, WEIGHT_RULES)

    def allowed_experts(self, choice_TE: torch.Tensor, placement: Placement) -> torch.Tensor:
        """Experts each token may use: [T, E] -> [T, E] bool (in expert order)."""
        order_E = placement.global_order().to(choice_TE.device)
        grouped_TE = group_mask(choice_TE.detach()[:, order_E], placement.num_devices, self.topk_group)
        return torch.empty_like(grouped_TE).scatter_(1, order_E.expand_as(grouped_TE), grouped_TE)

    def __call__(self, probs_TE, topk_ids_TK, topk_weights_TK, placement, choice_TE=None):
        _check_inputs(probs_TE, topk_ids_TK, placement, self.topk_group)
        if self.topk_group >= placement.num_devices:      # every device: no limit
            return topk_ids_TK, topk_weights_TK
        choice_TE = probs_TE if choice_TE is None else choice_TE
        allowed_TE = self.allowed_experts(choice_TE, placement)
        ids_out_TK, replaced_TK = _rechoose(choice_TE.detach().masked_fill(~allowed_TE, -torch.inf), topk_ids_TK)
        return ids_out_TK, _gate_weights(probs_TE, topk_weights_TK, ids_out_TK, replaced_TK, self.weight_rule)


@dataclass(frozen=True, eq=False)
class SimilarityPruning:
    """Similarity-based pruning: keep the top-k, replace experts on disallowed devices by
    the most similar unselected experts on allowed ones. ``similarity_EE``: [E, E]
    (:func:`expert_similarity`); ``weight_rule``: see module."""

    budget: int
    similarity_EE: torch.Tensor
    weight_rule: str = "replaced"

    def __post_init__(self) -> None:
        check_budget(self.budget)
        _check_choice("weight_rule", self.weight_rule, WEIGHT_RULES)
        sim = self.similarity_EE
        if sim.dim() != 2 or sim.shape[0] != sim.shape[1]:
            raise ValueError(f"similarity_EE must be a square [E, E] matrix, got {tuple(sim.shape)}")

    @classmethod
    def from_logits(cls, logits_NE: torch.Tensor, budget: int, weight_rule: str = "replaced",
                    center: bool = False) -> "SimilarityPruning":
        """Builds the similarity from profiling router logits [N, E]."""
        return cls(budget, expert_similarity(logits_NE, center), weight_rule)

    def allowed_devices(self, probs_TE: torch.Tensor, topk_ids_TK: torch.Tensor,
                        placement: Placement) -> torch.Tensor:
        """The ``budget`` devices holding the most of the token's top-k probability: [T, P] bool.

        Devices that hold any top-k expert rank above those that hold none (so a token
        already within budget is never changed, even if a probability underflows to 0).
        """
        T, P = topk_ids_TK.shape[0], placement.num_devices
        dev_TK = placement.device_E.to(topk_ids_TK.device)[topk_ids_TK]
        mass_TP = torch.zeros(T, P, dtype=torch.float64, device=probs_TE.device).scatter_add_(
            1, dev_TK, probs_TE.detach().gather(1, topk_ids_TK).double())
        used_TP = torch.zeros(T, P, dtype=torch.bool, device=probs_TE.device).scatter_(1, dev_TK, True)
        return _top_devices(mass_TP + 2.0 * used_TP, self.budget)

    def __call__(self, probs_TE, topk_ids_TK, topk_weights_TK, placement):
        _check_inputs(probs_TE, topk_ids_TK, placement, self.budget)
        E, K = placement.num_experts, topk_ids_TK.shape[1]
        if self.similarity_EE.shape[0] != E:
            raise ValueError(f"similarity_EE is for {self.similarity_EE.shape[0]} experts, the placement has {E}")
        device_E = placement.device_E.to(topk_ids_TK.device)
        allowed_TP = self.allowed_devices(probs_TE, topk_ids_TK, placement)
        replaced_TK = ~allowed_TP.gather(1, device_E[topk_ids_TK])
        free_TE = allowed_TP[:, device_E] & ~_selected_mask(topk_ids_TK, E)
        sim_EE = self.similarity_EE.to(probs_TE.device)
        ids_out_TK = topk_ids_TK.clone()
        for k in range(K):                     # vectorised over tokens; K is small
            need_T = replaced_TK[:, k]
            score_TE = sim_EE[topk_ids_TK[:, k]].masked_fill(~free_TE, -torch.inf)
            sub_T = torch.argmax(score_TE, dim=1)
            ids_out_TK[:, k] = torch.where(need_T, sub_T, ids_out_TK[:, k])
            # a substitute is used once per token
            free_TE.scatter_(1, sub_T.unsqueeze(1), free_TE.gather(1, sub_T.unsqueeze(1)) & ~need_T.unsqueeze(1))
        return ids_out_TK, _gate_weights(probs_TE, topk_weights_TK, ids_out_TK, replaced_TK, self.weight_rule)


def make_pruning(kind: str, budget: int, *, similarity_EE: Optional[torch.Tensor] = None,
                 weight_rule: Optional[str] = None, device_score: str = "sum"):
    """The transform for ``kind`` (``score`` | ``similarity``); ``weight_rule=None`` takes the
    kind's default (``own`` for score, ``replaced`` for similarity)."""
    _check_choice("pruning", kind, PRUNING_KINDS)
    if kind == "score":
        return ScorePruning(budget, device_score, weight_rule or "own")
    if similarity_EE is None:
        raise ValueError("system.pruning='similarity' needs similarity_EE (expert_similarity of "
                         "profiling router logits)")
    return SimilarityPruning(budget, similarity_EE, weight_rule or "replaced")
