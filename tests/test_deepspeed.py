"""system=deepspeed: the deepspeed library's MOELayer, driven with the harness's routing
and experts, equals the single-device reference (dropless), drops what GShard's
capacity says it drops, and sends e*C rows to every peer.

The first DeepSpeed world on a machine builds DeepSpeed's shared-memory C++ op
(about 2.5 minutes on 2 cores, then cached per machine in ~/.cache/occult-bench/torch_extensions), so
every test that starts a world has a generous timeout. DeepSpeed is a dependency of the
project (pyproject.toml), so these tests are not skipped when it is missing: they fail.
"""
import pytest
import torch

from occult.dist import launch
from occult.ep import EPGroup, Placement, TopKRouter
from occult.parity import LayerCase, make_problem, run_model_grid

from deepspeed_helpers import DEEPSPEED, dropping_call, grid_and_version
from systems import system
from test_models import PROXIES, tiny

TOL = 1e-9
# cold op cache: a rank may wait for a peer's compile inside the first collective
WORLD = dict(timeout_s=840, collective_timeout_s=600)


def dropless_cases(P: int) -> list:
    T = (5, 9, 4, 7)[:P]
    cases = []
    for E in sorted({P, 8, 4 * P}):                  # e = 1 and several local experts
        for K in (1, 2):
            cases.append(LayerCase(E, K, T, routing="uniform", seed=10 * E + K))
            cases.append(LayerCase(E, K, T, routing="router", renormalize=K > 1, seed=10 * E + K + 1))
            cases.append(LayerCase(E, K, (0,) + T[1:], routing="uniform", seed=3))     # a rank with no tokens
    return cases


def dropless_capacity(case: LayerCase) -> int:
    """C by hand: the largest number of routes one rank sends to one expert (at least 1)."""
    placement = Placement.contiguous(case.num_experts, len(case.tokens))
    prob = make_problem(case, placement)
    ids_TK = prob.ids_TK
    if ids_TK is None:
        ids_TK = TopKRouter(prob.router_ED, case.top_k, case.renormalize)(prob.x_TD)[1]
    best, lo = 1, 0
    for t in case.tokens:
        if t:
            best = max(best, int(torch.bincount(ids_TK[lo:lo + t].flatten(), minlength=case.num_experts).max()))
        lo += t
    return best


@pytest.mark.timeout(900)
@pytest.mark.parametrize("P", [2, 4])
def test_dropless_matches_reference_and_sends_e_times_c(P):
    cases = dropless_cases(P)
    jobs = [(system(DEEPSPEED, "deepspeed", capacity_factor=0), case, None) for case in cases]
    results = launch(grid_and_version, P, (jobs,), **WORLD)
    failures = []
    for rank, res in enumerate(results):
        assert res["version"] == "0.19.8"
        for case, one in zip(cases, res["grid"]):
            bad = {k: v for k, v in one["errors"].items() if not v <= TOL}
            if bad:
                failures.append(f"P={P} rank={rank} {case}: {bad}")
            e, C = case.num_experts // P, dropless_capacity(case)
            phases = {(ev.phase, ev.direction): list(ev.rows_P) for ev in one["comm"]}
            for key in (("dispatch", "forward"), ("combine", "forward"),
                        ("combine", "backward"), ("dispatch", "backward")):
                assert phases.get(key) == [e * C] * P, (P, rank, case, key, phases)
    assert not failures, "\n".join(failures[:20])


# E=4 on P=2 (e=2), K=2, 6 tokens per rank; cf=0.5: C = ceil(6/4 * 0.5 * 2) = 2 per (rank, expert)
DROP_IDS = [[0, 1]] * 6 + [[2, 3], [3, 2], [2, 0], [1, 2], [3, 1], [0, 3]]
# queues, first choices in token order, then second choices; positions >= 2 dropped:
#   rank 0: expert 0 <- t0..t5 (k=0), expert 1 <- t0..t5 (k=1): t0, t1 kept in each
#   rank 1: expert 2 <- t0, t2 (k=0), t1, t3 (k=1); expert 3 <- t1, t4 (k=0), t0, t5 (k=1);
#           experts 0 and 1 get two routes each: all kept
DROP_KEEP = [[1, 1]] * 2 + [[0, 0]] * 4 + [[1, 0], [1, 0], [1, 1], [1, 0], [1, 1], [1, 0]]


@pytest.mark.timeout(900)
def test_capacity_drops_by_hand():
    case = LayerCase(4, 2, (6, 6), routing="explicit", seed=7,
                     explicit_ids=tuple(i for pair in DROP_IDS for i in pair))
    results = launch(dropping_call, 2, (case, {"capacity_factor": 0.5, "min_capacity": 1}, DROP_KEEP), **WORLD)
    e, C = 2, 2
    dropped = [12 - 4, 12 - 8]                       # routes minus kept routes
    for rank, res in enumerate(results):
        assert res["error"] <= TOL, (rank, res["error"])
        assert res["counters"]["dropped_pairs"] == dropped[rank]
        assert res["counters"]["padding_rows"] == 4 * C - (12 - dropped[rank])
        assert res["rows"][("dispatch", "forward")] == [e * C] * 2
        assert res["rows"][("combine", "forward")] == [e * C] * 2


@pytest.mark.timeout(900)
def test_models_match_single_device():
    """The paper's proxies (float32, tiny widths) through DeepSpeed's MOELayer at P=2."""
    system = {"name": "deepspeed", "_target_": DEEPSPEED}
    jobs = [({"model": tiny(n), "system": system, "seed": 1}, 2, 8) for n in PROXIES]
    per_rank = launch(run_model_grid, 2, (jobs,), **WORLD)
    for rank, results in enumerate(per_rank):
        for (cfg, _, _), res in zip(jobs, results):
            bad = {k: v for k, v in res["errors"].items() if not v < 2e-5}
            assert not bad, (rank, cfg["model"]["name"], bad)


def test_options_and_placement_are_checked():
    from occult.ep import system_config

    def config(**options):
        return system_config(system(DEEPSPEED, "deepspeed", **options))

    assert config(capacity_factor=0).is_exact()
    assert not config(capacity_factor=1.25).is_exact()
    ep = EPGroup(rank=0, world_size=2)
    with pytest.raises(ValueError, match="contiguous placement"):
        config().build(ep, 0, 4, Placement.from_groups([[1, 0], [2, 3]]))
    with pytest.raises(ValueError, match="capacity_factor"):
        config(capacity_factor=-1).check(num_experts=4, top_k=2, world_size=2)
    with pytest.raises(ValueError, match="min_capacity"):
        config(capacity_factor=1, min_capacity=0).check(num_experts=4, top_k=2, world_size=2)
