"""The neutral core every expert-parallel system plugs into. It knows no system by name."""
from .accounting import Recorder, ct_all, ct_bounds, ct_remote, devices_per_token, intra_ratio
from .comm import EPGroup, Exchange, all_to_all_rows, exchange_counts
from .dispatcher import Dispatcher, SplitDispatcher
from .experts import GroupedExperts, grouped_swiglu, init_expert_weights, swiglu
from .layer import MoELayer, ReferenceMoE, reference_moe
from .placement import Placement
from .router import GateRule, RoutingTransform, TopKRouter, gate_weights
from .system import SystemConfig, import_object, system_config

__all__ = [
    "Recorder", "ct_all", "ct_bounds", "ct_remote", "devices_per_token", "intra_ratio",
    "EPGroup", "Exchange", "all_to_all_rows", "exchange_counts", "Dispatcher", "SplitDispatcher",
    "GroupedExperts", "grouped_swiglu", "init_expert_weights", "swiglu",
    "MoELayer", "ReferenceMoE", "reference_moe", "Placement", "RoutingTransform",
    "GateRule", "TopKRouter", "gate_weights", "SystemConfig", "import_object", "system_config",
]
