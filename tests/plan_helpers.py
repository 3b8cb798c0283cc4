"""Simulated against measured traffic: a system's plan for every rank of a world that ran, on
the routing each rank logged, compared per peer pair with the collectives each rank logged
(importable by the tests; nothing here starts ranks)."""
import torch

from occult.ep import Placement, system_config
from occult.ep.comm import EPGroup
from occult.ep.plan import RowShape, plan_world, rank_events, traffic_of


_TYPED: dict = {}       # repr of a system dict -> its typed config (a merge costs milliseconds)


def typed(system):
    """``system_config(system)``, made once per system dict."""
    key = repr(system)
    if key not in _TYPED:
        _TYPED[key] = system_config(system)
    return _TYPED[key]


def simulated_traffic(system, case, routing: list, world_size: int, devices_per_node: int, groups=None) -> list:
    """Every rank's simulated collectives (:func:`occult.ep.plan.traffic_of`) of one
    :class:`occult.parity.LayerCase` on ``routing`` (each rank's logged (ids, weights))."""
    ep = EPGroup(0, world_size, None, "cpu", devices_per_node)        # a world that is not started
    placement = (groups if hasattr(groups, "pair_local") else Placement.from_groups(groups) if groups
                 else Placement.contiguous(case.num_experts, world_size))     # groups, or a (slot) placement
    # sized as the parity check sizes a system with fixed buffers (check_layer)
    dispatcher = typed(system).sized(max(case.tokens), force=True).build(ep, 0, case.num_experts, placement)
    world = plan_world(dispatcher, routing, RowShape(case.hidden, case.ffn, getattr(torch, case.dtype)))
    return [traffic_of(rank_events(world, rank, 0)) for rank in range(world_size)]


def plan_disagreements(name: str, system, case, per_rank: list, world_size: int, devices_per_node: int,
                       groups=None) -> list:
    """Where the plan of ``system`` differs from what the ranks of a world logged
    (``per_rank[r]``: rank r's :func:`occult.parity.check_layer` result): one line per rank
    and collective (layer, phase, pass, kind: calls, rows, bytes and metadata bytes per peer)."""
    simulated = simulated_traffic(system, case, [r["routing"] for r in per_rank], world_size, devices_per_node,
                                  groups)
    out = []
    for rank, (sim, res) in enumerate(zip(simulated, per_rank)):
        measured = traffic_of(res["comm"])
        for key in sorted(set(sim) | set(measured)):
            if sim.get(key) != measured.get(key):
                out.append(f"{name} P={world_size} G={devices_per_node} rank={rank} {case} {key}: "
                           f"simulated {sim.get(key)} != measured {measured.get(key)}")
    return out


def planned_systems(systems: dict) -> dict:
    """The systems of ``systems`` (name -> dict) that have a traffic plan."""
    return {name: s for name, s in systems.items() if not typed(s).plan_refusal()}


# the options that change a system's traffic, beside its defaults (lossy ones with their loss
# on): compressed payloads, capacity and drops, dedup, chunks, the shadowing rule's machine
TRAFFIC_OPTIONS = {
    "naive": [{"payload": "int8"}],
    "occult": [{"payload": "fp8", "combine_payload": "bf16"}, {"payload": "bf16"}],
    "megablocks": [{"payload": "bf16", "block_size": 4}],
    "occult_prune_score": [{"budget": 1, "payload": "int8"}],
    "hierarchical": [{"dedup": "none"}, {"dedup": "node"}],
    "pipelined": [{"degree": "2"}, {"degree": "4"}],
    "tutel": [{"capacity_factor": 1.0}, {"capacity_factor": -1.0, "a2a_ffn_overlap_degree": 2}],
    "tutel_harness": [{"capacity_factor": 1.0}],
    "deepspeed": [{"capacity_factor": 1.0}],
    "adaptive_topk": [{"base": "naive", "threshold": 0.3}],
    "shadow": [{"profile": "sim_cpu_loopback"}],
}
# systems whose layout is the contiguous placement only (their libraries' dense buffers)
CONTIGUOUS_ONLY = ("tutel", "deepspeed")


# the systems whose exchange reads the node layout (the others send the same rows in any)
LAYOUT_SYSTEMS = ("hierarchical",)


def traffic_systems(similarity_file: str, exact_defaults: bool = True) -> dict:
    """Every system of conf/system that has a traffic plan, at its default options (lossy
    ones with their loss on; similarity pruning with ``similarity_file``), and each of its
    :data:`TRAFFIC_OPTIONS`: name -> system dict. ``exact_defaults`` false leaves out the
    systems whose defaults are exact (those the parity grid runs already)."""
    from systems import system_configs, _variant

    out = {}
    for name, cfg in system_configs().items():
        config = typed(cfg)
        if not config.expert_parallel or config.plan_refusal():
            continue
        if name == "occult_prune_sim":
            cfg = {**cfg, "similarity_file": similarity_file}
        if exact_defaults or not config.is_exact():
            out[name] = cfg
        for options in TRAFFIC_OPTIONS.get(name, []):
            out[_variant(name, options)] = {**cfg, **options}
    return out


def traffic_cases(P: int) -> list:
    """The cases of a world of P ranks for the traffic comparison, as ``(case, placement groups
    or None)``, every one with E = 4 P experts (:func:`similarity_file`'s): top-2 uniform
    routing; top-4 router routing with a rank that has no tokens, on a shuffled placement
    (contiguous for the systems that take no other); top-1 where three tokens in four choose
    expert 0 (a popular expert to shadow, ExFlow's top-1 legs, ranks that receive nothing)."""
    from occult.parity import LayerCase

    E = 4 * P
    T = (5, 9, 4, 7, 3, 6, 2, 8) * (P // 8 + 1)
    g = torch.Generator(device="cpu").manual_seed(P)
    shuffled = torch.randperm(E, generator=g, device="cpu").view(P, E // P).tolist()
    popular = tuple(0 if t % 4 != 3 else (7 * t) % E for t in range(6 * P))
    return [(LayerCase(E, 2, T[:P], routing="uniform", seed=21), None),
            (LayerCase(E, 4, (0,) + T[1:P], routing="router", seed=22), shuffled),
            (LayerCase(E, 1, (6,) * P, routing="explicit", explicit_ids=popular, seed=23), None)]


def traffic_jobs(P: int, systems: dict, layouts=(None,), cases=None) -> tuple:
    """The grid's jobs for the traffic comparison and their labels (name, case, system,
    groups, devices_per_node or None for the world's own). A layout other than the world's
    own runs the :data:`LAYOUT_SYSTEMS` only."""
    jobs, labels = [], []
    for layout in layouts:
        for name, system in systems.items():
            base = name.split("(")[0]
            if layout is not None and base not in LAYOUT_SYSTEMS:
                continue
            for case, groups in (cases or traffic_cases(P)):
                groups = None if base in CONTIGUOUS_ONLY else groups
                jobs.append((system, case, groups) + (() if layout is None else (layout,)))
                labels.append((name, case, system, groups, layout))
    return jobs, labels


def similarity_file(folder, world_size: int) -> str:
    """A router-logits file (one layer, seeded) for similarity pruning with the E = 4 P experts of
    :func:`traffic_cases`; returns its path."""
    import numpy as np

    g = torch.Generator(device="cpu").manual_seed(5)
    path = f"{folder}/similarity_{world_size}.npz"
    np.savez(path, layer_0=torch.randn(256, 4 * world_size, generator=g, device="cpu").numpy())
    return path
