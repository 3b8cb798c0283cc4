"""Placement rescheduling: co-activation profiling, optimisers, artifacts, weight permutation."""
import json

import pytest
import torch

from occult.ep import Placement, TopKRouter, ct_all, devices_per_token, reference_moe
from occult.ep.experts import init_expert_weights
from occult.placement import (OPTIMISERS, apply_placement_to_weights, coactivation, device_load, expert_load,
                              greedy, greedy_from_counts, load_max_over_mean, load_placements, optimise,
                              placed_expert_ids, placement_summary, save_placements, swap_search)
from occult.placement.optimisers import _SwapState


def clustered_topk(num_tokens, num_experts, top_k, cluster_size, boost, seed, used_experts=None):
    """Planted structure: each token favours one cluster of experts (log-weight + ``boost``),
    with a mild popularity skew; expert ids shuffled so contiguous placement ignores the
    clusters. ``used_experts`` (< E) leaves the other experts never chosen."""
    g = torch.Generator().manual_seed(seed)
    E = used_experts or num_experts
    cluster_T = torch.randint(E // cluster_size, (num_tokens,), generator=g)
    in_TE = (torch.arange(E).unsqueeze(0) // cluster_size) == cluster_T.unsqueeze(1)
    logw_TE = -0.3 * torch.log(torch.arange(1, E + 1, dtype=torch.float64)).unsqueeze(0) + boost * in_TE
    u_TE = torch.rand(num_tokens, E, generator=g, dtype=torch.float64).clamp_min(1e-300)
    ids_TK = torch.topk(logw_TE - torch.log(-torch.log(u_TE)), top_k, dim=1).indices
    return torch.randperm(num_experts, generator=g)[:E][ids_TK]


def assert_equal_partition(pl: Placement, num_experts: int, num_devices: int):
    groups = pl.groups()
    assert len(groups) == num_devices
    assert all(len(g) == num_experts // num_devices for g in groups)
    assert sorted(x for g in groups for x in g) == list(range(num_experts))


# --- co-activation ---------------------------------------------------------------------------

def test_coactivation_by_hand():
    ids = torch.tensor([[0, 1], [1, 2], [0, 1]])
    counts = coactivation(ids, 4)
    assert counts.tolist() == [[2, 2, 0, 0], [2, 3, 1, 0], [0, 1, 1, 0], [0, 0, 0, 0]]
    assert expert_load(ids, 4).tolist() == [2, 3, 1, 0]


def test_coactivation_matches_loop():
    ids = clustered_topk(300, 12, 3, 4, 1.0, seed=1)
    expect = torch.zeros(12, 12, dtype=torch.long)
    for row in ids.tolist():
        for a in row:
            for b in row:
                expect[a, b] += 1
    counts = coactivation(ids, 12)
    assert torch.equal(counts, expect)
    assert torch.equal(counts, counts.t())
    with pytest.raises(ValueError, match="outside"):
        coactivation(ids, 5)


def test_device_load_by_hand():
    pl = Placement.contiguous(4, 2)
    ids = torch.tensor([[0, 1], [0, 2], [1, 3]])
    assert device_load(ids, pl).tolist() == [4, 2]
    assert load_max_over_mean(ids, pl) == pytest.approx(4 / 3)
    summary = placement_summary(ids, pl)
    assert summary["ct_all"] == pytest.approx(5 / 3)


# --- optimisers ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(OPTIMISERS))
def test_every_optimiser_returns_equal_groups(name):
    ids = clustered_topk(2000, 16, 4, 4, 2.0, seed=0)
    pl = optimise(name, ids, 16, 4, seed=3, time_limit_s=5)
    assert_equal_partition(pl, 16, 4)


@pytest.mark.parametrize("name", sorted(OPTIMISERS))
def test_optimisers_handle_experts_that_never_coactivate(name):
    # only 10 of 24 experts are ever chosen: 14 zero rows in the co-activation matrix
    ids = clustered_topk(1500, 24, 3, 5, 2.0, seed=2, used_experts=10)
    assert int((expert_load(ids, 24) == 0).sum()) == 14
    for P in (2, 3, 4, 6):
        assert_equal_partition(optimise(name, ids, 24, P, load_cap=1.3, time_limit_s=5), 24, P)


def test_greedy_on_counts_alone_and_without_any_routing():
    assert_equal_partition(greedy_from_counts(torch.zeros(8, 8, dtype=torch.long), 2), 8, 2)
    ids = torch.tensor([[0, 5], [0, 5], [2, 7]])
    pl = greedy(ids, 8, 4)
    assert pl.device_E[0] == pl.device_E[5] and pl.device_E[2] == pl.device_E[7]


def test_bad_partition_and_names_raise():
    ids = clustered_topk(100, 10, 2, 5, 1.0, seed=0)
    for name in OPTIMISERS:
        with pytest.raises(ValueError, match="num_devices=4"):
            optimise(name, ids, 10, 4)
    with pytest.raises(ValueError, match="placement.optimiser='spectral'"):
        optimise("spectral", ids, 10, 2)
    with pytest.raises(ValueError, match="placement.load_cap=0.9"):
        optimise("greedy", ids, 10, 2, load_cap=0.9)


@pytest.mark.parametrize("cap", [1.25, 1.1])
def test_load_cap_respected_when_feasible(cap):
    ids = clustered_topk(4000, 32, 4, 8, 2.0, seed=4)
    # the cluster structure is strong enough that uncapped grouping goes above these caps
    assert load_max_over_mean(ids, optimise("greedy", ids, 32, 4)) > 1.1
    for name in ("random", "greedy", "swap_search"):
        pl = optimise(name, ids, 32, 4, load_cap=cap, seed=1, time_limit_s=5)
        assert load_max_over_mean(ids, pl) <= cap + 1e-9, name


def test_infeasible_cap_returns_most_balanced_partition():
    ids = torch.tensor([[0, 1]] * 50 + [[2, 3]] * 5)      # expert 0 alone exceeds any tight cap
    for name in ("random", "greedy", "swap_search"):
        pl = optimise(name, ids, 8, 4, load_cap=1.0, time_limit_s=5)
        assert_equal_partition(pl, 8, 4)
        assert device_load(ids, pl).max() == 50


@pytest.mark.parametrize("cap", [None, 1.2])
def test_planted_structure_lowers_ct(cap):
    ids = clustered_topk(4000, 32, 4, 8, 2.5, seed=5)
    ct = {name: ct_all(ids, optimise(name, ids, 32, 4, load_cap=cap, seed=0)) for name in ("contiguous", "random", "greedy")}
    ct["swap_search"] = ct_all(ids, swap_search(ids, 32, 4, load_cap=cap, time_limit_s=None, restarts=2, rounds=4))
    for name in ("greedy", "swap_search"):
        assert ct[name] < 0.9 * ct["contiguous"], ct
        assert ct[name] < 0.9 * ct["random"], ct
    assert ct["swap_search"] <= ct["greedy"] + 1e-9, ct


def test_swap_deltas_are_exact():
    ids = clustered_topk(500, 12, 3, 3, 1.0, seed=6)
    pl = optimise("random", ids, 12, 3, seed=2)
    state = _SwapState(ids, pl.device_E, 3)
    delta_EE = state.deltas()
    base = int(devices_per_token(ids, pl).sum())
    for a, b in [(0, 1), (2, 7), (5, 11), (3, 9), (4, 6)]:
        device_E = pl.device_E.clone()
        device_E[a], device_E[b] = pl.device_E[b], pl.device_E[a]
        groups = [torch.nonzero(device_E == p).flatten().tolist() for p in range(3)]
        after = int(devices_per_token(ids, Placement.from_groups(groups)).sum())
        if pl.device_E[a] == pl.device_E[b]:
            assert delta_EE[a, b] == float("inf")
        else:
            assert float(delta_EE[a, b]) == after - base, (a, b)
            state.swap(a, b)
            assert state.hits() == after
            state.swap(a, b)


def test_swap_search_is_seeded_and_accepts_a_start():
    ids = clustered_topk(2000, 16, 4, 4, 2.0, seed=7)
    a = swap_search(ids, 16, 4, seed=3, time_limit_s=None, restarts=1, rounds=3)
    b = swap_search(ids, 16, 4, seed=3, time_limit_s=None, restarts=1, rounds=3)
    assert a.groups() == b.groups()
    start = Placement.contiguous(16, 4)
    c = swap_search(ids, 16, 4, restarts=0, rounds=0, start=start)
    assert ct_all(ids, c) <= ct_all(ids, start)


# --- artifacts ------------------------------------------------------------------------------

def test_artifact_round_trip(tmp_path):
    ids = clustered_topk(1000, 16, 4, 4, 2.0, seed=8)
    placements = {0: optimise("greedy", ids, 16, 4), 3: optimise("random", ids, 16, 4, seed=1)}
    meta = {"optimiser": "greedy", "load_cap": None, "ct_before": 3.1, "ct_after": 2.5}
    path = tmp_path / "sub" / "placements.json"
    save_placements(path, placements, meta)
    loaded, meta2 = load_placements(path)
    assert meta2 == meta
    assert sorted(loaded) == [0, 3]
    for layer, pl in placements.items():
        assert loaded[layer].groups() == pl.groups()
        assert torch.equal(loaded[layer].device_E, pl.device_E)
    with pytest.raises(ValueError, match="JSON-serialisable"):
        save_placements(tmp_path / "x.json", placements, {"t": torch.ones(1)})


@pytest.mark.parametrize("doc, match", [
    ({"format": "other", "layers": {}}, "format must be"),
    ({"format": "occult-placements/v1", "layers": {}}, "non-empty"),
    ({"format": "occult-placements/v1", "layers": {"a": [[0], [1]]}}, "layer 'a'"),
    ({"format": "occult-placements/v1", "layers": {"0": [[0, 1], [2, 3]], "2": [[0, 1], [1, 3]]}},
     "layer 2: groups must cover experts 0..3 exactly once"),
    ({"format": "occult-placements/v1", "layers": {"1": [[0, 1, 2], [3]]}}, "layer 1: devices must host"),
    ({"format": "occult-placements/v1", "layers": {"0": [[0, 1], [2, 3]], "1": [[0], [1], [2], [3]]}},
     "layer 1: 4 experts on 4 devices"),
    ({"format": "occult-placements/v1", "layers": {"5": [[0, "1"], [2, 3]]}}, "layer 5: expert ids"),
])
def test_bad_artifact_names_file_and_layer(tmp_path, doc, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=match) as err:
        load_placements(path)
    assert str(path) in str(err.value)


def test_non_json_artifact(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not a JSON placement artifact"):
        load_placements(path)


# --- moving weights -------------------------------------------------------------------------

def test_weight_permutation_keeps_the_function():
    torch.manual_seed(0)
    E, K, P, D, F, T = 8, 3, 4, 6, 5, 20
    weights = init_expert_weights(E, D, F, torch.Generator().manual_seed(0))
    router_ED = torch.randn(E, D)
    x_TD = torch.randn(T, D)
    pl = Placement.from_groups([[5, 2], [7, 0], [1, 6], [3, 4]])
    _, ids_TK, w_TK = TopKRouter(router_ED, K)(x_TD)
    expect_TD = reference_moe(x_TD, ids_TK, w_TK, weights)

    moved, router2_ED = apply_placement_to_weights(weights, router_ED, pl)
    assert torch.equal(moved["w_up"][0], weights["w_up"][5])          # row i holds global_order()[i]
    _, ids2_TK, w2_TK = TopKRouter(router2_ED, K)(x_TD)
    assert torch.equal(ids2_TK, placed_expert_ids(ids_TK, pl))         # same choice, renamed
    assert torch.allclose(w2_TK, w_TK)
    assert torch.allclose(reference_moe(x_TD, ids2_TK, w2_TK, moved), expect_TD, atol=1e-6)
    # the permuted model's experts are contiguous in the new order
    new_pl = Placement.contiguous(E, P)
    assert torch.equal(new_pl.device_E[ids2_TK], pl.device_E[ids_TK])

    back, router3_ED = apply_placement_to_weights(moved, router2_ED, pl, inverse=True)
    assert all(torch.equal(back[k], weights[k]) for k in weights)
    assert torch.equal(router3_ED, router_ED)
    with pytest.raises(ValueError, match="router_weight_ED: dim 0 has 7 rows"):
        apply_placement_to_weights(weights, router_ED[:7], pl)
