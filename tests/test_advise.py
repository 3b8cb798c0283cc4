"""The advisor (analysis/advise.py) against measurement, and its bad input.

Fixtures (``tests/fixtures``, written by ``make_strategies_p4.py`` from measured sweeps):

* ``strategies_p4``: ``task=prefill`` of naive, occult, allgather and hierarchical on the
  trained OLMoE proxy at P = 4 (experiment=strategies' settings, 5 timed iterations), with
  the routing trace every one of them ran (the same prompts through the same routers);
* ``comm_p4``: ``task=layer`` of the same systems at P = 4 on ``bench_comm``, a comm-bound
  shape (D = 2048, F = 16: the exchange is most of the layer), uniform routing, forward only;
  the advisor simulates uniform routing of the same distribution and size (not the same draws).

The advisor, on this machine's measured loopback profile (``sim_cpu_loopback``), must order
every pair whose measured gap exceeds the fixture's spread (the samples' ranges do not
overlap) as the measurement does; there must be at least one such pair.
"""
from __future__ import annotations

from itertools import combinations
from pathlib import Path

import pandas as pd
import pytest

from analysis.advise import Request, advise, parse

FIXTURES = Path(__file__).resolve().parent / "fixtures"
STRATEGY = {"naive": "naive", "occult": "occult", "allgather": "allgather", "hierarchical": "hierarchical_device"}


def measured(name: str) -> pd.DataFrame:
    """Per strategy: the fixture's samples (ms) as min, median, max."""
    lat = pd.read_csv(FIXTURES / name / "latency.csv")
    lat["strategy"] = [STRATEGY[s] if s != "hierarchical" else f"hierarchical_{d or 'device'}"
                       for s, d in zip(lat.system, lat.dedup.fillna(""))]
    return lat.groupby("strategy").latency_ms.agg(["min", "median", "max"]), lat


def separated_pairs(stats: pd.DataFrame) -> list:
    """(faster, slower) for every pair whose sample ranges do not overlap."""
    out = []
    for a, b in combinations(stats.index, 2):
        if stats.loc[a, "max"] < stats.loc[b, "min"]:
            out.append((a, b))
        elif stats.loc[b, "max"] < stats.loc[a, "min"]:
            out.append((b, a))
    return out


@pytest.mark.slow    # 13 s; a measured P = 4 world
@pytest.mark.timeout(240)
def test_the_advisors_order_agrees_with_measurement_where_the_gap_exceeds_the_spread(tmp_path, capsys):
    checked = []
    for name, req in (
            ("strategies_p4", dict(model="olmoe_proxy", phase="prefill", trace=str(FIXTURES / "strategies_p4"),
                                   sample_layers=0)),
            ("comm_p4", dict(model="bench_comm", phase="prefill", routing="uniform", sample_layers=0))):
        stats, lat = measured(name)
        pairs = separated_pairs(stats)
        if not pairs:       # nothing to compare: no need to project this fixture
            continue
        tokens = int(lat.tokens_per_rank.iloc[0])
        # only the strategies of the compared pairs (each is projected on its own)
        systems = tuple(s for s in stats.index if any(s in pair for pair in pairs))
        table, notes = advise(Request(profile="sim_cpu_loopback", world_size=4, tokens_per_rank=tokens,
                                      systems=systems, out=str(tmp_path / name), **req))
        projected = table.set_index("strategy").moe_layer_ms
        for fast, slow in pairs:
            checked.append((name, fast, slow))
            assert projected[fast] < projected[slow], (name, fast, slow, projected.to_dict(), stats.to_dict())
        assert any("sim_cpu_loopback" in n and "measured" in n for n in notes)
    with capsys.disabled():
        print(f"\nadvisor vs measurement: {len(checked)} pair(s) compared: {checked}")
    assert checked, "no measured gap exceeds its spread: widen the fixture"


@pytest.mark.parametrize("argv, line", [
    (["profile=sim_h200_nodes"], "model= is required"),
    (["model=deepseek_v3", "profile=sim_h200_nodes", "phase=serve"], r"phase=serve: allowed values are \['decode'"),
    (["model=deepseek_v3", "profile=sim_h200_nodes", "systems=naive,magic"], "systems=naive,magic: allowed values"),
    (["model=deepseek_v3", "profile=sim_h200_nodes", "speed=fast"], "'speed=fast': arguments are key=value"),
])
def test_the_advisor_refuses_bad_input_in_one_line(argv, line):
    with pytest.raises(ValueError, match=line) as err:
        parse(argv)
    assert "\n" not in str(err.value)


def test_the_advisor_picks_the_largest_world_that_divides_the_experts():
    from analysis.advise import world_size_of
    assert world_size_of(Request(model="kimi_k2", profile="sim_h200_nodes"), 384) == 128
    assert world_size_of(Request(model="deepseek_v3", profile="sim_h200_nodes"), 256) == 256
    with pytest.raises(ValueError, match="none divides model's 60 experts"):
        world_size_of(Request(model="qwen_moe", profile="sim_h200_nodes"), 60)


def test_the_advisors_candidates_are_the_registered_systems_it_can_simulate(tmp_path):
    """Every registered exact expert-parallel system with a traffic plan (the scale study's
    seven among them), none without a plan, a lossy one or one that needs its own model; a
    system whose schedule a cost rule decides is simulated with the advised profile."""
    from analysis.advise import candidates, point_overrides
    found = candidates()
    assert {"naive", "occult", "occult_placed", "hierarchical_node", "hierarchical_device", "allgather",
            "tutel"} <= set(found)
    assert not {"hierarchical", "lsh", "luffy", "reference", "scmoe", "occult_prune_score", "adaptive_topk"} & set(found)
    assert parse(["model=m", "profile=p"]).systems == found
    assert point_overrides("shadow", tmp_path, "sim_h200_nodes") == ["system=shadow", "system.profile=sim_h200_nodes"]
    assert point_overrides("hierarchical_node", tmp_path, "sim_h200_nodes") == ["system=hierarchical",
                                                                                "system.dedup=node"]
    assert point_overrides("occult_placed", tmp_path, "x") == ["system=occult_placed",
                                                               f"system.placement_file={tmp_path / 'placements.json'}"]
