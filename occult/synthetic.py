"""Synthetic routing: top-k expert ids drawn from a known distribution.

Shapes: T tokens, E experts, K top-k.
"""
from __future__ import annotations

from typing import Optional

import torch

# the load workloads (imbalance, incast, trace) are drawn by :mod:`occult.workloads`
ROUTINGS = ("router", "uniform", "zipf", "imbalance", "incast", "trace")


def expert_popularity(kind: str, num_experts: int, zipf_s: float = 1.2) -> torch.Tensor:
    """Sampling weights over experts: uniform, or Zipf (expert i weighted 1 / (i+1)^s)."""
    if kind == "uniform":
        return torch.full((num_experts,), 1.0 / num_experts, dtype=torch.float64, device="cpu")
    if kind == "zipf":
        w = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64, device="cpu") ** zipf_s
        return w / w.sum()
    raise ValueError(f"task.routing={kind!r}: allowed values are {list(ROUTINGS)}")


def gumbel_keys(num_tokens: int, popularity_E: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Per token and expert, log popularity plus Gumbel noise [T, E] (float64): their top-k
    is a draw of K distinct experts without replacement with probabilities ``popularity_E``."""
    E = popularity_E.numel()
    u_TE = torch.rand(num_tokens, E, generator=generator, dtype=torch.float64,
                      device=generator.device).clamp_min_(1e-300)
    # in place, the same operations as log p - log(-log u): a world of 10^6 tokens x 256
    # experts makes these the simulator's largest tensors
    gumbel_TE = u_TE.log_().neg_().log_().neg_()
    return gumbel_TE.add_(popularity_E.to(gumbel_TE.device).log().unsqueeze(0))


def sample_topk(num_tokens: int, top_k: int, popularity_E: torch.Tensor, generator: torch.Generator,
                allowed_E: Optional[torch.Tensor] = None) -> torch.Tensor:
    """K distinct experts per token, drawn without replacement with probabilities
    ``popularity_E`` (Gumbel top-k); ``allowed_E`` (bool [E]) restricts the choice.

    Returns ``topk_ids_TK`` (long).
    """
    keys_TE = gumbel_keys(num_tokens, popularity_E, generator)
    if allowed_E is not None:
        if int(allowed_E.sum()) < top_k:
            raise ValueError(f"only {int(allowed_E.sum())} experts allowed, top_k={top_k}")
        keys_TE = keys_TE.masked_fill(~allowed_E.to(keys_TE.device).unsqueeze(0), float("-inf"))
    return torch.topk(keys_TE, top_k, dim=1).indices


def sample_router(num_tokens: int, top_k: int, popularity_E: torch.Tensor, generator: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic routing with router scores: the Gumbel keys of :func:`sample_topk` as a
    token's router logits, so that its top-k ids are the top-k of its router probabilities
    (as a router's are; what a routing transform such as score pruning assumes).
    Returns ``(topk_ids_TK, probs_TE)`` (probs: the softmax of the keys, float32)."""
    keys_TE = gumbel_keys(num_tokens, popularity_E, generator)
    return torch.topk(keys_TE, top_k, dim=1).indices, torch.softmax(keys_TE, dim=1).float()
