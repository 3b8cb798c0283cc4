"""Co-activation profiling: how often two experts serve the same token.

Occult's placement rescheduling groups experts that are often chosen together
onto one device. The input is a routing trace of one MoE layer (the top-k ids
of N profiling tokens); the output is a symmetric E x E count matrix whose
entry (i, j) is the number of tokens that chose both i and j, and whose
diagonal is each expert's load (the number of tokens that chose it).

Shapes: N profiling tokens (T when the trace is a batch), E experts, K top-k.
"""
from __future__ import annotations

import torch


def _check_ids(topk_ids_TK: torch.Tensor, num_experts: int) -> None:
    """Raise ``ValueError`` if the ids are not a [T, K] integer tensor within [0, E)."""
    if topk_ids_TK.dim() != 2:
        raise ValueError(f"topk_ids_TK must have shape [T, K], got {tuple(topk_ids_TK.shape)}")
    if topk_ids_TK.dtype.is_floating_point or topk_ids_TK.dtype == torch.bool:
        raise ValueError(f"topk_ids_TK must be an integer tensor, got {topk_ids_TK.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if topk_ids_TK.numel() and (int(topk_ids_TK.min()) < 0 or int(topk_ids_TK.max()) >= num_experts):
        raise ValueError(f"topk_ids_TK holds ids outside [0, {num_experts})")


def usage_matrix(topk_ids_TK: torch.Tensor, num_experts: int, dtype=torch.float64) -> torch.Tensor:
    """Which experts each token uses, as 0/1: shape [T, E] (``dtype``).

    A token that lists an expert twice uses it once.
    """
    _check_ids(topk_ids_TK, num_experts)
    T = topk_ids_TK.shape[0]
    used_TE = torch.zeros(T, num_experts, dtype=dtype, device=topk_ids_TK.device)
    used_TE.scatter_(1, topk_ids_TK.long(), 1.0)
    return used_TE


def expert_load(topk_ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """How many (token, expert) pairs choose each expert: shape [E] (long)."""
    _check_ids(topk_ids_TK, num_experts)
    return torch.bincount(topk_ids_TK.reshape(-1).long(), minlength=num_experts)


def coactivation(topk_ids_TK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Co-activation counts of one layer: shape [E, E] (long), symmetric.

    ``counts_EE[i, j]`` (i != j) is the number of tokens whose top-k holds both
    i and j; ``counts_EE[i, i]`` is expert i's load (times chosen). Computed as
    one matmul of the [T, E] usage matrix with itself (exact in float64).
    """
    used_TE = usage_matrix(topk_ids_TK, num_experts)
    counts_EE = (used_TE.t() @ used_TE).round().long()
    counts_EE.fill_diagonal_(0)
    counts_EE += torch.diag(expert_load(topk_ids_TK, num_experts))
    return counts_EE
