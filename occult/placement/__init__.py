"""Occult's expert placement rescheduling: co-activation profiling and optimisers that
partition each layer's experts into P equal device groups with low C_T."""
from .coactivation import coactivation, expert_load, usage_matrix
from .artifacts import apply_placement_to_weights, load_placements, placed_expert_ids, save_placements
from .optimisers import (OPTIMISERS, check_load_cap, check_partition, contiguous, device_load, greedy,
                         greedy_from_counts, load_max_over_mean, optimise, placement_summary, random,
                         rebalance, swap_search)

__all__ = [
    "coactivation", "expert_load", "usage_matrix",
    "OPTIMISERS", "apply_placement_to_weights", "check_load_cap", "check_partition", "contiguous",
    "device_load", "greedy", "greedy_from_counts", "load_max_over_mean", "load_placements",
    "optimise", "placed_expert_ids", "placement_summary", "random", "rebalance", "save_placements",
    "swap_search",
]
