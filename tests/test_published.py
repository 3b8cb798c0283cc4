"""Published GPU measurements (conf/published, analysis/published.py) and the cost model's
check against them (experiment=published_check)."""
from __future__ import annotations

import pytest

from analysis import published

# points per source: every row of each named table (a latency and a bandwidth of one run are
# one point), none excluded
POINTS = {"deepep": 20, "pplx_garden": 24, "uccl_ep": 14}


def test_every_published_point_is_in_the_table():
    points = published.load_points()
    assert points.groupby("source").size().to_dict() == POINTS
    assert published.exclusions() == []
    # DeepEP's low-latency table is the check: held out of every fit
    ll = points[(points.source == "deepep") & (points.table == "low_latency")]
    assert len(ll) == 12 and set(ll.role) == {"check"} and sorted(set(ll.ep)) == [8, 16, 32, 64, 128, 256]
    assert (points.latency_us.notna() | points.GBps.notna()).all()
    assert set(points.byte_rule) <= set(published.BYTE_RULES)


def test_a_malformed_source_is_one_line_naming_the_field(tmp_path):
    good = (published.PUBLISHED_DIR / "uccl_ep.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    bad.write_text(good.replace("transport: one_sided", "transport: sideways", 1))
    with pytest.raises(ValueError, match=r"transport='sideways': allowed values \['one_sided', 'two_sided'\]"):
        published.load_points([bad])
    bad.write_text(good.replace("phase: dispatch", "phase: dispatched", 1))
    with pytest.raises(ValueError, match=r"points\[0\]\.phase='dispatched'"):
        published.load_points([bad])


def test_a_static_buffers_valid_rows_are_its_dynamic_twins_rows():
    """task=simulate prices a one-sided transport on a static system's valid rows, taken from
    its dynamic twin's plan: they are the rows the static path itself marks valid."""
    import torch

    from occult.ep import system_config
    from occult.ep.comm import EPGroup
    from occult.ep.plan import RowShape, plan_world
    from occult.ep.static import pair_slots
    from occult.tasks.simulate import dynamic_twin, valid_world

    P, T, E, K = 4, 6, 8, 3
    static = system_config({"name": "naive", "_target_": "baselines.naive.NaiveDispatcher",
                            "dispatch_mode": "static"}).sized(T)
    assert dynamic_twin(system_config({"name": "naive", "_target_": "baselines.naive.NaiveDispatcher"})) is None
    ep = EPGroup(0, P, None, "cpu", 2)
    g = torch.Generator().manual_seed(0)
    ids = [torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) for _ in range(P)]
    routing = [(x, torch.full(x.shape, 1.0 / K)) for x in ids]
    shape = RowShape(16, 8, torch.float32)
    dispatcher = static.build(ep, 0, E)
    world = plan_world(dispatcher, routing, shape, training=False, backward=False)
    twin_world = plan_world(dynamic_twin(static).build(ep, 0, E), routing, shape, training=False, backward=False)
    valid = {c.phase: c for c in valid_world(world, twin_world)}
    assert set(valid) == {"dispatch", "combine"}
    for r in range(P):
        row_TK, _, S = pair_slots(ids[r], dispatcher.placement, T, r)
        marked_P = torch.bincount(row_TK.flatten() // S, minlength=P + 1)[:P]
        assert valid["dispatch"].rows_PP[r].tolist() == marked_P.tolist()
        assert valid["dispatch"].row_bytes == {c.phase: c for c in world}["dispatch"].row_bytes
    assert (valid["combine"].rows_PP == valid["dispatch"].rows_PP.T).all()
