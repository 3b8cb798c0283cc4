"""The neutral core on one process: placements, routing metrics, permutations, reference."""
import math

import pytest
import torch

from occult.ep import Placement, ct_all, ct_bounds, ct_remote, devices_per_token, intra_ratio, reference_moe, swiglu
from occult.ep.experts import grouped_swiglu, init_expert_weights
from occult.ep.permute import expert_major_order, inverse_permutation, sort_pairs_by_destination
from occult.synthetic import expert_popularity, sample_topk


def test_contiguous_placement():
    pl = Placement.contiguous(8, 4)
    assert pl.device_E.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert pl.slot_E.tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    assert pl.local_experts(2).tolist() == [4, 5]
    assert pl.groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_placement_from_groups_and_errors():
    pl = Placement.from_groups([[3, 0], [1, 2]])
    assert pl.local_experts(0).tolist() == [3, 0]
    assert pl.global_order().tolist() == [3, 0, 1, 2]
    with pytest.raises(ValueError, match="cover every expert"):
        Placement.from_groups([[0, 1], [1, 2]])
    with pytest.raises(ValueError, match="equal groups"):
        Placement.contiguous(6, 4)
    with pytest.raises(ValueError, match="must host"):
        Placement.from_groups([[0, 1, 2], [3]])


def test_routing_metrics_by_hand():
    pl = Placement.contiguous(4, 2)              # experts 0,1 on device 0; 2,3 on device 1
    ids = torch.tensor([[0, 1], [0, 2], [3, 2]])
    assert devices_per_token(ids, pl).tolist() == [1, 2, 1]
    assert ct_all(ids, pl) == pytest.approx(4 / 3)
    home = torch.tensor([0, 0, 1])
    assert ct_remote(ids, pl, home) == pytest.approx(1 / 3)     # only token 1 leaves home
    assert intra_ratio(ids, pl) == pytest.approx(2 / 3)         # pairs (0,1), (3,2) intra; (0,2) inter
    assert ct_bounds(64, 8, 4) == (1, 4)
    assert ct_bounds(8, 2, 8) == (2, 2)


def test_uniform_ct_matches_expectation():
    E, K, P = 64, 8, 4
    ids = sample_topk(20000, K, expert_popularity("uniform", E), torch.Generator().manual_seed(0))
    assert all(len(set(r)) == K for r in ids.tolist()[:100])
    expected = P * (1 - math.comb(E - E // P, K) / math.comb(E, K))
    assert expected == pytest.approx(3.659, abs=1e-3)
    assert ct_all(ids, Placement.contiguous(E, P)) == pytest.approx(expected, rel=0.01)


def test_zipf_is_skewed():
    ids = sample_topk(5000, 2, expert_popularity("zipf", 16, 1.2), torch.Generator().manual_seed(1))
    counts = torch.bincount(ids.flatten(), minlength=16)
    assert counts[0] > 3 * counts[-1]


def test_sort_pairs_and_regroup():
    pl = Placement.contiguous(4, 2)
    ids = torch.tensor([[2, 0], [1, 3], [0, 2]])
    order, send_Pe = sort_pairs_by_destination(ids, pl)
    assert send_Pe.tolist() == [[2, 1], [2, 1]]
    keys = (pl.device_E[ids] * 2 + pl.slot_E[ids]).flatten()[order]
    assert keys.tolist() == sorted(keys.tolist())
    recv_Pe = torch.tensor([[1, 2], [3, 0]])        # rows from rank0: s0,s1,s1; rank1: s0,s0,s0
    perm = expert_major_order(recv_Pe)
    assert perm.tolist() == [0, 3, 4, 5, 1, 2]
    assert perm[inverse_permutation(perm)].tolist() == list(range(6))


def test_grouped_swiglu_matches_per_expert():
    g = torch.Generator().manual_seed(0)
    w = init_expert_weights(3, 8, 4, g, torch.float64)
    x = torch.randn(7, 8, generator=g, dtype=torch.float64)
    counts = torch.tensor([2, 0, 5])
    y = grouped_swiglu(x, counts, w["w_gate"], w["w_up"], w["w_down"])
    assert torch.allclose(y[:2], swiglu(x[:2], w["w_gate"][0], w["w_up"][0], w["w_down"][0]))
    assert torch.allclose(y[2:], swiglu(x[2:], w["w_gate"][2], w["w_up"][2], w["w_down"][2]))


def test_reference_moe_is_dense_mixture():
    g = torch.Generator().manual_seed(0)
    E, K, D = 4, 2, 6
    w = init_expert_weights(E, D, 3, g, torch.float64)
    x = torch.randn(5, D, generator=g, dtype=torch.float64)
    ids = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2], [0, 3]])
    wt = torch.rand(5, K, generator=g, dtype=torch.float64)
    out = reference_moe(x, ids, wt, w)
    for t in range(5):
        expect = sum(wt[t, k] * swiglu(x[t:t + 1], w["w_gate"][ids[t, k]], w["w_up"][ids[t, k]],
                                         w["w_down"][ids[t, k]]) for k in range(K))
        assert torch.allclose(out[t:t + 1], expect)


def test_backward_span_times_the_blocks_backward_only():
    """backward_span: from the output's gradient to the last input's, once per backward;
    nothing without a recorder or a gradient."""
    import time
    from dataclasses import dataclass
    from occult.ep.accounting import Recorder, backward_span

    class SlowBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            return a * b

        @staticmethod
        def backward(ctx, g):
            time.sleep(0.05)
            return g, g

    @dataclass(frozen=True)
    class Rows:
        a: torch.Tensor
        index: torch.Tensor           # no gradient: not waited for

    rec = Recorder(rank=0)
    a, b = torch.ones(3, requires_grad=True), torch.ones(3, requires_grad=True)
    pre = a * 2                                            # before the block
    out = SlowBackward.apply(pre, b)
    backward_span(rec, 1, "experts", Rows(pre, torch.arange(3)), out)
    assert rec.spans == []                                 # the forward logs nothing
    time.sleep(0.1)                                        # not part of the backward
    (out * 3).sum().backward()
    ((layer, name, direction, seconds),) = rec.spans
    assert (layer, name, direction) == (1, "experts", "backward") and 0.05 <= seconds < 0.1
    with torch.no_grad():
        backward_span(rec, 1, "experts", a, a * 2)         # no gradient: no hooks, no span
    backward_span(None, 1, "experts", a, a * 2)
    assert len(rec.spans) == 1
