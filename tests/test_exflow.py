"""ExFlow: the dispatcher equals the single-device reference (K = 1 and K > 1, any
placement) with one all-to-all per layer for K = 1; hop counts and cross-device
shares by hand; the affinity placement (HiGHS) beats contiguous on a planted
affinity, keeps equal groups and its time limit; artifacts feed ``placement_file``."""
import json

import numpy as np
import pandas as pd
import pytest
import torch

from baselines.exflow import new_home_device
from baselines.exflow_placement import (conditional_probability, contiguous_placements, cross_device_fraction,
                                        place_by_affinity, save_exflow_placements, transition_counts)
from occult.dist import launch
from occult.ep import Placement, system_config
from occult.parity import LayerCase, check_layer, run_grid
from systems import system

EXFLOW = "baselines.exflow.ExFlowDispatcher"
TOL = 1e-9
SHUFFLED = [[5, 0, 9, 3], [1, 11, 6, 2], [8, 4, 10, 7]]        # 12 experts on 3 devices, not contiguous
CASES = [
    (LayerCase(6, 1, (5, 9, 4), routing="uniform", seed=1), None),
    (LayerCase(6, 1, (0, 7, 3), routing="router", seed=2), None),              # a rank with no tokens
    (LayerCase(12, 1, (6, 6, 6), routing="router", seed=3), SHUFFLED),
    (LayerCase(6, 2, (5, 9, 4), routing="router", renormalize=True, seed=4), None),
    (LayerCase(12, 4, (8, 0, 5), routing="uniform", seed=5), SHUFFLED),
    (LayerCase(12, 6, (7, 4, 9), routing="router", seed=6), None),
    (LayerCase(12, 4, (6, 6, 6), routing="one_device", seed=7), None),         # every expert on device 0
    (LayerCase(6, 6, (3, 2, 4), routing="router", seed=8), None),              # K = E
]


def _counter_rank(ctx):
    """``return_rows_avoided`` on a problem checked by hand: 6 experts on 3 ranks (0,1 | 2,3
    | 4,5); a token's new home is the device of its highest-weight expert."""
    disp = system_config(system(EXFLOW, "exflow")).build(ctx.ep, 0, 6)
    ids, w = [(torch.tensor([[0, 5], [2, 1], [4, 2]]), torch.tensor([[0.2, 0.8], [0.6, 0.4], [0.5, 0.5]])),
              (torch.tensor([[1, 0], [3, 0]]), torch.tensor([[0.9, 0.1], [0.3, 0.7]])),
              (torch.tensor([[4, 0]]), torch.tensor([[0.6, 0.4]]))][ctx.rank]
    _, _, handle = disp.dispatch(torch.randn(ids.shape[0], 4), ids, w)
    return handle.new_home_T.tolist(), disp.stats(handle)


def _world(ctx):
    return run_grid(ctx, [(system(EXFLOW, "exflow"), case, groups) for case, groups in CASES]), _counter_rank(ctx)


@pytest.mark.timeout(120)
def test_exflow_matches_reference_and_sends_one_all_to_all_for_top1():
    per_rank = launch(_world, 3, (), timeout_s=100)
    failures = []
    for i, (case, _) in enumerate(CASES):
        grids = [grid[i] for grid, _ in per_rank]
        for rank, res in enumerate(grids):
            bad = {k: v for k, v in res["errors"].items() if not v <= TOL}
            if bad:
                failures.append(f"rank {rank} {case}: {bad}")
        total = lambda key: sum(res["sent_rows"].get((key, "forward"), 0) for res in grids)
        assert total("dispatch") == sum(case.tokens) * case.top_k
        assert total("return_home") == sum(case.tokens)          # the harness's leg: one row per token
        if case.top_k == 1:       # no combine leg: the output stays where the expert ran
            assert total("combine") == 0 and total("dispatch_index") == 0
        else:                     # one partial per (token, device it uses)
            assert total("combine") == sum(res["distinct_devices"] for res in grids)
    assert not failures, "\n".join(failures)
    # top experts: rank 0: 5, 2, 4 (a tie: first slot); rank 1: 1, 0; rank 2: 4
    homes = [r[1] for r in per_rank]
    assert homes == [([2, 1, 2], {"return_rows_avoided": 3}), ([0, 0], {"return_rows_avoided": 2}),
                     ([2], {"return_rows_avoided": 0})]


def test_new_home_is_the_highest_weight_experts_device_first_slot_on_ties():
    pl = Placement.from_groups([[0, 3], [1, 2]])
    ids = torch.tensor([[0, 1], [1, 3], [2, 0]])
    w = torch.tensor([[0.4, 0.6], [0.5, 0.5], [0.9, 0.1]])
    assert new_home_device(ids, w, pl).tolist() == [1, 1, 1]


# --------------------------------------------------------------------------- transitions


def test_transitions_and_cross_device_fraction_by_hand():
    # K = 1, 4 experts on 2 devices (contiguous: 0,1 | 2,3); hops 0->1 (same), 1->2 (cross), 2->3 (same)
    routing = {0: (torch.tensor([[0], [1], [2]]), None), 1: (torch.tensor([[1], [2], [3]]), None)}
    tr = transition_counts(routing, 4)
    expected = torch.zeros(4, 4, dtype=torch.float64)
    expected[0, 1] = expected[1, 2] = expected[2, 3] = 1
    assert torch.equal(tr[(0, 1)], expected)
    pls = contiguous_placements([0, 1], 4, 2)
    assert cross_device_fraction(tr, pls) == pytest.approx(1 / 3)
    # K = 2 with weights: the primary source is expert 2 (weight 0.7, device 1) -> {1: cross, 3: same}
    routing = {0: (torch.tensor([[0, 2]]), torch.tensor([[0.3, 0.7]])), 1: (torch.tensor([[1, 3]]), None)}
    assert cross_device_fraction(transition_counts(routing, 4, "primary"), pls) == pytest.approx(1 / 2)
    # every top-k expert as a source: (0,1) same, (0,3) cross, (2,1) cross, (2,3) same
    tr_all = transition_counts(routing, 4, "all")
    assert float(tr_all[(0, 1)].sum()) == 4
    assert cross_device_fraction(tr_all, pls) == pytest.approx(2 / 4)
    with pytest.raises(ValueError, match="source"):
        transition_counts(routing, 4, "weighted")


def test_conditional_probability_by_hand():
    # K = 2: source 0 had 2 tokens, hops to experts 0 (twice), 1 and 2; expert 1 never a source
    counts = torch.tensor([[2.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    prob = conditional_probability(counts, top_k=2)
    assert prob[0].tolist() == [1.0, 0.5, 0.5] and prob[1].tolist() == [0.0, 0.0, 0.0]


def planted_routing(tokens: int, E: int, layers: int, seed: int) -> dict:
    """K = 1 routing where layer l+1's expert is a fixed permutation of layer l's."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (tokens, 1), generator=g)
    routing = {0: (ids, None)}
    for layer in range(1, layers):
        ids = torch.randperm(E, generator=g)[ids]
        routing[layer] = (ids, None)
    return routing


# --------------------------------------------------------------------------- placement by IP


@pytest.mark.timeout(60)
def test_ip_placement_beats_contiguous_on_planted_affinity():
    E, P, L = 16, 4, 3
    tr = transition_counts(planted_routing(800, E, L, seed=0), E)
    result = place_by_affinity(tr, E, P, time_limit_s=20.0)
    before = cross_device_fraction(tr, contiguous_placements(range(L), E, P))
    after = cross_device_fraction(tr, result.placements)
    assert before > 0.4
    assert after == 0.0                   # the permutations can be followed exactly
    assert len(result.bisections) == P - 1
    assert all(b.cut <= b.start_cut <= b.contiguous_cut for b in result.bisections)


@pytest.mark.parametrize("E,P", [(12, 3), (16, 4), (10, 2)])
def test_ip_placement_has_equal_groups_on_every_layer(E, P):
    g = torch.Generator().manual_seed(E + P)
    routing = {layer: (torch.topk(torch.rand(300, E, generator=g), 2).indices, None) for layer in (1, 2, 4)}
    result = place_by_affinity(transition_counts(routing, E), E, P, time_limit_s=1.0)
    assert sorted(result.placements) == [1, 2, 4]
    for pl in result.placements.values():
        assert torch.bincount(pl.device_E, minlength=P).tolist() == [E // P] * P
        assert sorted(x for g in pl.groups() for x in g) == list(range(E))


@pytest.mark.timeout(60)
def test_solver_time_limit_is_respected():
    E, L = 32, 4
    g = torch.Generator().manual_seed(1)
    routing = {layer: (torch.topk(torch.rand(1500, E, generator=g), 4).indices, None) for layer in range(L)}
    tr = transition_counts(routing, E)
    limit = 1.0
    result = place_by_affinity(tr, E, 2, time_limit_s=limit)
    # a hard limit: the solver process is stopped at the budget (model building and fork on top)
    assert result.seconds < limit + 1.0
    assert result.bisections[0].status in ("Time limit reached", "Stopped at the time limit", "Optimal")
    before = cross_device_fraction(tr, contiguous_placements(range(L), E, 2))
    assert cross_device_fraction(tr, result.placements) <= before


def test_invalid_shapes_are_clear_errors():
    tr = transition_counts(planted_routing(50, 6, 2, seed=0), 6)
    with pytest.raises(ValueError, match="world_size"):
        place_by_affinity(tr, 6, 4)
    with pytest.raises(ValueError, match="time_limit_s"):
        place_by_affinity(tr, 6, 2, time_limit_s=0)


# --------------------------------------------------------------------------- artifacts


def test_placement_artifact_feeds_the_dispatcher(tmp_path):
    E, P = 8, 2
    tr = transition_counts(planted_routing(200, E, 3, seed=2), E)
    result = place_by_affinity(tr, E, P, time_limit_s=5.0)
    path = save_exflow_placements(tmp_path / "pl.json", result, {"note": "test"})
    meta = json.loads(path.read_text())["meta"]
    assert meta["optimiser"] == "exflow_affinity_ip" and meta["solver"] == "highs"
    placed = system_config(system(EXFLOW, "exflow", placement_file=str(path)))
    for layer in range(3):
        got = placed.layer_placement(layer, E, P)
        assert torch.equal(got.device_E, result.placements[layer].device_E)
    plain = system_config(system(EXFLOW, "exflow"))
    assert torch.equal(plain.layer_placement(0, E, P).device_E, Placement.contiguous(E, P).device_E)
    with pytest.raises(ValueError, match="no placement for MoE layer 7"):
        placed.layer_placement(7, E, P)
    with pytest.raises(ValueError, match="places 8 experts on 2 devices; this run has model.num_experts=8 on "
                                         "world size 4"):
        placed.layer_placement(0, E, 4)


def test_a_file_that_is_not_a_placement_is_refused_at_validation(tmp_path):
    """ExFlow shares the placement-file option of Occult's placed systems: a file that is
    not a placement artifact fails validation in one line, before any rank starts (it
    used to start the ranks and end in a traceback)."""
    from hydra import compose, initialize_config_dir

    from occult.config import CONF_DIR, register
    from occult.validate import ConfigError, validate

    bad = tmp_path / "notes.json"
    bad.write_text('{"hello": 1}')
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["system=exflow", f"system.placement_file={bad}"])
    with pytest.raises(ConfigError, match=r"system.placement_file=.*notes.json.* is not a placement artifact") as err:
        validate(cfg)
    assert "\n" not in str(err.value)


def test_single_process_parity_with_an_artifact_placement(tmp_path):
    """The dispatcher with an affinity placement is still exact (world of one rank)."""
    from occult.dist import RankContext
    from occult.ep import EPGroup

    E = 8
    result = place_by_affinity(transition_counts(planted_routing(100, E, 2, seed=3), E), E, 1, time_limit_s=1.0)
    ctx = RankContext(rank=0, world_size=1, ep=EPGroup(), seed=0)
    res = check_layer(ctx, system(EXFLOW, "exflow"), LayerCase(E, 3, (9,), routing="router", seed=9),
                      result.placements[0])
    assert max(res["errors"].values()) <= TOL


def test_study_on_a_synthetic_trace(tmp_path):
    """analysis.figures.exflow_affinity on a run folder with a planted trace: CSV, figure, artifact."""
    from analysis.figures.exflow_affinity import plot_affinity, study
    from analysis.sections import resolve_builders
    from occult.placement import load_placements

    E, K, B, S = 8, 1, 4, 16
    run = tmp_path / "model=toy"
    run.mkdir()
    routing = planted_routing(2 * B * S, E, 3, seed=4)       # 2 ranks x B sequences x S tokens
    frames = []
    for layer, (ids, _) in routing.items():
        T = ids.shape[0]
        frames.append(pd.DataFrame({"layer": layer, "rank": np.arange(T) // (B * S), "token": np.arange(T) % (B * S),
                                    "slot": 0, "expert": ids.flatten().numpy(), "weight": 1.0}))
    pd.concat(frames).to_parquet(run / "routing.parquet")
    df = pd.DataFrame([{"model": "toy", "num_experts": E, "top_k": K, "batch_size": B, "seq_len": S,
                        "run_id": "t/toy", "run_dir": str(run)}])
    table = study(df, tmp_path, world_sizes=[2, 3], time_limit_s=2.0)
    assert set(table.split) == {"profile", "heldout"} and set(table.world_size) == {2}   # 8 % 3 != 0: skipped
    assert (table.exflow_ip <= table.contiguous).all() and (table.exflow_ip == 0).all()
    assert (table.affinity_top1 == 1.0).all()           # the planted successor is certain
    assert (tmp_path / "exflow_affinity.csv").is_file()
    assert any(p.suffix == ".png" for p in plot_affinity(table, tmp_path))
    placements, meta = load_placements(tmp_path / "exflow_placements_toy_p2.json")
    assert sorted(placements) == [0, 1, 2] and meta["model"] == "toy"
    assert resolve_builders("exflow_affinity")
