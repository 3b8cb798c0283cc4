"""system=luffy: Luffy's token condensation (harness implementation, from the paper; it has
no public code).

Luffy (arXiv 2411.15419) sends one row for a group of similar tokens bound for one expert
and shares that row's expert output back to each of them. My reading, as implemented:

  sender    the (token, expert) pairs, sorted by destination device and local expert
            (naive EP's order); within each (device, local expert) group, leader
            clustering in that order: the first pair is a leader, and each later pair
            joins the first leader whose token is identical to it or has cosine
            similarity >= ``threshold`` with it, or else becomes a leader itself; each
            leader's token is one row (the representative)
  exchange  counts, then one all-to-all of the representatives (C rows instead of R pairs)
  receiver  the experts run on the representatives, grouped by local expert
  exchange  the representatives' outputs back
  sender    each pair takes its leader's output (no correction), then the gate-weighted
            sum at home, as naive EP's

``threshold = 1`` condenses only identical tokens (their expert outputs are identical):
an exact forward, the system's ``lossless_options`` (in the parity suite). Lower
thresholds condense more. The gradient of a condensed pair's expert output reaches its
leader's token only: at threshold 1 the experts' and the router's gradients are exact (a
cluster's tokens are one point of the expert's function), and the sum of the input
gradients over each cluster, but not each token's own (the expert's vector-Jacobian
product of each member's output gradient would take every pair's row back across, which
is the exchange condensation saves); so training at threshold 1 is refused
(:data:`TRAINING_TASKS`), where it would pass for exact. Counters per call: ``luffy_rows``
(rows sent), ``luffy_pairs``, ``merged_pairs``.
The exchange itself is LSH-MoE's (:class:`baselines.lsh.LSHDispatcher`: buckets of pairs,
one row each); only the buckets and their rows differ.
Shapes: R pairs, D hidden, G groups (P devices x e local experts), C representatives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from occult.ep import SystemConfig
from occult.ep.permute import gather_rows

from .lsh import LSHDispatcher
from occult.ep.capabilities import Capabilities

# the tasks that train through the system's backward
TRAINING_TASKS = ("train", "finetune")


def leader_clusters(x_RD: torch.Tensor, group_R: torch.Tensor, threshold: float) -> torch.Tensor:
    """Each pair's leader (an index into R, in the pair's group): sequential leader clustering
    in index order, vectorised over groups (one round per leader of the largest group: the
    first unassigned pair of each group leads, and every unassigned pair of its group that
    is identical to it or, for threshold < 1, has cosine similarity >= threshold with it
    joins; each round looks at the unassigned pairs only; threshold 1: identical tokens,
    found in one pass). A leader is the smallest index of its cluster. [R] (long)."""
    R = x_RD.shape[0]
    leader_R = torch.full((R,), -1, dtype=torch.long, device=x_RD.device)
    if R == 0:
        return leader_R
    x_RD = x_RD.detach()
    index_R = torch.arange(R, device=x_RD.device)
    if threshold >= 1.0:       # identical tokens only: one pass over the distinct (group, token) rows
        _, row_R = torch.unique(torch.cat([group_R.unsqueeze(1).to(x_RD.dtype), x_RD], 1), dim=0,
                                return_inverse=True)
        first_U = torch.full((int(row_R.max()) + 1,), R, dtype=torch.long, device=x_RD.device)
        return first_U.scatter_reduce_(0, row_R, index_R, reduce="amin")[row_R]
    unit_RD = x_RD / x_RD.norm(dim=1, keepdim=True).clamp_min(torch.finfo(x_RD.dtype).tiny)
    G = int(group_R.max()) + 1
    open_O = index_R                                       # the unassigned pairs, in index order
    while open_O.numel():
        group_O = group_R[open_O]
        first_G = torch.full((G,), R, dtype=torch.long, device=x_RD.device)
        first_G.scatter_reduce_(0, group_O, open_O, reduce="amin")
        lead_O = first_G[group_O]                          # every open pair's group has a first open pair
        join_O = (x_RD[open_O] == x_RD[lead_O]).all(1) | ((unit_RD[open_O] * unit_RD[lead_O]).sum(1) >= threshold)
        leader_R[open_O[join_O]] = lead_O[join_O]
        open_O = open_O[~join_O]
    return leader_R


class LuffyDispatcher(LSHDispatcher):
    """Luffy's token condensation; ``threshold``: the cosine similarity at which a pair
    shares its leader's row (1: identical tokens only, exact)."""

    capabilities = Capabilities(
        impl="harness", precision="float64", expert_parallel=True, exact_forward=False, exact_backward=False,
        static_dispatch="it has no fixed-buffer dispatch (only naive EP's and Occult's exchanges have one)",
        co_execution=True,
        yields=True,
        traffic_plan=("its rows are cluster representatives, and how many a (rank, expert) sends depends on the "
                     "similarity of the tokens' activations, not on the routing"),
        migration=True,
        replica_rules=(), payloads=("fp32",), dropped_pairs=False,
        shortcut_overlap=False)

    counter = "luffy"

    @dataclass
    class Config(SystemConfig):
        threshold: float = 0.9     # cosine similarity in [-1, 1] at which a pair shares its leader's row

        def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
            super().check(num_experts=num_experts, top_k=top_k, world_size=world_size)
            if not -1.0 <= self.threshold <= 1.0:
                raise ValueError(f"system.threshold={self.threshold!r}: allowed values are a cosine similarity "
                                 "in [-1, 1] (1: identical tokens only, exact)")

        def check_task(self, task: str) -> None:
            if self.threshold >= 1.0 and task in TRAINING_TASKS:
                raise ValueError(f"system.threshold={self.threshold!r}: task={task} would train through Luffy's "
                                 "condensation of identical tokens, exact in the forward only (a shared row's "
                                 "input gradient reaches the first of its tokens); allowed for training: a "
                                 "threshold < 1 (lossy by design), or threshold 1 with prefill, decode, layer, bench")

        def is_exact(self) -> bool:
            return self.threshold >= 1.0

        def lossless_options(self) -> dict:
            return {"threshold": 1.0}

    def bucket_keys(self, x_RD: torch.Tensor, group_R: torch.Tensor, layer: int) -> tuple[torch.Tensor, int]:
        """``group * R + leader``: a pair's bucket is its leader's cluster. ``([R] long, R)``."""
        base = max(x_RD.shape[0], 1)
        return group_R * base + leader_clusters(x_RD, group_R, self.config.threshold), base

    def bucket_rows(self, x_RD: torch.Tensor, bucket_R: torch.Tensor, keys_C: torch.Tensor, base: int
                    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The leaders' tokens, and no correction. ``([C, D], None)``."""
        return gather_rows(x_RD, keys_C % base), None
