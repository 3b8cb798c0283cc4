"""The dispatcher interface every expert-parallel system implements.

A dispatcher moves tokens to the ranks that host their experts and brings
the experts' outputs back. The contract (shapes: T tokens on this rank, K
top-k, D hidden, R rows received, e local experts):

    routed_RD, counts_e, handle = dispatch(x_TD, topk_ids_TK, topk_weights_TK, ...)
    y_RD = experts(routed_RD, counts_e)          # shared by all systems
    out_TD = combine(y_RD, handle)

``routed_RD`` is grouped by local expert: the first ``counts_e[0]`` rows go to
local expert 0, and so on. ``combine`` returns ``sum_k w_tk * expert_{id_tk}(x_t)``
for every token of this rank: **gate weights are applied inside the dispatcher,
exactly once** (naive EP weights at home, Occult on the receiving device before
its pre-aggregation), and nowhere else. Everything ``combine`` needs travels in
the handle, a frozen dataclass; a dispatcher keeps no per-call state on ``self``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional

import torch
from torch import nn

from .accounting import Recorder
from .comm import EPGroup
from .placement import Placement
from .router import RoutingTransform


class Dispatcher(ABC):
    """Base class of a system's token dispatcher.

    Class attributes a system sets:
      ``name``: the system's config name; ``impl``: ``"harness"`` when this
      project implements the scheme, ``"library"`` when a third-party library
      runs it; ``requires_divisible_experts``: whether E must split evenly
      over P ranks; ``exact``: whether it returns exactly top-k MoE (False
      for schemes that drop tokens or change the routing); ``runs_whole_layer``:
      True for a system (e.g. a library's MoE module) whose dispatch, experts and
      combine do not split, which then implements :meth:`forward_moe` instead.
    """

    name: str = "base"
    impl: str = "harness"
    requires_divisible_experts: bool = True
    exact: bool = True
    runs_whole_layer: bool = False

    def __init__(self, ep: EPGroup, placement: Placement) -> None:
        if placement.num_devices != ep.world_size:
            raise ValueError(f"{self.name}: placement is for {placement.num_devices} devices, "
                             f"the group has {ep.world_size}")
        self.ep = ep
        self.placement = placement

    def routing_transform(self, layer: int) -> Optional[RoutingTransform]:
        """A routing transform this system applies after layer ``layer``'s router (e.g.
        collaboration pruning), or None. Called between routing and dispatch."""
        return None

    def stats(self, handle: Any) -> dict:
        """Counters of one dispatch (e.g. dropped pairs, padding rows): name -> int."""
        return {}

    @classmethod
    def layer_placement(cls, layer: int, num_experts: int, world_size: int, **options) -> Placement:
        """The placement of MoE layer ``layer`` (contiguous unless a system says otherwise,
        e.g. from a placement artifact named in its options)."""
        return Placement.contiguous(num_experts, world_size)

    @classmethod
    def is_exact(cls, **options) -> bool:
        """Whether the system with these options returns exactly top-k MoE."""
        return cls.exact

    @property
    def local_expert_ids(self) -> torch.Tensor:
        """Global ids of this rank's experts in slot order: shape [e]."""
        return self.placement.local_experts(self.ep.rank)

    @abstractmethod
    def dispatch(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                 *, layer: int = 0, recorder: Optional[Recorder] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Returns ``(routed_RD, counts_e, handle)``; rows grouped by local expert."""

    @abstractmethod
    def combine(self, y_RD: torch.Tensor, handle: Any) -> torch.Tensor:
        """Returns ``out_TD``, the gate-weighted sum of each token's expert outputs."""

    def forward_moe(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                    experts: nn.Module, *, layer: int = 0, recorder: Optional[Recorder] = None
                    ) -> torch.Tensor:
        """The whole routed layer in one call (only when ``runs_whole_layer``): moves the
        tokens, runs this rank's ``experts`` and returns ``out_TD``, the gate-weighted sum,
        logging its collectives and counters on ``recorder`` itself."""
        raise TypeError(f"system '{self.name}' splits into dispatch / experts / combine "
                        "(runs_whole_layer is False); forward_moe is not available")

    @classmethod
    def check_config(cls, *, num_experts: int, top_k: int, world_size: int, **options) -> None:
        """Raise ``ValueError`` naming the field if this system cannot run the shape (or, in
        a subclass, with these system ``options``, e.g. an infeasible device budget)."""
        if cls.requires_divisible_experts and num_experts % world_size:
            divisors = [p for p in range(1, num_experts + 1) if num_experts % p == 0]
            raise ValueError(
                f"model.num_experts={num_experts} is not divisible by the world size {world_size} "
                f"(cluster); system '{cls.name}' needs equal expert groups. "
                f"Allowed world sizes: {divisors}")
