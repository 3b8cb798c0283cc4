"""Top-k router and the routing-transform hook.

Shapes: T tokens, D hidden, E experts, K top-k.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from .placement import Placement

# A routing transform rewrites a token's expert choice after the router (the
# hook collaboration pruning uses): (probs_TE, topk_ids_TK, topk_weights_TK,
# placement) -> (topk_ids_TK, topk_weights_TK). ``None`` means identity. A transform
# may drop pairs: an id of NO_EXPERT (weight 0) is a slot the token does not use;
# systems that accept dropped pairs say so (``SystemConfig.accepts_dropped_pairs``).
NO_EXPERT = -1
RoutingTransform = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Placement],
                            tuple[torch.Tensor, torch.Tensor]]


def gate_weights(probs_TE: torch.Tensor, topk_ids_TK: torch.Tensor, renormalize: bool) -> torch.Tensor:
    """The gate weight of each chosen expert: its router probability, optionally renormalised."""
    w_TK = probs_TE.gather(1, topk_ids_TK)
    if renormalize:
        w_TK = w_TK / w_TK.sum(dim=1, keepdim=True)
    return w_TK


class TopKRouter(nn.Module):
    """Linear router, softmax over experts, top-k (the rule OLMoE and Qwen-MoE use)."""

    def __init__(self, weight_ED: torch.Tensor, top_k: int, renormalize: bool = False):
        super().__init__()
        self.weight = nn.Parameter(weight_ED)
        self.top_k = top_k
        self.renormalize = renormalize

    def forward(self, x_TD: torch.Tensor, forced_ids_TK: Optional[torch.Tensor] = None):
        """Returns ``(probs_TE, topk_ids_TK, topk_weights_TK)``.

        ``forced_ids_TK`` replaces the router's choice (synthetic routing); the
        gate weights still come from the router, so it still gets gradients.
        """
        probs_TE = torch.softmax((x_TD @ self.weight.t()).float(), dim=-1)
        if forced_ids_TK is None:
            topk_ids_TK = torch.topk(probs_TE, self.top_k, dim=-1).indices
        else:
            topk_ids_TK = forced_ids_TK
        topk_weights_TK = gate_weights(probs_TE, topk_ids_TK, self.renormalize).to(x_TD.dtype)
        return probs_TE, topk_ids_TK, topk_weights_TK
