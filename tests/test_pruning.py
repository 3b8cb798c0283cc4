"""Collaboration pruning: device budgets, score- and similarity-based transforms, gate weights."""
import pytest
import torch

from occult.ep import Placement, ct_all, devices_per_token
from occult.pruning import (GroupLimit, ScorePruning, SimilarityPruning, check_budget, device_scores,
                            expert_similarity, make_pruning, min_budget)


def routing(T, E, K, seed=0):
    """Random router logits, probabilities, and their top-k (ids, weights)."""
    g = torch.Generator().manual_seed(seed)
    logits_TE = torch.randn(T, E, generator=g) * 2
    probs_TE = logits_TE.softmax(-1)
    top = torch.topk(probs_TE, K, dim=1)
    return logits_TE, probs_TE, top.indices, top.values


def shuffled_placement(E, P, seed=0):
    perm = torch.randperm(E, generator=torch.Generator().manual_seed(seed))
    return Placement.from_groups(perm.view(P, E // P).tolist())


def transforms(budget, logits_TE):
    """Every transform variant for one budget."""
    sim_EE = expert_similarity(logits_TE)
    out = [ScorePruning(budget, score, rule) for score in ("sum", "max") for rule in ("own", "replaced", "renormalize")]
    out += [SimilarityPruning(budget, sim_EE, rule) for rule in ("own", "replaced", "renormalize")]
    out += [GroupLimit(budget, rule) for rule in ("own", "replaced", "renormalize")]
    return out


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_budget_respected_and_k_distinct(budget):
    E, K, P = 16, 4, 4
    logits, probs, ids, w = routing(2000, E, K)
    pl = shuffled_placement(E, P)
    for tr in transforms(budget, logits):
        ids2, w2 = tr(probs, ids, w, pl)
        assert ids2.shape == ids.shape and w2.shape == w.shape
        assert int(devices_per_token(ids2, pl).max()) <= budget, tr
        assert ct_all(ids2, pl) <= min(budget, ct_all(ids, pl)) + 1e-6
        assert bool((torch.sort(ids2, 1).values.diff(dim=1) > 0).all()), "experts must stay distinct"
        assert bool((w2 > 0).all())


def test_full_budget_leaves_routing_unchanged():
    E, K, P = 16, 2, 4
    logits, probs, ids, w = routing(1000, E, K, seed=1)
    pl = shuffled_placement(E, P, seed=1)
    for tr in transforms(P, logits) + transforms(P + 2, logits):
        ids2, w2 = tr(probs, ids, w, pl)
        assert torch.equal(ids2, ids) and torch.equal(w2, w), tr
    # budget >= min(K, P) suffices for max device scores and for similarity
    for tr in [ScorePruning(K, "max"), SimilarityPruning(K, expert_similarity(logits))]:
        ids2, w2 = tr(probs, ids, w, pl)
        assert torch.equal(ids2, ids) and torch.equal(w2, w), tr


def test_score_device_rule_by_hand():
    pl = Placement.contiguous(8, 4)       # devices {0,1} {2,3} {4,5} {6,7}
    probs = torch.tensor([[0.30, 0.00, 0.21, 0.19, 0.10, 0.10, 0.05, 0.05]])
    ids = torch.tensor([[0, 2]])
    w = probs.gather(1, ids)
    assert device_scores(probs, pl, "sum").tolist()[0] == pytest.approx([0.30, 0.40, 0.20, 0.10])
    # sum: device 1 wins (0.4), so experts 2 and 3; expert 0 is dropped and 3 takes its slot
    ids_sum, w_sum = ScorePruning(1, "sum")(probs, ids, w, pl)
    assert ids_sum.tolist() == [[3, 2]]
    assert w_sum.tolist()[0] == pytest.approx([0.19, 0.21])
    # max: device 0 wins (0.3), so experts 0 and 1
    ids_max, _ = ScorePruning(1, "max")(probs, ids, w, pl)
    assert ids_max.tolist() == [[0, 1]]
    # with budget 2 = K, sum ranks devices 1 and 0 and keeps the top-k; max does too
    assert ScorePruning(2, "sum")(probs, ids, w, pl)[0].tolist() == [[0, 2]]


def test_score_is_topk_within_allowed_devices():
    E, K, P = 16, 4, 4
    _, probs, ids, w = routing(500, E, K, seed=2)
    pl = shuffled_placement(E, P, seed=2)
    tr = ScorePruning(2)
    ids2, w2 = tr(probs, ids, w, pl)
    allowed_TE = tr.allowed_devices(probs, pl)[:, pl.device_E]
    expect = torch.topk(probs.masked_fill(~allowed_TE, -1), K, dim=1).indices
    assert torch.equal(torch.sort(ids2, 1).values, torch.sort(expect, 1).values)
    assert torch.allclose(w2, probs.gather(1, ids2))            # weight rule "own"


def test_similarity_by_hand():
    pl = Placement.contiguous(12, 3)      # devices {0..3} {4..7} {8..11}
    probs = torch.full((1, 12), 0.02)
    probs[0, [0, 4, 8]] = torch.tensor([0.40, 0.20, 0.10])
    ids = torch.tensor([[0, 4, 8]])
    w = probs.gather(1, ids)
    sim = torch.eye(12)
    sim[4, [1, 2, 3]] = torch.tensor([0.9, 0.8, 0.1])
    sim[8, [1, 2, 3]] = torch.tensor([0.95, 0.2, 0.7])
    sim[8, 5] = 0.99                                            # on a disallowed device
    sim = (sim + sim.t()) / 2
    tr = SimilarityPruning(1, sim)                              # device 0 holds most weight
    ids2, w2 = tr(probs, ids, w, pl)
    # slot 1 (expert 4) takes 1, its best; slot 2 (expert 8) would too, but 1 is used: 3
    assert ids2.tolist() == [[0, 1, 3]]
    assert w2.tolist()[0] == pytest.approx([0.40, 0.20, 0.10])   # "replaced": inherits
    _, w_own = SimilarityPruning(1, sim, "own")(probs, ids, w, pl)
    assert w_own.tolist()[0] == pytest.approx([0.40, 0.02, 0.02])
    _, w_ren = SimilarityPruning(1, sim, "renormalize")(probs, ids, w, pl)
    assert w_ren.tolist()[0] == pytest.approx([0.40 * 0.70 / 0.44, 0.02 * 0.70 / 0.44, 0.02 * 0.70 / 0.44])
    # budget 2: devices 0 and 1 allowed; expert 8 -> the most similar free expert there (5)
    ids3, _ = SimilarityPruning(2, sim)(probs, ids, w, pl)
    assert ids3.tolist() == [[0, 4, 5]]


def test_similarity_substitutes_are_most_similar_free_experts():
    E, K, P = 16, 4, 4
    logits, probs, ids, w = routing(800, E, K, seed=3)
    pl = shuffled_placement(E, P, seed=3)
    sim = expert_similarity(logits)
    tr = SimilarityPruning(1, sim)
    ids2, _ = tr(probs, ids, w, pl)
    allowed = tr.allowed_devices(probs, ids, pl)
    for t in range(0, 800, 37):
        dev_ok = allowed[t]
        free = [x for x in range(E) if dev_ok[pl.device_E[x]] and x not in ids[t].tolist()]
        for k in range(K):
            old, new = int(ids[t, k]), int(ids2[t, k])
            if dev_ok[pl.device_E[old]]:
                assert new == old
            else:
                best = max(free, key=lambda x: float(sim[old, x]))
                assert new == best
                free.remove(best)


def test_gradients_reach_the_router():
    E, K, P = 16, 4, 4
    logits, _, _, _ = routing(200, E, K, seed=4)
    pl = shuffled_placement(E, P, seed=4)
    for tr in transforms(1, logits):
        leaf = logits.clone().requires_grad_(True)
        probs = leaf.softmax(-1)
        top = torch.topk(probs, K, dim=1)
        _, w2 = tr(probs, top.indices, top.values, pl)
        (w2 * torch.arange(1.0, K + 1)).sum().backward()
        assert leaf.grad is not None and float(leaf.grad.abs().sum()) > 0, tr


def test_infeasible_budget_raises():
    _, probs, ids, w = routing(10, 8, 4)
    pl = Placement.contiguous(8, 4)                              # e = 2, K = 4
    assert min_budget(4, 2) == 2
    for tr in (ScorePruning(1), SimilarityPruning(1, torch.eye(8))):
        with pytest.raises(ValueError, match=r"system.budget=1 is infeasible.*minimum feasible budget is 2"):
            tr(probs, ids, w, pl)
    for bad in (0, -1, 1.5, "2", True):
        with pytest.raises(ValueError, match="system.budget="):
            check_budget(bad)
    check_budget(2, 4, 2)


def test_options_and_factory():
    with pytest.raises(ValueError, match=r"system.weight_rule='mean': allowed values are \['own', 'replaced'"):
        ScorePruning(1, weight_rule="mean")
    with pytest.raises(ValueError, match="system.device_score='avg'"):
        ScorePruning(1, device_score="avg")
    with pytest.raises(ValueError, match="system.pruning='random'"):
        make_pruning("random", 1)
    with pytest.raises(ValueError, match="needs similarity_EE"):
        make_pruning("similarity", 1)
    assert make_pruning("score", 2).weight_rule == "own"
    assert make_pruning("similarity", 2, similarity_EE=torch.eye(4)).weight_rule == "replaced"
    with pytest.raises(ValueError, match="square"):
        SimilarityPruning(1, torch.ones(3, 4))


def test_expert_similarity():
    base = torch.randn(50, 1)
    logits = torch.cat([base, 2 * base, -base, torch.randn(50, 1)], dim=1)
    sim = expert_similarity(logits)
    assert sim.shape == (4, 4)
    assert torch.allclose(torch.diagonal(sim), torch.ones(4), atol=1e-6)
    assert sim[0, 1] == pytest.approx(1.0, abs=1e-6)
    assert sim[0, 2] == pytest.approx(-1.0, abs=1e-6)
    assert torch.allclose(sim, sim.t())
    # centering removes a shared per-token shift
    shifted = torch.randn(50, 3) + 100 * torch.randn(50, 1)
    assert float(expert_similarity(shifted).min()) > 0.9
    assert float(expert_similarity(shifted, center=True).min()) < 0.9
