"""system=group_limit: DeepSeek-V3's group-limited routing with the devices as the groups,
as a routing transform in front of any expert-parallel system (``base``).

Per token: the ``topk_group`` (M) devices whose two best experts' selection scores sum
highest, then the top-k of the selection scores among the experts on them
(:class:`occult.pruning.GroupLimit`), so every token's experts lie on at most M devices
(C_T <= M), as DeepSeek-V3 bounds a token's nodes (its groups are contiguous expert
blocks; here they are the placement's devices). The selection scores are the router's
(DeepSeek-V3's correction bias included; the softmax probabilities of the other
families). ``topk_group: null`` (or M = P) leaves the router's own routing: exact, the
lossless option the parity gate runs. Beside Occult's pruning (``occult_prune_score`` / ``occult_prune_sim``), which
bounds C_T the same way with other device scores.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from occult.columns import column
from occult.pruning import GroupLimit
from occult.pruning.transforms import WEIGHT_RULES, min_budget

from .wrapped import Chained, WrappedDispatcher
from occult.ep.capabilities import Capabilities


class GroupLimitDispatcher(WrappedDispatcher):
    """``base``'s dispatcher behind DeepSeek-V3's group limit over devices."""

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
        # M, the devices a token may use; null (or the world size): no limit, the router's
        # own routing (exact: the lossless option); a column of every row (-1: no such field)
        topk_group: Optional[int] = column(2, absent=-1)
        # gate weights of what it chose: renormalize (to the original sum) | own | replaced
        weight_rule: str = "renormalize"

        def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
            super().check(num_experts=num_experts, top_k=top_k, world_size=world_size)
            M, local = self.topk_group, num_experts // world_size
            if M is None:
                return
            if isinstance(M, bool) or not isinstance(M, int) or not 1 <= M <= world_size:
                raise ValueError(f"system.topk_group={M!r}: allowed values are 1..{world_size} (the world size; "
                                 f"{world_size} is the router's own routing)")
            if M * local < top_k:
                raise ValueError(f"system.topk_group={M}: {M} device(s) x {local} experts cannot hold "
                                 f"top_k={top_k}; allowed values are {min_budget(top_k, local)}..{world_size}")
            if self.weight_rule not in WEIGHT_RULES:
                raise ValueError(f"system.weight_rule={self.weight_rule!r}: allowed values are {list(WEIGHT_RULES)}")

        def is_exact(self) -> bool:
            return self.topk_group is None and self.base_config().is_exact()

        def lossless_options(self) -> dict:
            return {"topk_group": None, **self.base_lossless()}

    def make_transform(self, layer: int, inner):
        M = self.config.topk_group
        if M is None or M >= self.ep.world_size:
            return inner
        limit = GroupLimit(M, self.config.weight_rule)
        return limit if inner is None else Chained(inner, limit)

