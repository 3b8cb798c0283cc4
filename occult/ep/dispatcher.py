"""The one protocol the MoE layer calls, and the split dispatcher most systems are.

The layer (:mod:`occult.ep.layer`) routes, applies the system's routing transform
(if any), then calls ``system.forward_moe``: move the tokens to the ranks that host
their experts, run this rank's experts, bring the outputs back, and return each
token's gate-weighted sum. Shapes: T tokens on this rank, K top-k, D hidden, R rows
received, e local experts.

* A **split dispatcher** (:class:`SplitDispatcher`, most systems) implements it as

      routed_RD, counts_e, handle = dispatch(x_TD, topk_ids_TK, topk_weights_TK, ...)
      y_RD = run_experts(experts, routed_RD, counts_e, handle)   # the shared grouped experts
      out_TD = combine(y_RD, handle)

  ``routed_RD`` is grouped by local expert (the first ``counts_e[0]`` rows go to local
  expert 0, and so on). Everything ``combine`` needs travels in the handle, a frozen
  dataclass; a dispatcher keeps no per-call state on ``self``.
* A **library that owns the whole layer** (e.g. DeepSpeed's ``MOELayer``) subclasses
  :class:`Dispatcher` and implements :meth:`Dispatcher.forward_moe` directly, logging its
  collectives and counters on the recorder itself.

Either way ``out_TD`` is ``sum_k w_tk * expert_{id_tk}(x_t)`` for every token of this
rank: **gate weights are applied inside the system, exactly once**. A system's options
are its typed config (:class:`occult.ep.system.SystemConfig`), held as ``self.config``.

A system whose traffic depends only on its routing, placement and node layout also has a
**plan** (:meth:`Dispatcher.plan`, :mod:`occult.ep.plan`): the rows of each of its
collectives, computed by the functions its dispatch sizes them with, for any rank of any
world; its capability record's ``traffic_plan`` says why a system has none.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Optional

import torch
from torch import nn

from .accounting import Recorder, backward_span, span
from .capabilities import check_declared
from .comm import EPGroup
from .placement import Placement
from .plan import Planned, RowShape
from .router import RoutingTransform


class NoTrafficPlan(ValueError):
    """A system whose traffic cannot be planned without running it (its record says why)."""


class Dispatcher(ABC):
    """A system's expert-parallel MoE layer on one rank.

    Every system class declares ``capabilities``, its own
    :class:`occult.ep.capabilities.Capabilities` record (``impl``, ``precision``,
    exactness, static dispatch, micro-batches, traffic plan, ...: every field, none
    inherited); a class without one is refused when its config is read.
    """

    def __init__(self, ep: EPGroup, placement: Placement, config) -> None:
        if placement.num_devices != ep.world_size:
            raise ValueError(f"system={config.name}: placement is for {placement.num_devices} devices, "
                             f"the group has {ep.world_size}")
        self.ep = ep
        self.placement = placement
        self.config = config

    def routing_transform(self, layer: int) -> Optional[RoutingTransform]:
        """A routing transform this system applies after layer ``layer``'s router (e.g.
        collaboration pruning), or None. Called between routing and the MoE exchange."""
        return None

    @property
    def local_expert_ids(self) -> torch.Tensor:
        """Global ids of this rank's experts in slot order: shape [e]."""
        return self.placement.local_experts(self.ep.rank)

    @abstractmethod
    def forward_moe(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                    experts: nn.Module, *, layer: int = 0, recorder: Optional[Recorder] = None
                    ) -> torch.Tensor:
        """The routed layer: moves the tokens, runs this rank's ``experts`` and returns
        ``out_TD``, the gate-weighted sum of each token's expert outputs: [T, D] -> [T, D]."""

    @classmethod
    def has_plan(cls) -> bool:
        """Whether the system states its traffic as a plan (its record's ``traffic_plan``)."""
        return check_declared(cls).has("traffic_plan")

    def plan_facts(self, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor) -> Optional[torch.Tensor]:
        """What this rank tells every peer before anyone can plan (a vector [X], the same
        length on every rank; e.g. its token count and largest expert load), or None. At run
        time the dispatch exchanges it; :func:`occult.ep.plan.plan_world` stacks every rank's
        into the ``facts_PX`` that :meth:`plan` gets."""
        return None

    def plan(self, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, *, rank: int, shape: RowShape,
             facts_PX: Optional[torch.Tensor] = None, training: bool = True) -> list[Planned]:
        """The collectives of one forward of this layer on rank ``rank`` of this dispatcher's
        world (``self.ep``: its size and node layout; ``rank`` need not be this process's),
        with the rows that rank's tokens (``topk_ids_TK``, ``topk_weights_TK``, after the
        routing transform) put on each pair of ranks (:class:`occult.ep.plan.Planned`).
        ``shape``: the rows' hidden width, FFN width and dtype; ``facts_PX``: every rank's
        :meth:`plan_facts`; ``training``: the layer's backward runs."""
        why = self.config.capabilities().why_not("traffic_plan") or "it does not implement Dispatcher.plan"
        raise NoTrafficPlan(f"system={self.config.name} has no traffic plan: {why}")


class SplitDispatcher(Dispatcher):
    """A system whose layer splits into dispatch -> experts -> combine (each timed as a span)."""

    @abstractmethod
    def dispatch(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                 *, layer: int = 0, recorder: Optional[Recorder] = None
                 ) -> tuple[Any, torch.Tensor, Any]:
        """Returns ``(routed_RD, counts_e, handle)``; rows grouped by local expert."""

    @abstractmethod
    def combine(self, y_RD: torch.Tensor, handle: Any) -> torch.Tensor:
        """Returns ``out_TD``, the gate-weighted sum of each token's expert outputs."""

    def stats(self, handle: Any) -> dict:
        """Counters of one dispatch (e.g. dropped pairs, padding rows): name -> number."""
        return {}

    def run_experts(self, experts: nn.Module, routed_RD: Any, counts_e: torch.Tensor, handle: Any) -> torch.Tensor:
        """This rank's experts on the routed rows: [R, D] -> [R, D] (the shared grouped
        experts; a system may read its rows in its own way, e.g. a fused kernel, or apply
        its gate weights there, from the call's ``handle``)."""
        return experts(routed_RD, counts_e)

    def forward_moe(self, x_TD, topk_ids_TK, topk_weights_TK, experts, *, layer=0, recorder=None):
        rec = recorder
        with span(rec, layer, "dispatch"):
            routed_RD, counts_e, handle = self.dispatch(x_TD, topk_ids_TK, topk_weights_TK, layer=layer,
                                                        recorder=rec)
        if rec is not None:
            for name, value in self.stats(handle).items():
                rec.log_counter(layer, name, value)
        with span(rec, layer, "experts"):
            y_RD = self.run_experts(experts, routed_RD, counts_e, handle)
        backward_span(rec, layer, "experts", routed_RD, y_RD)
        with span(rec, layer, "combine"):
            return self.combine(y_RD, handle)
