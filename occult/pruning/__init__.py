"""Occult's collaboration pruning: routing transforms that cap the devices per token."""
from .transforms import (DEVICE_SCORES, PRUNING_KINDS, WEIGHT_RULES, GroupLimit, ScorePruning, SimilarityPruning,
                         check_budget, device_scores, expert_similarity, make_pruning, min_budget)

__all__ = [
    "DEVICE_SCORES", "PRUNING_KINDS", "WEIGHT_RULES", "GroupLimit", "ScorePruning", "SimilarityPruning",
    "check_budget", "device_scores", "expert_similarity", "make_pruning", "min_budget",
]
