"""system=tutel: the tutel library's routing, encode, all-to-all and decode, driven with the
harness's routing and experts. Against hand computation (which pairs a capacity drops,
the capacity the overlap degree aligns to, e*C rows per peer, Tutel's routing
all-reduces), against the harness's own implementation of the scheme (tutel_harness:
the same capacity, counters and rows), whole models against the single-device model,
and a run whose rows say impl=library. Tutel is a tested dependency (`make venv`
installs it): these tests are not skipped when it is missing, they fail.

Tutel encodes and decodes in float32, so results are compared at float32's tolerance.
The exact (dropless) system is also in the parity suite (tests/test_parity.py).
"""
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from occult.dist import RankFailed, launch
from occult.ep import EPGroup, Placement, system_config
from occult.parity import run_model_grid

from capacity_helpers import DROPPED, E, HAND, K, KEPT, P, calls_and_grid, expected, rel
from systems import system
from test_models import PROXIES, tiny

ROOT = Path(__file__).resolve().parent.parent
# the sweep's report (tested where it is read) left out of sweeps that do not read it: 3 s each
NO_REPORT = "~hydra.callbacks.sweep_report"
TUTEL = "baselines.tutel.TutelDispatcher"
HARNESS = "baselines.tutel_harness.TutelHarnessDispatcher"
FP32 = 1e-5      # float32 encode / decode against the float64 reference
e = E // P
# name -> (options, C by hand, dropped pairs by hand); HAND's queues are in capacity_helpers
CASES = {
    "cf0.5": ({"capacity_factor": 0.5}, 2, DROPPED),      # C = K * int(0.5 * ceil(8 / 4)) = 2
    "cf-0.5": ({"capacity_factor": -0.5}, 2, DROPPED),    # capped dropless: min(5, 2) = 2
    "cf2": ({"capacity_factor": 2.0}, 8, {}),              # C = 2 * int(2 * 2) = 8
    "cf0": ({"capacity_factor": 0}, 5, {}),                # dropless: rank 0 sends expert 0 five pairs
    # the overlap degree rounds C up to a multiple of it: 5 -> 8, and 2 -> 4, where only
    # rank 0's fifth pair for expert 0, (token 4, k=1), is beyond capacity
    "cf0_d4": ({"capacity_factor": 0, "a2a_ffn_overlap_degree": 4}, 8, {}),
    "cf0.5_d4": ({"capacity_factor": 0.5, "a2a_ffn_overlap_degree": 4}, 4, {0: {(4, 1)}}),
}
HARNESS_TWINS = ("cf0.5", "cf-0.5", "cf2", "cf0")    # the harness has no overlap degree
CALLS = [(TUTEL, opts, HAND) for opts, _, _ in CASES.values()] + \
        [(HARNESS, CASES[name][0], HAND) for name in HARNESS_TWINS]


@pytest.fixture(scope="module")
def world():
    per_rank = launch(calls_and_grid, P, (CALLS, []), timeout_s=120)
    n = len(CASES)
    return [{"lib": dict(zip(CASES, r["calls"][:n])), "harness": dict(zip(HARNESS_TWINS, r["calls"][n:]))}
            for r in per_rank]


def kept(dropped: dict, rank: int) -> int:
    return K * HAND.tokens[rank] - len(dropped.get(rank, ()))


@pytest.mark.timeout(180)
def test_capacity_drops_and_padding_by_hand(world):
    for name, (_, C, dropped) in CASES.items():
        out, grad_x, grad_router = expected(dropped)
        for rank in range(P):
            res, lo = world[rank]["lib"][name], sum(HAND.tokens[:rank])
            hi = lo + HAND.tokens[rank]
            assert res["stats"] == {"dropped_pairs": len(dropped.get(rank, ())),
                                    "padding_rows": P * e * C - kept(dropped, rank)}, (name, rank)
            assert res["counts_e"] == [P * C] * e, (name, rank)      # the experts see the padding
            assert rel(res["out"], out[lo:hi]) <= FP32, (name, rank)
            assert rel(res["grad_x"], grad_x[lo:hi]) <= FP32, (name, rank)
            assert rel(res["grad_router"], grad_router) <= FP32, (name, rank)
    assert KEPT == {r: kept(DROPPED, r) for r in range(P)}
    # dropping changes the result: the full reference is not what cf=0.5 returns
    assert rel(world[0]["lib"]["cf0.5"]["out"], expected({})[0][:8]) > 1e-3


@pytest.mark.timeout(180)
def test_rows_per_peer_are_the_equal_split_and_routing_all_reduces_are_logged(world):
    for name, (opts, C, _) in CASES.items():
        for rank in range(P):
            comm = world[rank]["lib"][name]["comm"]
            for key in (("dispatch", "forward"), ("combine", "forward"),
                        ("dispatch", "backward"), ("combine", "backward")):
                events = [(rows, nbytes) for phase, direction, rows, nbytes in comm if (phase, direction) == key]
                # e*C rows to every peer, whatever the load; D values in the input's dtype
                # (float64 here: Tutel encodes in float32 and hands the buffer back cast)
                assert events == [((e * C,) * P, HAND.hidden * 8)], (name, rank, key, events)
            counts = [(rows, nbytes) for phase, _, rows, nbytes in comm if phase == "counts"]
            # Tutel all-reduces the most tokens on any rank; for cf <= 0 also the largest load
            assert counts == [((1,) * P, 8)] * (1 if opts["capacity_factor"] > 0 else 2), (name, rank, counts)


@pytest.mark.timeout(180)
def test_library_and_harness_implementation_agree(world):
    for name in HARNESS_TWINS:
        for rank in range(P):
            lib, own = world[rank]["lib"][name], world[rank]["harness"][name]
            assert lib["stats"] == own["stats"] and lib["counts_e"] == own["counts_e"], (name, rank)
            for key in (("dispatch", "forward"), ("combine", "backward")):
                assert lib["rows"][key] == own["rows"][key], (name, rank, key)
            for quantity in ("out", "grad_x", "grad_router"):
                assert rel(lib[quantity], own[quantity]) <= FP32, (name, rank, quantity)


@pytest.mark.timeout(120)
def test_a_capacity_of_zero_is_a_clear_error():
    # cf = 0.1 on HAND: C = K * int(0.1 * ceil(8 / 4)) = 0, which Tutel's all-to-all cannot move
    with pytest.raises(RankFailed, match="system.capacity_factor=0.1: Tutel's capacity"):
        launch(calls_and_grid, P, ([(TUTEL, {"capacity_factor": 0.1}, HAND)], []), timeout_s=60)


@pytest.mark.timeout(300)
def test_models_match_single_device():
    """The paper's proxies (float32, tiny widths) through Tutel at P=2."""
    tutel = {"name": "tutel", "_target_": TUTEL}
    jobs = [({"model": tiny(n), "system": tutel, "seed": 1}, 2, 8) for n in PROXIES]
    per_rank = launch(run_model_grid, 2, (jobs,), timeout_s=240)
    for rank, results in enumerate(per_rank):
        for (cfg, _, _), res in zip(jobs, results):
            bad = {k: v for k, v in res["errors"].items() if not v < 2e-5}
            assert not bad, (rank, cfg["model"]["name"], bad)
            assert res["sent_rows"][("dispatch", "forward")] > 0


def test_options_and_placement_are_checked():
    def config(**options):
        return system_config(system(TUTEL, "tutel", **options))

    assert config().is_exact() and config(a2a_ffn_overlap_degree=4).is_exact()
    assert not config(capacity_factor=1.0).is_exact() and not config(capacity_factor=-1.0).is_exact()
    assert config().impl == "library" and config().precision == "float32"
    for options, field in (({"capacity_factor": float("inf")}, "system.capacity_factor"),
                           ({"a2a_ffn_overlap_degree": 0}, "system.a2a_ffn_overlap_degree"),
                           ({"a2a_ffn_overlap_degree": 33}, "system.a2a_ffn_overlap_degree"),
                           ({"a2a_ffn_overlap_degree": "two"}, "system.a2a_ffn_overlap_degree")):
        with pytest.raises(ValueError, match=field):
            config(**options).check(num_experts=4, top_k=2, world_size=2)
    with pytest.raises(ValueError, match="contiguous placement"):
        config().build(EPGroup(rank=0, world_size=2), 0, 4, Placement.from_groups([[1, 0], [2, 3]]))


@pytest.mark.slow    # 13 s; Tutel's parity and model tests stay in the default run
@pytest.mark.timeout(500)
def test_prefill_runs_write_library_rows_with_padding_and_drops(tmp_path):
    """Dropless (checked against the reference before timing) and with a capacity that drops."""
    sweep = tmp_path / "sweep"
    tiny_model = ["model.init=random", "model.hidden_size=32", "model.expert_ffn_size=16", "model.num_layers=2",
                  "task.batch_size=2", "task.seq_len=16", "task.warmup=0", "task.iters=1"]
    proc = subprocess.run([sys.executable, "run.py", "-m", "system=tutel", "model=olmoe_proxy", "task=prefill",
                           "cluster=cpu2", "system.capacity_factor=0,1.0", *tiny_model, f"hydra.sweep.dir={sweep}",
                           NO_REPORT],
                          cwd=ROOT, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {json.loads(df.system_options.iloc[0])["capacity_factor"]: df
            for df in map(pd.read_parquet, sweep.rglob("results.parquet"))}
    assert set(runs) == {0.0, 1.0}
    for cf, df in runs.items():
        assert set(df.impl) == {"library"} and set(df.system) == {"tutel"}
        assert {"padding_rows", "dropped_pairs", "rows", "bytes", "ct_all", "ttft"} <= set(df.metric)
        assert df[df.metric == "padding_rows"].value.sum() > 0
        dispatch = df[(df.metric == "rows") & (df.phase == "dispatch") & (df["pass"] == "forward")]
        # the equal split: per layer, the same rows from every rank to every peer
        assert (dispatch.groupby("layer").value.nunique() == 1).all() and (dispatch.value > 0).all()
    dropless, dropping = runs[0.0], runs[1.0]
    # the dropless run passed the parity gate (at float32's tolerance) before it was timed
    assert set(dropless[dropless.metric == "parity_checked"].value) == {1.0}
    errors = dropless[dropless.metric.str.startswith("parity_") & (dropless.metric != "parity_checked")]
    assert len(errors) and errors.value.max() < 1e-5
    assert dropless[dropless.metric == "dropped_pairs"].value.sum() == 0
    # cf = 1 drops (routing is never perfectly balanced); not top-k MoE, so gated dropless
    assert dropping[dropping.metric == "dropped_pairs"].value.sum() > 0
    assert set(dropping[dropping.metric == "parity_checked"].value) == {1.0}
    assert set(dropping[dropping.metric == "loss_off_parity"].value) == {1.0}
