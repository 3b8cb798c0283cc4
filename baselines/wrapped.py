"""Systems that are another system plus a routing transform in front of it.

A wrapper's config names its ``base`` (a name of :data:`BASES` or the class path of any
expert-parallel system) and the base's options (``base_options``); the wrapper builds
the base's dispatcher, gives the MoE layer its transform (composed after the base's
own, if the base has one) and passes every other question a run asks of a system to
the base: its placement, who runs it, its precision, the tasks it takes.
"""
from __future__ import annotations

import dataclasses
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any, Dict

from occult.ep import Dispatcher, SystemConfig, import_object, system_config
from occult.errors import ConfigError

BASES = {"naive": "baselines.naive.NaiveDispatcher", "occult": "occult.collab.dispatcher.OccultDispatcher",
         "megablocks": "baselines.megablocks.MegaBlocksDispatcher"}


class WrappedDispatcher(Dispatcher):
    """``base``'s dispatcher with a routing transform (:meth:`make_transform`) before it."""

    # no capability record here: each wrapper class declares its own (the base's answers
    # what its collectives do: Config.capabilities)

    @dataclass
    class Config(SystemConfig):
        base: str = "occult"        # the system that runs the layer: naive | occult | megablocks | a class path
        base_options: Dict[str, Any] = field(default_factory=dict)   # the base system's options

        def base_config(self) -> SystemConfig:
            target = BASES.get(self.base, self.base)
            return system_config({"name": self.base.rsplit(".", 1)[-1], "_target_": target, **self.base_options})

        def checked_base(self) -> SystemConfig:
            """The base's config, or a one-line ``ValueError`` naming ``system.base``."""
            if self.base not in BASES and "." not in self.base:
                raise ValueError(f"system.base={self.base!r}: allowed values are {sorted(BASES)} or the class "
                                 "path of an expert-parallel system")
            try:
                return self.base_config()
            except ConfigError as exc:
                raise ValueError(f"system.base={self.base!r}: {exc}") from exc

        def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
            self.checked_base().check(num_experts=num_experts, top_k=top_k, world_size=world_size)

        def base_lossless(self) -> dict:
            """The options that switch the base's own loss off (``{}`` when it has none)."""
            base_off = self.base_config().lossless_options()
            return {"base_options": {**self.base_options, **base_off}} if base_off else {}

        # the wrapper is its base plus a routing transform: what a run asks of a system
        # beyond the transform is the base's answer
        def capabilities(self):
            """The wrapper's record for what the transform decides (exactness, dropped pairs),
            the base's for what the base's collectives do."""
            own, base = super().capabilities(), self.base_config().capabilities()
            return dataclasses.replace(own, impl=base.impl, precision=base.precision, co_execution=base.co_execution,
                                       yields=base.yields, traffic_plan=base.traffic_plan, migration=base.migration)

        def impl_for(self, world_size: int) -> str:
            return self.base_config().impl_for(world_size)

        @property
        def precision(self) -> str:
            return self.base_config().precision

        def check_task(self, task: str) -> None:
            self.base_config().check_task(task)

        def layer_placement(self, layer: int, num_experts: int, world_size: int):
            return self.base_config().layer_placement(layer, num_experts, world_size)

        def plan_refusal(self) -> str:
            return self.base_config().plan_refusal()

    def __init__(self, ep, placement, config):
        super().__init__(ep, placement, config)
        base = config.base_config()
        self.inner = import_object(base._target_)(ep, placement, base)

    @abstractmethod
    def make_transform(self, layer: int, inner):
        """The layer's routing transform, applied after ``inner`` (the base's, or None)."""

    def routing_transform(self, layer: int):
        return self.make_transform(layer, self.inner.routing_transform(layer))

    # the traffic is the base system's on the transformed routing (a plan gets the routing
    # after the transform): the base's plan
    def plan_facts(self, topk_ids_TK, topk_weights_TK):
        return self.inner.plan_facts(topk_ids_TK, topk_weights_TK)

    def plan(self, topk_ids_TK, topk_weights_TK, **kwargs):
        return self.inner.plan(topk_ids_TK, topk_weights_TK, **kwargs)

    def forward_moe(self, x_TD, topk_ids_TK, topk_weights_TK, experts, *, layer=0, recorder=None):
        return self.inner.forward_moe(x_TD, topk_ids_TK, topk_weights_TK, experts, layer=layer, recorder=recorder)


class Chained:
    """Two routing transforms, one after the other; each that ranks as the router does
    (``takes_choice``) is given the router's selection scores."""

    takes_choice = True

    def __init__(self, first, second):
        self.first, self.second = first, second

    def __call__(self, probs_TE, topk_ids_TK, topk_weights_TK, placement, choice_TE=None):
        ids_TK, w_TK = topk_ids_TK, topk_weights_TK
        for transform in (self.first, self.second):
            extra = {"choice_TE": choice_TE} if getattr(transform, "takes_choice", False) else {}
            ids_TK, w_TK = transform(probs_TE, ids_TK, w_TK, placement, **extra)
        return ids_TK, w_TK
