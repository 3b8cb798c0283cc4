"""system=adaptive_topk: AdapMoE's sensitivity-based gating, as a routing transform on
another system's dispatcher.

Each token keeps only as many of its top-k experts as its router scores need: the
token's experts sorted by gate weight, it keeps the shortest prefix whose weights hold
at least ``1 - threshold`` of its top-k weight (at least one expert); the others become
dropped pairs (id ``NO_EXPERT``, weight 0), which the wrapped system does not send. So
a token confident in its first experts uses fewer (token, expert) pairs and often
fewer devices. The kept experts keep their gate weights (no renormalisation), so a
dropped pair removes exactly its own weighted contribution. ``threshold = 0`` keeps
every expert: the wrapped system, exact.

My reading of AdapMoE (its "sensitivity" ranks how much a layer's output moves when
an expert is dropped; the gate weight is the first-order proxy used here): the
number of experts is decided per token from its own scores, with one threshold per
model (not learned, not per layer).

``base``: the system whose dispatcher runs the layer: a name of :data:`BASES` or the
class path of any system whose config takes dropped pairs
(``SystemConfig.accepts_dropped_pairs``), with ``base_options``. Shapes: T tokens, K
top-k, E experts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from occult.ep.router import NO_EXPERT

from .wrapped import BASES, WrappedDispatcher
from occult.ep.capabilities import Capabilities


def adaptive_keep(topk_weights_TK: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which of each token's top-k pairs it keeps: bool [T, K]; the heaviest first, until
    they hold ``1 - threshold`` of the token's top-k weight (always at least one)."""
    w_TK = topk_weights_TK.detach().float()
    order_TK = torch.argsort(w_TK, dim=1, descending=True, stable=True)
    sorted_TK = w_TK.gather(1, order_TK)
    total_T1 = sorted_TK.sum(1, keepdim=True).clamp_min(1e-30)
    before_TK = (torch.cumsum(sorted_TK, 1) - sorted_TK) / total_T1      # share held before each expert
    keep_sorted_TK = before_TK < 1.0 - threshold - 1e-12
    keep_sorted_TK[:, 0] = True
    return torch.zeros_like(keep_sorted_TK).scatter(1, order_TK, keep_sorted_TK)


class AdaptiveTopK:
    """The routing transform: drop each token's pairs beyond :func:`adaptive_keep`."""

    def __init__(self, threshold: float, inner=None):
        self.threshold, self.inner = threshold, inner

    @property
    def takes_choice(self) -> bool:
        """Whether the inner transform ranks experts as the router does (then it gets ``choice_TE``)."""
        return getattr(self.inner, "takes_choice", False)

    def __call__(self, probs_TE, topk_ids_TK, topk_weights_TK, placement, **choice):
        if self.inner is not None:
            topk_ids_TK, topk_weights_TK = self.inner(probs_TE, topk_ids_TK, topk_weights_TK, placement, **choice)
        keep_TK = adaptive_keep(topk_weights_TK, self.threshold)
        ids_TK = torch.where(keep_TK, topk_ids_TK, torch.full_like(topk_ids_TK, NO_EXPERT))
        return ids_TK, topk_weights_TK * keep_TK.to(topk_weights_TK.dtype)


class AdaptiveTopKDispatcher(WrappedDispatcher):
    """``base``'s dispatcher with AdapMoE's adaptive top-k in front of it."""

    capabilities = Capabilities(
        impl="harness", precision="float64", expert_parallel=True, exact_forward=False, exact_backward=False,
        static_dispatch="it has no fixed-buffer dispatch (only naive EP's and Occult's exchanges have one)",
        co_execution=True,
        yields=True,
        traffic_plan=True,
        migration=True,
        replica_rules=(), payloads=("fp32",), dropped_pairs=False,
        shortcut_overlap=False)

    @dataclass
    class Config(WrappedDispatcher.Config):
        threshold: float = 0.1      # share of a token's top-k weight it may drop (0: keep all, exact)

        def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
            base = self.checked_base()
            if not base.accepts_dropped_pairs:
                allowed = f"allowed values are {sorted(BASES)} or the class path of a system that takes dropped pairs"
                raise ValueError(f"system.base={self.base!r} does not take dropped pairs "
                                 f"(its config's accepts_dropped_pairs); {allowed}")
            if not 0.0 <= self.threshold < 1.0:
                raise ValueError(f"system.threshold={self.threshold!r}: allowed values are 0 <= threshold < 1 "
                                 "(0 keeps every expert)")
            base.check(num_experts=num_experts, top_k=top_k, world_size=world_size)

        def is_exact(self) -> bool:
            return self.threshold == 0 and self.base_config().is_exact()

        def lossless_options(self) -> dict:
            return {"threshold": 0.0, **self.base_lossless()}

    def make_transform(self, layer: int, inner) -> Optional[AdaptiveTopK]:
        return AdaptiveTopK(self.config.threshold, inner)

    def forward_moe(self, x_TD, topk_ids_TK, topk_weights_TK, experts, *, layer=0, recorder=None):
        if recorder is not None:
            recorder.log_counter(layer, "dropped_pairs", int((topk_ids_TK < 0).sum()))
        return super().forward_moe(x_TD, topk_ids_TK, topk_weights_TK, experts, layer=layer, recorder=recorder)
