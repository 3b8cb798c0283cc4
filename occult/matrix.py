"""The combination matrix: which whole-model runs the systems' records accept, sampled so
that every accepted pair of axis values appears in at least one case.

The axes (:data:`AXES`) are what a whole-model run combines: the system, the task
(``prefill``, ``train``), the dispatch mode, the micro-batches, the gradient sync, the
placement (contiguous; EPLB on one node, P = 2; EPLB on two nodes of two, P = 4), the
replica rule (``-``: the system's own, no option set), the payload, sequence migration
and the model (with or without ScMoE's shortcut). :func:`refusal` says from the records
(:mod:`occult.ep.capabilities`) and the options' own rules whether a combination runs;
:func:`accepted_pairs` / :func:`refused_pairs` are the pairs of axis values that some
accepted combination holds / that none does, and :func:`cases` a seeded greedy pairwise
covering of the accepted pairs (AETG: each new case, among seeded random accepted
candidates, the one that covers the most pairs not yet covered). :func:`overrides` turns
a combination into the command line of its run; ``tests/test_matrix.py`` checks that
validation accepts every case and refuses every refused pair in one line, and runs the
cases (``slow``; one per system in the default run).

Systems whose config needs an artifact that only a run makes (a placement file, a
similarity file) are not in the matrix (:data:`NEEDS_ARTIFACT`), nor the no-EP
``reference`` beyond its own row.

    python -m occult.matrix            # the case list
"""
from __future__ import annotations

import itertools
import random
import sys
from dataclasses import dataclass
from functools import cache
from typing import Dict, Iterable, List, Optional, Tuple

from .config import read_conf
from .ep import system_config
from .ep.capabilities import Capabilities
from .ep.payload import PAYLOADS
from .ep.replica_rules import DEVICE_POLICIES, REPLICA_POLICIES

# systems whose options need a file written by another run (validation refuses them without)
NEEDS_ARTIFACT = {"occult_placed": "system.placement_file", "occult_prune_sim": "system.similarity_file"}
PLACEMENTS = ("contiguous", "eplb_one_node", "eplb_two_nodes")
NO_RULE = "-"
SEED = 39


def matrix_systems() -> List[str]:
    """The conf/system names in the matrix (all but :data:`NEEDS_ARTIFACT`), sorted."""
    from .validate import available
    return [name for name in available("system") if name not in NEEDS_ARTIFACT]


def axes() -> Dict[str, tuple]:
    """Axis -> its values (the systems from conf/system)."""
    return {
        "system": tuple(matrix_systems()),
        "task": ("prefill", "train"),
        "dispatch_mode": ("dynamic", "static"),
        "microbatches": (1, 2),
        "grad_sync": ("end", "overlap", "lina"),
        "placement": PLACEMENTS,
        "replica_rule": (NO_RULE,) + tuple(REPLICA_POLICIES),
        "payload": tuple(PAYLOADS),
        "migration": (False, True),
        "shortcut": (False, True),
    }


_RECORDS: dict = {}


def record(system: str) -> Capabilities:
    """The capability record of conf/system ``system`` (its config's: a wrapper's base where
    the base runs the layer)."""
    if system not in _RECORDS:
        _RECORDS[system] = system_config(read_conf("system", system)).capabilities()
    return _RECORDS[system]


def _option_fields(system: str) -> set:
    import dataclasses
    return {f.name for f in dataclasses.fields(type(system_config(read_conf("system", system))))}


_FIELDS: dict = {}


def option_fields(system: str) -> set:
    """The option names of ``system``'s config."""
    if system not in _FIELDS:
        _FIELDS[system] = _option_fields(system)
    return _FIELDS[system]


def refusal(case: dict) -> str:
    """Why a combination does not run ("" when it does), from the records and the options'
    rules; each reason is one validation refuses with."""
    s = case["system"]
    caps = record(s)
    if case["task"] != "train" and case["grad_sync"] != "end":
        return "task.grad_sync: only task=train reads it"
    if case["dispatch_mode"] == "static" and not ("dispatch_mode" in option_fields(s)
                                                  and caps.has("static_dispatch")):
        return "static_dispatch"
    if case["microbatches"] > 1 and caps.expert_parallel and not caps.has("co_execution"):
        return "co_execution"
    if case["placement"] != "contiguous" and not caps.replica_rules:
        return "slots"
    if case["replica_rule"] != NO_RULE and case["replica_rule"] not in caps.replica_rules:
        return "replica_rules"
    if case["payload"] != "fp32" and case["payload"] not in caps.payloads:
        return "payloads"
    if case["migration"] and not caps.has("migration"):
        return "migration"
    if case["dispatch_mode"] == "static":
        rule = case["replica_rule"] if case["replica_rule"] != NO_RULE else "round_robin"
        if rule not in DEVICE_POLICIES:
            return "static dispatch with a host-side replica rule"
        if case["payload"] != "fp32":
            return "static dispatch with a compressed payload"
    return ""


def combinations() -> Iterable[dict]:
    """Every combination of the axes' values."""
    names = list(axes())
    for values in itertools.product(*axes().values()):
        yield dict(zip(names, values))


Pair = Tuple[Tuple[str, object], Tuple[str, object]]


def pairs_of(case: dict) -> List[Pair]:
    """The pairs of axis values a combination holds (axis order)."""
    items = list(case.items())
    return [(a, b) for a, b in itertools.combinations(items, 2)]


@dataclass
class Matrix:
    """The accepted combinations, their pairs and the pairs no accepted combination holds."""

    accepted: List[dict]
    accepted_pairs: set
    refused_pairs: set


_MATRIX: Optional[Matrix] = None


def matrix() -> Matrix:
    """Every combination sorted into accepted ones and the pairs they hold; the other pairs
    of axis values are refused (computed once)."""
    global _MATRIX
    if _MATRIX is None:
        accepted, covered = [], set()
        for case in combinations():
            if not refusal(case):
                accepted.append(case)
                covered.update(pairs_of(case))
        every = set()
        names = list(axes())
        for a, b in itertools.combinations(names, 2):
            every.update(((a, v), (b, w)) for v in axes()[a] for w in axes()[b])
        _MATRIX = Matrix(accepted, covered, every - covered)
    return _MATRIX


def cases(seed: int = SEED, candidates: int = 40) -> List[dict]:
    """A seeded greedy pairwise covering of the accepted pairs: first one case per system
    (the default run's), then, until every accepted pair is covered, the candidate (among
    ``candidates`` seeded random accepted combinations holding an uncovered pair) that
    covers the most uncovered pairs."""
    m = matrix()
    rng = random.Random(seed)
    uncovered = set(m.accepted_pairs)
    by_pair: Dict[Pair, List[int]] = {}
    for i, case in enumerate(m.accepted):
        for p in pairs_of(case):
            by_pair.setdefault(p, []).append(i)
    out: List[dict] = []

    def take(case):
        out.append(case)
        uncovered.difference_update(pairs_of(case))

    for system in axes()["system"]:
        take(first_case(system))
    while uncovered:
        target = min(uncovered, key=lambda p: (len(by_pair[p]), repr(p)))
        pool = by_pair[target]
        picks = [m.accepted[rng.choice(pool)] for _ in range(candidates)]
        take(max(picks, key=lambda c: len(uncovered.intersection(pairs_of(c)))))
    return out


@cache
def defaults() -> dict:
    """The matrix's default case: every axis at the default its schema declares (the train
    task's schedule, placement and migration; a static-capable system's dispatch mode; a
    compressing system's payload), prefill, no replica rule, no shortcut."""
    from .ep.static import StaticConfig
    from .ep.system import PayloadConfig
    from .schemas import field_default

    train = read_conf("task", "train")
    return {"task": "prefill", "dispatch_mode": field_default(StaticConfig, "dispatch_mode"),
            "microbatches": train.microbatches, "grad_sync": train.grad_sync, "placement": train.placement,
            "replica_rule": NO_RULE, "payload": field_default(PayloadConfig, "payload"),
            "migration": train.migration, "shortcut": False}


def first_case(system: str) -> dict:
    """The default run's case of ``system``: training (forward and backward), the defaults
    otherwise, micro-batches where the record allows them."""
    case = {"system": system, **defaults(), "task": "train"}
    if not refusal({**case, "microbatches": 2}):
        case["microbatches"] = 2
    assert not refusal(case), (system, refusal(case))
    return case


def pair_case(pair: Pair) -> dict:
    """A combination holding ``pair``, the defaults elsewhere (the system's default run case
    when the pair names a system): what the refused-pair check validates."""
    (a, v), (b, w) = pair
    case = {"system": "naive", **defaults()}
    case.update({a: v, b: w})
    return case


def world_of(case: dict) -> Tuple[int, int]:
    """``(world size, devices per node)`` of a case: EPLB on two nodes runs 2 x 2."""
    return (4, 2) if case["placement"] == "eplb_two_nodes" else (2, 0)


def overrides(case: dict) -> List[str]:
    """The command line of a case (whole model: the OLMoE proxy, or the ScMoE proxy for the
    shortcut; EPLB with 4 redundant slots)."""
    P, G = world_of(case)
    out = [f"system={case['system']}", f"task={case['task']}",
           f"model={'scmoe_proxy' if case['shortcut'] else 'olmoe_proxy'}", f"cluster=cpu{P}"]
    if G:
        out.append(f"cluster.devices_per_node={G}")
    default = defaults()
    if case["dispatch_mode"] != default["dispatch_mode"]:
        out.append(f"system.dispatch_mode={case['dispatch_mode']}")
    if case["replica_rule"] != NO_RULE:
        out.append(f"system.replica_policy={case['replica_rule']}")
    if case["payload"] != default["payload"]:
        out.append(f"system.payload={case['payload']}")
    if case["microbatches"] != default["microbatches"]:
        out.append(f"task.microbatches={case['microbatches']}")
    if case["grad_sync"] != default["grad_sync"]:
        out.append(f"task.grad_sync={case['grad_sync']}")
    if case["placement"] != default["placement"]:
        out += ["task.placement=eplb", "task.num_redundant=4"]
    if case["migration"]:
        out.append("task.migration=true")
    return out


def label(case: dict) -> str:
    """One case in one line."""
    return " ".join(f"{k}={v}" for k, v in case.items())


def main(argv) -> int:
    out = cases()
    m = matrix()
    for i, case in enumerate(out):
        print(f"{i:3d} {label(case)}")
    print(f"{len(out)} cases; {len(m.accepted)} accepted combinations; {len(m.accepted_pairs)} accepted pairs, "
          f"{len(m.refused_pairs)} refused")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
