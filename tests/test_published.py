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
