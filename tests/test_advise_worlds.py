"""World size as an answer (issue 41, items 3 and 4): the advisor's and the scale study's
best (P, strategy) per GPU under a latency bound with the memory fit, the node layouts kept
apart, and why two profiles agree, from their fields. Small synthetic tables only: no run."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from analysis.advise import Request, parse, progress_line, sweep_params, world_sizes_of
from analysis.figures.scale_study import (agreement_text, best_per_gpu, contrast_text, crossovers, domain_table,
                                          field_roles, memory_GB, moe_layers, pairs_priced_alike, per_gpu,
                                          with_projection)
from occult.config import read_conf
from occult.ep.profiles import PROFILE_DIR

V3 = read_conf("model", "deepseek_v3")        # 256 experts, D 7168, F 2048, 58 MoE layers


def points(rows) -> pd.DataFrame:
    """A point table (:func:`analysis.figures.scale_study.point_table`'s columns that matter):
    rows of (run_id, model, workload, devices_per_node, P, strategy, tokens per rank, world tokens)."""
    cols = ["run_id", "model", "workload", "devices_per_node", "world_size", "strategy", "tokens_per_rank",
            "world_tokens"]
    t = pd.DataFrame(rows, columns=cols)
    t["dispatch_rows_max"] = 1000.0
    return t


def proj(rows) -> pd.DataFrame:
    """A :func:`analysis.figures.scale_study.projected` table: (run_id, profile, a2a ms, experts ms)."""
    p = pd.DataFrame(rows, columns=["run_id", "profile", "a2a_ms", "experts_ms"])
    p["moe_layer_ms"] = p.a2a_ms + p.experts_ms
    return p


def test_memory_per_gpu_is_every_moe_layers_experts_plus_the_largest_dispatch_buffer():
    assert moe_layers(V3) == 58
    weights = 256 / 16 * 3 * 7168 * 2048 * 58 * 2 / 1e9     # 16 experts a GPU, bf16
    assert memory_GB(V3, 16, 2, 0.0) == pytest.approx(weights)
    assert memory_GB(V3, 16, 2, 1000.0) == pytest.approx(weights + 1000 * 7168 * 2 / 1e9)
    assert 80 < memory_GB(V3, 16, 2, 1000.0) < 141          # fits an H200 (141 GB), not an H100 (80 GB)


def test_the_best_pair_per_gpu_is_the_most_tokens_per_second_within_the_bound_that_fits():
    # weak scaling (128 tokens a rank): P = 16 is fastest but holds 82 GB a GPU; P = 32, b is next
    pts = points([(f"{s}{P}", "deepseek_v3", "decode", 8, P, s, 128, 128 * P) for P in (16, 32, 64) for s in "ab"])
    ms = {("a", 16): 0.5, ("b", 16): 0.4, ("a", 32): 0.7, ("b", 32): 0.6, ("a", 64): 0.9, ("b", 64): 1.0}
    pr = proj([(f"{s}{P}", prof, v, 0.0) for (s, P), v in ms.items() for prof in ("sim_h100_nodes", "sim_h200_nodes")])
    gpu = per_gpu(pts, pr, latency_ms={"decode": 0.65 * 58})
    row = gpu[(gpu.run_id == "b32") & (gpu.profile == "sim_h100_nodes")].iloc[0]
    assert row.step_ms == pytest.approx(0.6 * 58)
    assert row.tokens_per_s_per_GPU == pytest.approx(128 / (0.6 * 58) * 1e3)
    best = best_per_gpu(gpu).set_index("profile")
    assert (best.loc["sim_h200_nodes", "P"], best.loc["sim_h200_nodes", "strategy"]) == (16, "b")
    assert (best.loc["sim_h100_nodes", "P"], best.loc["sim_h100_nodes", "strategy"]) == (32, "b")   # P = 16 does not fit
    assert best.loc["sim_h100_nodes", "do not fit"] == 2 and best.loc["sim_h100_nodes", "over the bound"] == 3
    # a bound nothing meets, and a bound only the points that do not fit meet: said, not guessed
    none = best_per_gpu(per_gpu(pts, pr, latency_ms=0.3 * 58)).set_index("profile")
    assert none.loc["sim_h200_nodes", "answer"].startswith("none within the bound: the fastest step takes 23.2 ms")
    only_big = best_per_gpu(per_gpu(pts, pr, latency_ms=0.55 * 58)).set_index("profile").loc["sim_h100_nodes"]
    assert only_big.P == "-" and "within the bound do not fit" in only_big.answer


def test_strong_scaling_counts_a_ranks_share_of_the_worlds_tokens():
    pts = points([(f"p{P}", "deepseek_v3", "prefill_strong", 8, P, "a", 4096, 65536) for P in (16, 64)])
    pr = proj([("p16", "sim_h200_nodes", 10.0, 10.0), ("p64", "sim_h200_nodes", 4.0, 2.0)])
    gpu = per_gpu(pts, pr).set_index("run_id")
    assert gpu.loc["p16", "tokens_per_s_per_GPU"] == pytest.approx(4096 / (20.0 * 58) * 1e3)
    assert gpu.loc["p64", "tokens_per_s_per_GPU"] == pytest.approx(1024 / (6.0 * 58) * 1e3)
    assert gpu.within_bound.all()          # no bound given: every point is within it
    assert best_per_gpu(gpu.reset_index()).iloc[0].P == 16


def test_two_layouts_at_one_p_stay_apart():
    """Nodes of 8 and one NVLink domain at P = 16 and 32: `vs naive` within a layout, each
    profile's crossovers from its own layout's points, the layouts side by side."""
    rows, pr = [], []
    for P in (16, 32):
        for n, prof, ms in ((8, "sim_h200_nodes", {"naive": 2.0, "occult": 1.5, "hierarchical_device": 1.0}),
                            (P, "sim_gb200_nvl72", {"naive": 0.5, "occult": 0.25, "hierarchical_device": 0.4})):
            for s, v in ms.items():
                rows.append((f"{s}-{n}-{P}", "olmoe", "decode", n, P, s, 128, 128 * P))
                pr.append((f"{s}-{n}-{P}", prof, v, 0.0))
    profiles = ["sim_h200_nodes", "sim_gb200_nvl72"]
    table = with_projection(points(rows), proj(pr), profiles)
    occ = table[table.strategy == "occult"].set_index(["devices_per_node", "world_size"])
    assert occ.loc[(8, 16), "sim_h200_nodes vs naive"] == pytest.approx(0.75)
    assert occ.loc[(16, 16), "sim_gb200_nvl72 vs naive"] == pytest.approx(0.5)
    assert np.isnan(occ.loc[(16, 16), "sim_h200_nodes vs naive"])
    cross = crossovers(table, profiles).set_index("profile")
    assert cross.loc["sim_h200_nodes", "best by P"] == "16: hierarchical_device, 32: hierarchical_device"
    assert cross.loc["sim_gb200_nvl72", "best by P"] == "16: occult, 32: occult"
    assert (cross.loc["sim_h200_nodes", "layout"], cross.loc["sim_gb200_nvl72", "layout"]) == ("nodes of 8", "one node")
    dom = domain_table(table, profiles)
    assert list(dom.moves) == ["yes", "yes"]
    assert dom.iloc[0]["sim_gb200_nvl72 best"].startswith("occult (0.25 ms, one node)")


def edited_profile(tmp_path: Path, base: str, **fields) -> str:
    """A copy of profile ``base`` with ``fields`` changed, as a YAML path."""
    conf = OmegaConf.load(PROFILE_DIR / f"{base}.yaml")
    for k, v in fields.items():
        conf[k] = v
    path = tmp_path / f"{base}_edited.yaml"
    OmegaConf.save(conf, path)
    return str(path)


def test_why_h100_and_h200_agree_is_read_from_their_fields(tmp_path):
    roles = field_roles("sim_h100_nodes", "sim_h200_nodes")
    assert roles["memory_GBps"][2] == ["experts"] and roles["memory_GB"][2] == ["memory fit"]
    assert not {r for _, _, rs in roles.values() for r in rs} & {"collectives", "world sizes covered"}
    text = contrast_text("sim_h100_nodes", "sim_h200_nodes")
    assert "`memory_GBps` (2680.0 vs 3840.0: experts)" in text and "Equal: the links that price every collective" in text
    # change one link of the H200 and the text says so; the pair is no longer priced alike
    faster = edited_profile(tmp_path, "sim_h200_nodes", intra_node_GBps=900.0)
    assert field_roles("sim_h100_nodes", faster)["intra_node_GBps"] == (450.0, 900.0, ["collectives"])
    assert "the links that price every collective" not in contrast_text("sim_h100_nodes", faster)
    assert pairs_priced_alike(["sim_h100_nodes", "sim_h200_nodes", faster, "sim_gb200_nvl72"]) == \
        [("sim_h100_nodes", "sim_h200_nodes")]


def test_the_agreement_text_counts_what_the_points_show():
    pts = points([(f"{s}{P}", "deepseek_v3", "decode", 8, P, s, 128, 128 * P) for P in (16, 32) for s in ("naive", "occult")])
    exp = {"sim_h100_nodes": 0.3, "sim_h200_nodes": 0.2}          # memory-bound experts: faster on the H200
    pr = proj([(f"{s}{P}", prof, 1.0 if s == "naive" else 0.8, e) for P in (16, 32) for s in ("naive", "occult")
               for prof, e in exp.items()])
    profiles = list(exp)
    gpu = per_gpu(pts, pr, latency_ms={"decode": 1.15 * 58})
    table = with_projection(pts, pr, profiles)
    text = " ".join(agreement_text(*profiles, gpu, crossovers(table, profiles), best_per_gpu(gpu)))
    assert "the collectives' time differs by at most 0 ms; the experts' differs at 4 point(s)" in text
    assert "the same for every strategy in 2 of 2 cases" in text
    assert "Crossovers: the same on both in 1 of 1" in text
    # P = 16 holds 82 GB a GPU: the H100's best is P = 32
    assert "it moves for deepseek_v3 decode (P = 32, occult on sim_h100_nodes; P = 16, occult on sim_h200_nodes)" in text
    assert "Memory fit differs at: deepseek_v3 P = 16 (sim_h200_nodes only)" in text


@pytest.mark.parametrize("argv, line", [
    (["model=deepseek_v3", "profile=sim_h200_nodes", "world_size=32", "world_sizes=32,64"],
     "world_size= and world_sizes= together"),
    (["model=deepseek_v3", "profile=sim_h200_nodes", "world_sizes=32,x"], "world_sizes=32,x: allowed values are"),
    (["model=deepseek_v3", "profile=sim_h200_nodes", "latency_ms=fast"], "latency_ms=fast: allowed values are"),
    (["model=deepseek_v3", "profile=sim_h200_nodes", "latency_ms=-5"], "latency_ms=-5: allowed values are a number"),
    (["model=deepseek_v3", "profile=sim_h200_nodes", "latency_ms=nan"], "latency_ms=nan: allowed values are a number"),
    (["model=m", "profile=sim_cpu_loopback", "devices_per_node=-2"], "devices_per_node=-2: allowed values are 0"),
])
def test_bad_world_sizes_and_bounds_are_one_line_errors(argv, line):
    with pytest.raises(ValueError, match=line) as err:
        parse(argv)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("sizes, experts, line", [
    ((32, 24), 256, r"world_sizes=32,24: profile=sim_h200_nodes covers world sizes \[8, 16, 32, 64, 128, 256\] "
                    r"\(not 24\); allowed values for this model: \[8, 16, 32, 64, 128, 256\]"),
    ((128, 256), 384, r"world_sizes=128,256: 256 does not divide the model's 384 experts; allowed values on "
                      r"profile=sim_h200_nodes: \[8, 16, 32, 64, 128\]"),
])
def test_a_world_the_profile_lacks_or_that_does_not_divide_the_experts_is_refused(sizes, experts, line):
    req = Request(model="m", profile="sim_h200_nodes", world_sizes=sizes)
    with pytest.raises(ValueError, match=line) as err:
        world_sizes_of(req, experts)
    assert "\n" not in str(err.value)
    assert world_sizes_of(Request(model="m", profile="sim_h200_nodes", world_sizes=(64, 32)), 256) == [32, 64]


def test_the_advisors_points_are_one_sweep_with_each_worlds_layout(tmp_path):
    req = Request(model="deepseek_v3", profile="sim_h200_nodes", routing="uniform", world_sizes=(8, 32),
                  systems=("naive", "hierarchical_node", "occult_placed"))
    params = sweep_params(req, [(P, s) for P in (8, 32) for s in req.systems], tmp_path)
    assert params["p8_s0/cluster.devices_per_node"] == "0" and params["p32_s0/cluster.devices_per_node"] == "8"
    assert params["p32_s1/hydra.sweep.subdir"] == "p32/hierarchical_node" and params["p32_s1/system.dedup"] == "node"
    assert params["p32_place/task"] == "place" and params["p32_s0/task.peer_rows"] == "false"
    assert params["p32_s2/system.placement_file"] == str(tmp_path / "p32" / "place" / "placements.json")
    again = sweep_params(req, [(32, "naive")], tmp_path, peer_rows=True)
    assert again["p32_s0/task.peer_rows"] == "true" and again["p32_s0/hydra.sweep.subdir"] == "p32/naive+peer_rows"
    assert "p32_place/task" not in again and "p8_s0/task" not in again
    line = ("[2026-12-05][occult][INFO] - [point 3/9] +workload=decode,cluster.world_size=32,system.dedup=node,"
            "system=hierarchical,task=simulate (2 done, about 20 s left)")
    assert progress_line(line) == "  [point 3/9] P=32 hierarchical_node (2 done, about 20 s left)"
    # a proxy pre-trained before the points is announced, not minutes of silence
    line = ("[2026-12-08 02:29:28,091][HYDRA] before the sweep: 1 proxy checkpoint(s) its points load are not "
            "cached and are pre-trained now, apart from the points: deepseek_v3_proxy (about 3 min)")
    assert progress_line(line) == ("  before the sweep: 1 proxy checkpoint(s) its points load are not cached and are "
                                   "pre-trained now, apart from the points: deepseek_v3_proxy (about 3 min)")
    assert progress_line("[2026-12-08][occult][INFO] - wrote 40 rows") is None
    assert progress_line("[2026-12-08][occult][ERROR] - point failed (cause: before the sweep: x)") is None
    assert progress_line("[2026-12-08][occult][WARNING] - before the sweep: x") == "  before the sweep: x"


def test_the_layouts_table_names_the_strategies_one_node_lacks():
    from analysis.figures.scale_study import domain_text
    dom = pd.DataFrame([{"model": "m", "workload": "decode", "world_size": 16, "moves": "yes"}])
    table = pd.DataFrame([{"model": "m", "world_size": 16, "devices_per_node": d, "strategy": s}
                          for d, s in ((8, "naive"), (8, "hierarchical_device"), (16, "naive"))])
    text = domain_text(dom, table)
    assert "moves in 1 of 1 rows" in text and "one-node points have no hierarchical_device" in text
    assert "have no" not in domain_text(dom, table[table.strategy == "naive"])
