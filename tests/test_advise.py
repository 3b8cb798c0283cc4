"""The advisor (analysis/advise.py) against measurement, and its bad input.

Fixtures (``tests/fixtures``), re-measured by one command,
``python tests/fixtures/make_strategies_p4.py`` (``--only NAME`` for one; its docstring says why
each shape), each at one clean commit, 12 timed samples per system:

* ``comm_p4``: ``task=layer``, forward only, of naive, occult and hierarchical (dedup=device)
  on ``bench_comm_k32`` (E=64, K=32, D=1024, F=16), 384 tokens per rank, uniform routing, P = 4
  loopback gloo ranks as 2 nodes x 2; a sample is the median of 5 consecutive forwards;
* ``strategies_p4``: ``task=prefill`` of naive, occult, allgather and hierarchical on the
  trained OLMoE proxy at P = 4, with the routing trace every one of them ran.

The check (default run): on ``comm_p4`` each fixed pair (:data:`PAIRS`: occult / naive,
hierarchical_device / naive, occult / hierarchical_device) must separate (the two systems'
sample ranges are disjoint) and the advisor, simulating the same layer, routing distribution
(not the same draws) and node layout on this machine's measured loopback profile
(``sim_cpu_loopback``), must order it as measured. A pair that does not separate fails.
"""
from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import pytest

from analysis.advise import Request, advise, parse

FIXTURES = Path(__file__).resolve().parent / "fixtures"
_spec = importlib.util.spec_from_file_location("make_strategies_p4", FIXTURES / "make_strategies_p4.py")
FIX = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(FIX)
PAIRS = FIX.PAIRS


def advised(tmp_path: Path, systems, world_size: int = 4, **req) -> tuple[dict, list]:
    """Projected MoE-layer ms per strategy on sim_cpu_loopback at P = ``world_size``, and what
    they rest on; each strategy simulated in its own process, all at once."""
    def one(s):
        return advise(Request(profile="sim_cpu_loopback", world_size=world_size, systems=(s,), out=str(tmp_path / s),
                              **req))
    with ThreadPoolExecutor(len(systems)) as pool:
        done = list(pool.map(one, systems))
    return {t.strategy.iloc[0]: float(t.moe_layer_ms.iloc[0]) for t, _ in done}, done[0][1]


def explained(problems: list, st: pd.DataFrame, projected: dict) -> str:
    """A failure's message: what failed, the fixture's samples and the projections."""
    return "\n".join(problems + ["measured (ms):", st.round(1).to_string(),
                                 f"projected on sim_cpu_loopback (ms): {projected}"])


def test_the_comm_fixture_was_measured_at_one_clean_commit_with_ten_samples_a_system():
    lat = pd.read_csv(FIXTURES / "comm_p4" / "latency.csv")
    st = FIX.stats(lat)
    assert set(st.index) == {s for pair in PAIRS for s in pair} and (st["count"] >= 10).all(), st
    commits = lat.git_commit.unique()
    assert len(commits) == 1 and not commits[0].endswith("+dirty"), f"re-measure at one clean commit: {commits}"


@pytest.mark.timeout(240)
def test_the_advisor_orders_the_three_comm_bound_pairs_as_measured(tmp_path):
    """Each fixed pair must separate in the committed fixture and be ordered by the advisor as
    measured: a pair that does not separate fails (nothing is ordered), so does a pair ordered
    against the measurement."""
    lat = pd.read_csv(FIXTURES / "comm_p4" / "latency.csv")
    st = FIX.stats(lat)
    apart = FIX.failures(st, {}, [(a, b) for a, b in PAIRS if FIX.separation(st, a, b) <= 1])
    assert not apart, explained(apart + ["re-measure: python tests/fixtures/make_strategies_p4.py --only comm_p4"],
                                st, {})
    first = lat.iloc[0]
    systems = sorted({s for pair in PAIRS for s in pair})
    projected, notes = advised(tmp_path, systems, model=first.model, phase="prefill", routing="uniform",
                               sample_layers=0, tokens_per_rank=int(first.tokens_per_rank),
                               world_size=int(first.world_size), devices_per_node=int(first.devices_per_node))
    assert any("sim_cpu_loopback" in n and "measured" in n for n in notes), notes
    problems = FIX.failures(st, projected)
    assert not problems, explained(problems, st, projected)


def test_the_pair_check_fails_on_overlapping_samples_and_on_an_order_against_measurement():
    def samples(**ms):
        return FIX.stats(pd.DataFrame([{"system": s, "dedup": "", "latency_ms": v}
                                       for s, vs in ms.items() for v in vs]))
    apart = samples(occult=[10, 11, 12], naive=[20, 21, 25])
    assert FIX.separation(apart, "occult", "naive") == pytest.approx(20 / 12)
    assert FIX.failures(apart, {"occult": 1.0, "naive": 2.0}, [("occult", "naive")]) == []
    reversed_ = FIX.failures(apart, {"occult": 3.0, "naive": 2.0}, [("occult", "naive")])
    assert len(reversed_) == 1 and "occult measured faster than naive" in reversed_[0]
    assert FIX.failures(apart, {"occult": 2.0, "naive": 2.0}, [("naive", "occult")])    # a tie orders nothing
    touching = samples(occult=[10, 11, 20], naive=[20, 21, 25])
    overlap = FIX.failures(touching, {"occult": 1.0, "naive": 2.0}, [("occult", "naive")])
    assert len(overlap) == 1 and "do not separate" in overlap[0]


@pytest.mark.slow    # about 20 s: four simulated P = 4 worlds of the OLMoE proxy
@pytest.mark.timeout(300)
def test_the_advisor_orders_the_olmoe_pairs_that_separate_as_measured(tmp_path, capsys):
    """On ``strategies_p4`` (the OLMoE proxy's prefill, one node) the systems are close: every
    pair whose samples separate is compared, and none separating fails (nothing is checked)."""
    lat = pd.read_csv(FIXTURES / "strategies_p4" / "latency.csv")
    st = FIX.stats(lat)
    pairs = [(a, b) for i, a in enumerate(st.index) for b in st.index[i + 1:] if FIX.separation(st, a, b) > 1]
    assert pairs, explained(["no pair of the OLMoE fixture separates: nothing to compare"], st, {})
    systems = sorted({s for pair in pairs for s in pair})
    projected, _ = advised(tmp_path, systems, model="olmoe_proxy", phase="prefill", sample_layers=0,
                           trace=str(FIXTURES / "strategies_p4"), tokens_per_rank=int(lat.tokens_per_rank.iloc[0]))
    problems = FIX.failures(st, projected, pairs)
    assert not problems, explained(problems, st, projected)
    with capsys.disabled():
        print(f"\nadvisor vs the OLMoE fixture: {len(pairs)} pair(s) compared: {pairs}")


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
