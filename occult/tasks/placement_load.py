"""task=placement_load: C_T and load of every placement and replica rule, on one front, for a
world of ``cluster.world_size`` devices computed in one process.

For each MoE layer of the task's routing (the model's routers on held-out text, or
``task.max_over_mean`` > 0: the ``imbalance`` workload at that received max / mean) the
placements are built from a profiling set (the routers on the training split, or the
workload drawn at seed + 1) and judged on the evaluation tokens:

* ``contiguous``, ``random``, ``greedy``, ``swap_search`` (Occult's optimisers,
  :func:`occult.placement.optimise`, at ``task.load_cap``; one copy per expert);
* ``eplb_r<R>`` for R in 0, E/8, E/4 (DeepSeek's EPLB, the real library, rounded up to a
  count the world divides), and ``affinity_r<R>`` for R in E/8, E/4 (EPLB's counts packed
  with co-activation, :mod:`occult.placement.affinity`, ``task.affinity_weight``), with
  ``affinity_r<E/8>_w<w>`` at the other weights of :data:`WEIGHT_SWEEP` (occult only);

each with ``system`` naive and occult and, on a placement with copies, every replica rule
(:mod:`occult.ep.replica_rules`; on the affinity-aware packing with occult also the
collaborative rule at slack 0 and without a cap, ``collaborative@0`` / ``collaborative@inf``). An arm's traffic is its system's plan for every rank (the
functions its dispatch sizes its collectives with, checked equal to what the ranks send in
the parity suite). Rows (``phase`` = the arm, ``<placement>:<system>:<rule>``): per layer,
``ct_all``, ``recv_max_over_mean`` (received dispatch rows, max / mean over ranks),
``bytes`` (every planned collective, forward and backward, all ranks), ``expert_slots``
(experts a device holds, copies included), ``expert_memory_bytes`` (x 3 D F weights);
per rank ``recv_rows`` and ``expert_rows`` (the (token, expert) pairs its experts run); and
per collective (``phase`` = ``<arm>/<collective>``, ``pass``) every rank's rows sent to and
received from its node and the other nodes, excluding its own (what the report prices on
a projection profile), with the collective's ``row_bytes`` and ``meta_row_bytes``.

Shapes: T tokens per rank, K top-k, E experts, P devices, S slots.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar, Dict

import torch

from ..ep import system_config
from ..ep.comm import EPGroup
from ..ep.placement import Placement
from ..ep.plan import RowShape, plan_world
from ..ep.replica_rules import REPLICA_POLICIES
from ..errors import ConfigError
from ..records import row
from ..spec import RunSpec
from .world import one_thread, rank_routing, task_layers, world_source
from .schema import AffinityPacked, LoadCapped
from .world import RoutedWorld


@dataclass
class Config(RoutedWorld, LoadCapped, AffinityPacked):
    """task=placement_load: C_T and load of every placement and replica rule for a world that
    is computed in one process (:mod:`occult.tasks.placement_load`). The routing of
    :class:`RoutedWorld` (the placements built from ``profiling_split``, judged on ``split``),
    or ``max_over_mean`` > 0: the ``imbalance`` workload at that target (profiling set drawn
    at seed + 1). Occult's optimisers run at ``load_cap``, swap_search for ``time_limit_s``
    per layer; the affinity-aware EPLB packing at ``affinity_weight``."""

    max_over_mean: float = 0.0          # > 0: the imbalance workload at this received max / mean
    profiling_split: str = "train"
    time_limit_s: float = 2.0

    entry: ClassVar[str] = "occult.tasks.placement_load.run"
    uses_system: ClassVar[bool] = False          # it plans naive and occult itself

    def check(self) -> None:
        super().check()
        if self.max_over_mean and self.max_over_mean < 1.0:
            raise ConfigError(f"task.max_over_mean={self.max_over_mean}: allowed values are 0 (the routing) or "
                              ">= 1.0 (the imbalance workload)")
        if self.time_limit_s <= 0:
            raise ConfigError(f"task.time_limit_s={self.time_limit_s}: must be > 0 seconds")

    def unread(self) -> Dict[str, str]:
        out = super().unread()
        if self.max_over_mean:
            for name in ("routing", "profiling_split", "sample_layers", "zipf_s", "trace", "source_tokens", "corpus",
                         "split", "seq_len", "routers", "synthetic_tokens", "total_tokens"):
                out.setdefault(name, "not read with task.max_over_mean set (the imbalance workload)")
        elif self.routing != "router":
            out["profiling_split"] = "read only with task.routing=router"
        return out

    def check_run(self, cfg) -> None:
        if self.max_over_mean:
            from ..workloads import max_over_mean_error
            err = max_over_mean_error(self.max_over_mean, cfg.model.num_experts, cfg.model.top_k,
                                      cfg.cluster.world_size)
            if err:
                raise ConfigError(err)
            return
        super().check_run(cfg)


SYSTEMS = {"naive": "baselines.naive.NaiveDispatcher", "occult": "occult.collab.dispatcher.OccultDispatcher"}
OPTIMISED = ("random", "greedy", "swap_search")
# other co-activation weights of the affinity-aware packing (E/8 redundant; occult with round
# robin and collaborative only): the packing's trade-off between C_T and load
WEIGHT_SWEEP = (0.0, 0.1)
# the collaborative rule's cap at its ends, on the affinity-aware packing with occult (what bounds
# the target): slack 0 (the tightest cap) and no cap
SLACKS = {"0": 0.0, "inf": 1e9}


def redundant_counts(E: int, P: int) -> list:
    """EPLB's redundant counts: 0, E/8, E/4, each rounded up to one that makes E + R divisible by P."""
    out = []
    for r in (0, E // 8, E // 4):
        r = next(n for n in range(r, r + P + 1) if (E + n) % P == 0)
        if r not in out:
            out.append(r)
    return out


def routing_sets(cfg, layer: int, source, profiling_source) -> tuple[torch.Tensor, torch.Tensor]:
    """``(profiling ids [N, K], evaluation ids [T P, K])`` of ``layer`` (rank-major)."""
    t, m, P = cfg.task, cfg.model, cfg.cluster.world_size
    if t.max_over_mean:
        from ..workloads import imbalance_routing
        T = t.tokens_per_rank
        ev = imbalance_routing([T] * P, m.top_k, m.num_experts, t.max_over_mean, seed=cfg.seed)[0]
        prof = imbalance_routing([T] * P, m.top_k, m.num_experts, t.max_over_mean, seed=cfg.seed + 1)[0]
        return torch.cat(prof), torch.cat(ev)
    ev = [rank_routing(cfg, source, layer, r, "cpu", need_probs=False)[0] for r in range(P)]
    prof_cfg = profiling_source[0]
    prof = [rank_routing(prof_cfg, profiling_source[1], layer, r, "cpu", salt=1, need_probs=False)[0]
            for r in range(P)]
    return torch.cat(prof), torch.cat(ev)


def layer_placements(cfg, prof_NK: torch.Tensor, devices_per_node: int) -> dict:
    """Every placement arm of one layer from its profiling ids: label -> placement."""
    from ..placement import optimise
    from ..placement.affinity import affinity_placements
    from ..placement.eplb import eplb_placements
    from .one_layer import expert_groups

    t, m, P = cfg.task, cfg.model, cfg.cluster.world_size
    E, G = m.num_experts, expert_groups(m)          # G: the model's expert groups (EPLB's)
    out = {"contiguous": Placement.contiguous(E, P)}
    for name in OPTIMISED:
        out[name] = optimise(name, prof_NK, E, P, load_cap=t.load_cap, seed=cfg.seed, time_limit_s=t.time_limit_s)
    load_E = torch.bincount(prof_NK.flatten(), minlength=E).double()
    counts = redundant_counts(E, P)
    for r in counts:
        out[f"eplb_r{r}"] = eplb_placements({0: load_E}, r, P, devices_per_node, G)[0]
        if r:
            out[f"affinity_r{r}"] = affinity_placements({0: prof_NK}, E, r, P, devices_per_node,
                                                        t.affinity_weight, G)[0]
    for w in WEIGHT_SWEEP:                      # the packing's trade-off, at the smaller count
        if w != t.affinity_weight and len(counts) > 1:
            out[f"affinity_r{counts[1]}_w{w}"] = affinity_placements({0: prof_NK}, E, counts[1], P,
                                                                     devices_per_node, w, G)[0]
    return out


def arms(placements: dict) -> list:
    """``(label, placement, system, rule)`` for every placement, system and applicable rule."""
    out = []
    for name, pl in placements.items():
        copies = hasattr(pl, "copies_E") and bool((pl.copies_E() > 1).any())
        for system in SYSTEMS:
            rules = list(REPLICA_POLICIES if copies else ("-",))
            if "_w" in name:
                if system == "naive":
                    continue
                rules = ["round_robin", "collaborative"]
            elif copies and name.startswith("affinity") and system == "occult":
                rules += [f"collaborative@{s}" for s in SLACKS]
            for rule in rules:
                out.append((f"{name}:{system}:{rule}", pl, system, rule))
    return out


def peer_rows(world: list, P: int, devices_per_node: int, arm: str, layer: int) -> list:
    """Per collective and rank: rows sent to / received from its node and the other nodes
    (its own block excluded), and the collective's row bytes."""
    node_P = torch.arange(P) // (devices_per_node or P)
    same_PP = node_P.unsqueeze(1) == node_P.unsqueeze(0)
    intra_PP = same_PP & ~torch.eye(P, dtype=torch.bool)
    out = []
    for c in world:
        rows_PP = c.rows_PP.cpu().double()
        phase = f"{arm}/{c.phase}"
        got = {"sent_intra_rows": (rows_PP * intra_PP).sum(1), "sent_inter_rows": (rows_PP * ~same_PP).sum(1),
               "recv_intra_rows": (rows_PP * intra_PP).sum(0), "recv_inter_rows": (rows_PP * ~same_PP).sum(0)}
        for name, v_P in got.items():
            out += [row(name, v, "rows", layer=layer, rank=r, phase=phase, direction=c.direction)
                    for r, v in enumerate(v_P.tolist())]
        out += [row("row_bytes", c.row_bytes, "bytes", layer=layer, phase=phase, direction=c.direction),
                row("meta_row_bytes", c.meta_row_bytes, "bytes", layer=layer, phase=phase, direction=c.direction)]
    return out


@lru_cache(maxsize=None)
def typed_system(system: str, rule: str):
    """The typed config of ``system`` with replica rule ``rule`` ("-": its default), made once."""
    d = {"name": system, "_target_": SYSTEMS[system]}
    if rule != "-":
        policy, _, slack = rule.partition("@")
        d["replica_policy"] = policy
        if slack:
            d["slack"] = SLACKS[slack]
    return system_config(d)


def distinct_per_token(dev_TK: torch.Tensor) -> torch.Tensor:
    """Distinct devices among each token's pairs: [T, K] -> [T] (long)."""
    sorted_TK = dev_TK.sort(dim=1).values
    return 1 + (sorted_TK[:, 1:] != sorted_TK[:, :-1]).sum(1)


def arm_rows(shape: RowShape, dims: dict, ep: EPGroup, arm: tuple, ev_NK: torch.Tensor, layer: int) -> list:
    """One arm's rows on the evaluation ids (see the module docstring); ``dims``: the model's
    ``E, K, D, F`` and the world's ``P, G`` as plain ints."""
    label, placement, system, rule = arm
    E, K, D, F, P = (dims[k] for k in ("E", "K", "D", "F", "P"))
    dispatcher = typed_system(system, rule).build(ep, layer, E, placement)
    pl = dispatcher.placement
    T = ev_NK.shape[0] // P
    home_N = torch.arange(P).repeat_interleave(T)
    routing = [(ev_NK[r * T:(r + 1) * T], torch.full((T, K), 1.0 / K)) for r in range(P)]
    world = plan_world(dispatcher, routing, shape, training=True, backward=True)
    dispatch = next(c for c in world if c.phase == "dispatch" and c.direction == "forward")
    recv_P = dispatch.rows_PP.sum(0).double()
    dev_NK = pl.pair_devices(ev_NK, home_N)
    pairs_P = torch.bincount(dev_NK.flatten(), minlength=P)
    e = pl.num_local
    out = [row("ct_all", distinct_per_token(dev_NK).double().mean().item(), "devices/token", layer=layer, phase=label),
           row("recv_max_over_mean", (recv_P.max() / recv_P.mean()).item(), "ratio", layer=layer, phase=label),
           row("bytes", sum(float(c.rows_PP.sum()) * c.row_bytes for c in world), "bytes", layer=layer, phase=label),
           row("expert_slots", e, "experts", layer=layer, phase=label),
           row("expert_memory_bytes", e * 3 * D * F * shape.element_bytes, "bytes", layer=layer, phase=label)]
    out += [row("recv_rows", v, "rows", layer=layer, rank=r, phase=label) for r, v in enumerate(recv_P.tolist())]
    out += [row("expert_rows", v, "rows", layer=layer, rank=r, phase=label) for r, v in enumerate(pairs_P.tolist())]
    return out + peer_rows(world, P, dims["G"], label, layer)


def run(ctx, spec: RunSpec) -> list:
    """The whole front on this one process, at one intra-op thread; returns its rows."""
    with one_thread():
        return _front(ctx, spec)


def _front(ctx, spec: RunSpec) -> list:
    m, t, c = spec.model, spec.task, spec.cluster
    ep = EPGroup(0, c.world_size, None, "cpu", c.devices_per_node)       # never started: nothing is sent
    shape = RowShape(m.hidden_size, m.expert_ffn_size, getattr(torch, m.dtype))
    source = profiling = None
    layers = [0]
    if not t.max_over_mean:
        source = world_source(spec)
        prof_spec = spec.with_task(split=t.profiling_split)
        profiling = (prof_spec, world_source(prof_spec, salt=1))
        layers = task_layers(m, t.sample_layers)
    dims = {"E": int(m.num_experts), "K": int(m.top_k), "D": int(m.hidden_size), "F": int(m.expert_ffn_size),
            "P": int(c.world_size), "G": int(c.devices_per_node)}
    rows = []
    for layer in layers:
        prof_NK, ev_NK = routing_sets(spec, layer, source, profiling)
        for arm in arms(layer_placements(spec, prof_NK, c.devices_per_node)):
            rows += arm_rows(shape, dims, ep, arm, ev_NK, layer)
    return rows
