"""Connected components of a batch's expert co-activation graph (Occult Fig. 3).

Nodes are experts; two experts are joined when one token chose both. The
size of the largest connected component (experts in it) as the batch grows
shows how quickly routing ties every expert to every other: once the graph
is connected, no per-batch re-placement of experts can keep a batch's tokens
within one device group.

A union-find (disjoint sets, with union by size and path halving) processes
tokens one by one, so one pass over a token order gives the largest
component after every prefix of that order.

Shapes: T tokens, K top-k, E experts.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np
import pandas as pd
import torch

from occult.synthetic import expert_popularity, sample_topk


class DisjointSets:
    """Union-find over ``n`` items, tracking the largest set's size."""

    def __init__(self, n: int):
        self.parent = list(range(n))
        self.size = [1] * n
        self.largest = 1 if n else 0

    def find(self, i: int) -> int:
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return
        if self.size[ra] < self.size[rb]:
            ra, rb = rb, ra
        self.parent[rb] = ra
        self.size[ra] += self.size[rb]
        self.largest = max(self.largest, self.size[ra])


def _token_ids(topk_ids_TK) -> np.ndarray:
    ids = topk_ids_TK.numpy() if isinstance(topk_ids_TK, torch.Tensor) else np.asarray(topk_ids_TK)
    if ids.ndim != 2:
        raise ValueError(f"topk_ids_TK must have shape [T, K], got {ids.shape}")
    return ids.astype(np.int64)


def largest_component(topk_ids_TK, num_experts: int) -> int:
    """Experts in the largest connected component of the co-activation graph of these
    tokens (an expert no token chose is a component of one)."""
    ids = _token_ids(topk_ids_TK)
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise ValueError(f"topk_ids_TK holds ids outside [0, {num_experts})")
    sets = DisjointSets(num_experts)
    for token in ids:
        for other in token[1:]:
            sets.union(int(token[0]), int(other))
    return sets.largest


def component_growth(topk_ids_TK, num_experts: int, checkpoints: Iterable[int]) -> dict[int, int]:
    """Largest component after the first n tokens, for each n in ``checkpoints`` (n <= T)."""
    ids = _token_ids(topk_ids_TK)
    want = sorted({int(n) for n in checkpoints if 0 < n <= len(ids)})
    sets, out, j = DisjointSets(num_experts), {}, 0
    for t, token in enumerate(ids, start=1):
        for other in token[1:]:
            sets.union(int(token[0]), int(other))
        while j < len(want) and want[j] == t:
            out[t] = sets.largest
            j += 1
    return out


def token_counts(max_tokens: int) -> list[int]:
    """1, 2, 4, ... up to ``max_tokens`` (included)."""
    out, n = [], 1
    while n < max_tokens:
        out.append(n)
        n *= 2
    return out + [max_tokens] if max_tokens >= 1 else out


def lcc_curve(topk_ids_TK, num_experts: int, checkpoints, draws: int = 16, seed: int = 0) -> pd.DataFrame:
    """Largest component vs batch size over ``draws`` random token orders of a trace
    (a batch of n tokens = the first n of an order). Columns: tokens, draw, lcc."""
    ids = _token_ids(topk_ids_TK)
    rng = np.random.default_rng(seed)
    rows = []
    for d in range(draws):
        order = rng.permutation(len(ids))
        for n, size in component_growth(ids[order], num_experts, checkpoints).items():
            rows.append({"tokens": n, "draw": d, "lcc": size})
    return pd.DataFrame(rows)


def uniform_lcc_curve(num_experts: int, top_k: int, checkpoints, draws: int = 16, seed: int = 0) -> pd.DataFrame:
    """The same curve for uniform routing (K distinct experts per token, uniformly at
    random), simulated: ``draws`` independent batches of max(checkpoints) tokens."""
    g = torch.Generator().manual_seed(seed)
    popularity = expert_popularity("uniform", num_experts)
    n_max = max(checkpoints)
    rows = []
    for d in range(draws):
        ids = sample_topk(n_max, top_k, popularity, g)
        for n, size in component_growth(ids, num_experts, checkpoints).items():
            rows.append({"tokens": n, "draw": d, "lcc": size})
    return pd.DataFrame(rows)


def topk_from_logits(logits_TE: np.ndarray, top_k: int) -> np.ndarray:
    """The top-k experts of each token by router logit (= by softmax probability): [T, K]."""
    logits_TE = np.asarray(logits_TE)
    if not 1 <= top_k <= logits_TE.shape[1]:
        raise ValueError(f"top_k={top_k}: allowed values are 1..{logits_TE.shape[1]}")
    part = np.argpartition(-logits_TE, top_k - 1, axis=1)[:, :top_k]
    order = np.argsort(-np.take_along_axis(logits_TE, part, axis=1), axis=1)
    return np.take_along_axis(part, order, axis=1)
