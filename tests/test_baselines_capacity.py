"""Tutel's capacity scheme and MegaBlocks' block padding against hand computation.

Tutel: which pairs a small capacity drops (and that the output is the reference
MoE without exactly those pairs), equal splits of e*C rows per peer whatever
the load, padding = P*e*C - kept rows, and cf=0 exact. MegaBlocks: block
padding of the received rows, exact. One world (P=2) runs every case.
"""
import pytest
import torch

from occult.dist import launch
from occult.parity import LayerCase

from capacity_helpers import DROPPED, E, HAND, K, KEPT, P, calls_and_grid, expected, rel
from systems import system

TUTEL = "baselines.tutel_harness.TutelHarnessDispatcher"
MEGA = "baselines.megablocks.MegaBlocksDispatcher"
CALLS = {
    "cf0.5": (TUTEL, {"capacity_factor": 0.5}, HAND),
    "cf-0.5": (TUTEL, {"capacity_factor": -0.5}, HAND),   # capped dropless: min(5, 2) = 2, as cf=0.5
    "cf2": (TUTEL, {"capacity_factor": 2.0}, HAND),        # C = 2 * int(2 * 2) = 8: nothing dropped
    "cf0": (TUTEL, {"capacity_factor": 0}, HAND),          # dropless: C = 5 (rank 0, expert 0)
    "mega_b4": (MEGA, {"block_size": 4}, HAND),
}
GRID = [(system(TUTEL, capacity_factor=0), LayerCase(8, 3, (7, 0), routing="router", renormalize=True, seed=1), None),
        (system(TUTEL, capacity_factor=0), LayerCase(8, 4, (6, 6), routing="one_device", seed=2), None),
        (system(TUTEL, capacity_factor=3.0), LayerCase(8, 2, (5, 9), seed=3), None),
        (system(MEGA, block_size=4), LayerCase(8, 3, (7, 0), routing="router", renormalize=True, seed=1), None),
        (system(MEGA, block_size=3), LayerCase(8, 2, (5, 9), seed=3), None)]


@pytest.fixture(scope="module")
def world():
    per_rank = launch(calls_and_grid, P, (list(CALLS.values()), GRID), timeout_s=90)
    return {"calls": [{name: r["calls"][i] for i, name in enumerate(CALLS)} for r in per_rank],
            "grid": [r["grid"] for r in per_rank]}


def check_against(world, name, dropped):
    out, grad_x, grad_router = expected(dropped)
    for rank in range(P):
        res, lo = world["calls"][rank][name], sum(HAND.tokens[:rank])
        hi = lo + HAND.tokens[rank]
        assert rel(res["out"], out[lo:hi]) <= 1e-12, (name, rank)
        # gradients pass through the router's float32 softmax: float32 rounding
        assert rel(res["grad_x"], grad_x[lo:hi]) <= 1e-6, (name, rank)
        assert rel(res["grad_router"], grad_router) <= 1e-6, (name, rank)


@pytest.mark.timeout(120)
def test_small_capacity_drops_the_hand_computed_pairs(world):
    for name in ("cf0.5", "cf-0.5"):
        for rank in range(P):
            res = world["calls"][rank][name]
            assert res["stats"]["dropped_pairs"] == len(DROPPED[rank]), (name, rank)
            assert res["stats"]["padding_rows"] == P * 2 * 2 - KEPT[rank], (name, rank)
        check_against(world, name, DROPPED)
    # dropping changes the result: the full reference is not what cf=0.5 returns
    out_full = expected({})[0]
    assert rel(world["calls"][0]["cf0.5"]["out"], out_full[:8]) > 1e-3


@pytest.mark.timeout(120)
def test_equal_splits_and_padding(world):
    e = E // P
    for name, C in (("cf0.5", 2), ("cf-0.5", 2), ("cf2", 8), ("cf0", 5)):
        for rank in range(P):
            res = world["calls"][rank][name]
            for key in (("dispatch", "forward"), ("combine", "forward"),
                        ("dispatch", "backward"), ("combine", "backward")):
                assert res["rows"][key] == (e * C,) * P, (name, rank, key)   # whatever the load
            assert res["rows"][("counts", "forward")] == (1,) * P
            assert res["counts_e"] == [P * C] * e                         # experts see the padding too
            kept = KEPT[rank] if C == 2 else K * HAND.tokens[rank]
            assert res["stats"]["padding_rows"] == P * e * C - kept, (name, rank)


@pytest.mark.timeout(120)
def test_dropless_tutel_is_exact(world):
    for name in ("cf0", "cf2"):
        for rank in range(P):
            assert world["calls"][rank][name]["stats"]["dropped_pairs"] == 0
        check_against(world, name, {})
    for rank, per_rank in enumerate(world["grid"]):
        for (sys_, case, _), res in zip(GRID, per_rank):
            assert all(v <= 1e-9 for v in res["errors"].values()), (sys_, case, rank, res["errors"])


@pytest.mark.timeout(120)
def test_megablocks_block_padding(world):
    # received rows per local expert: rank 0 gets 5+3 for expert 0 and 4+1 for expert 1,
    # rank 1 gets 4+1 for expert 2 and 3+1 for expert 3; padded to multiples of 4
    for rank, counts, padding in ((0, [8, 8], 3), (1, [8, 4], 3)):
        res = world["calls"][rank]["mega_b4"]
        assert res["counts_e"] == counts
        assert res["stats"] == {"dropped_pairs": 0, "padding_rows": padding}
    # the padding is computed, never sent: one row per (token, expert), as naive EP
    assert world["calls"][0]["mega_b4"]["rows"][("dispatch", "forward")] == (9, 7)
    assert world["calls"][1]["mega_b4"]["rows"][("dispatch", "forward")] == (4, 2)
    check_against(world, "mega_b4", {})


def test_bad_options_name_the_field():
    from occult.ep import system_config
    bad = [(TUTEL, {"capacity_factor": "one"}, "system.capacity_factor"),      # typed: refused at merge
           (TUTEL, {"capacity_factor": float("nan")}, "system.capacity_factor"),
           (MEGA, {"block_size": -1}, "system.block_size"),
           (MEGA, {"block_size": 1.5}, "system.block_size")]
    for target, options, field in bad:
        with pytest.raises(ValueError, match=field):
            system_config(system(target, **options)).check(num_experts=4, top_k=2, world_size=1)


def test_megablocks_uses_the_library_only_where_it_can_run():
    """library=auto runs the harness scheme where megablocks does not import (this CPU) or
    EP > 1, and says so in impl; library=on is refused there with the reason."""
    import importlib.util

    from occult.ep import system_config
    auto = system_config(system(MEGA))
    assert auto.impl_for(4) == "harness"
    if importlib.util.find_spec("megablocks") is None or not torch.cuda.is_available():
        assert auto.impl_for(1) == "harness"
        with pytest.raises(ValueError, match="system.library=on: the megablocks library does not run here"):
            system_config(system(MEGA, library="on")).check(num_experts=4, top_k=2, world_size=1)
    with pytest.raises(ValueError, match=r"system.library='maybe': allowed values are \['auto', 'on', 'off'\]"):
        system_config(system(MEGA, library="maybe")).check(num_experts=4, top_k=2, world_size=1)
    assert system_config(system(MEGA, library="off")).impl_for(1) == "harness"
