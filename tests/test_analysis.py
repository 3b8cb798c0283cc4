"""analysis/: connected components, the cost model, projections, reports, sim clusters.

No runs are started: results frames are synthetic, in the real schema
(occult.records), and written where load_runs finds them.
"""
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

from analysis import pricing, projection
from analysis.calibration import fit_line, fit_points, profile_dict
from analysis.figures import costmodel_check as check
from analysis.figures.table1_ct_runtime import linear_fit, pearson
from analysis.sections import resolve_builders
from analysis.lcc import component_growth, largest_component, token_counts, topk_from_logits, uniform_lcc_curve
from analysis.load import load_runs
from analysis.report import write_report
from occult.config import register, setting_columns
from occult.ep import links, profiles
from occult.records import make_frame, row, write_results

CONF = str(Path(__file__).resolve().parent.parent / "conf")
register()


# ---------------------------------------------------------------------------
# largest connected component
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("ids, E, expected", [
    ([[0, 1], [2, 3]], 6, 2),                       # two edges, apart
    ([[0, 1], [1, 2], [3, 4]], 6, 3),               # a path 0-1-2
    ([[0, 1, 2], [2, 3, 4], [5, 6, 7]], 8, 5),      # top-3 cliques sharing expert 2
    ([[0, 5], [1, 4], [5, 1]], 6, 4),               # 0-5-1-4 joined by the last token
    ([[3, 3]], 4, 1),                               # a repeated id is not an edge
    (np.zeros((0, 2), dtype=int), 5, 1),            # no tokens: singletons
])
def test_largest_component_on_hand_graphs(ids, E, expected):
    assert largest_component(np.asarray(ids), E) == expected


def test_component_growth_follows_prefixes():
    ids = np.array([[0, 1], [2, 3], [1, 2], [4, 5], [3, 4]])
    assert component_growth(ids, 8, [1, 2, 3, 4, 5]) == {1: 2, 2: 2, 3: 4, 4: 4, 5: 6}
    assert token_counts(5) == [1, 2, 4, 5] and token_counts(8) == [1, 2, 4, 8]


def test_largest_component_rejects_bad_ids():
    with pytest.raises(ValueError, match="outside"):
        largest_component(np.array([[0, 9]]), 4)


def test_topk_from_logits_and_uniform_curve():
    logits = np.array([[0.1, 3.0, 2.0, -1.0], [5.0, 0.0, 1.0, 2.0]])
    assert topk_from_logits(logits, 2).tolist() == [[1, 2], [0, 3]]
    curve = uniform_lcc_curve(16, 2, [1, 64], draws=3, seed=0)
    assert (curve[curve.tokens == 1].lcc == 2).all()
    assert (curve[curve.tokens == 64].lcc > 2).all() and (curve.lcc <= 16).all()


# ---------------------------------------------------------------------------
# cost model
# ---------------------------------------------------------------------------

def test_a2a_time_on_a_hand_example():
    link = links.Link(intra_latency_s=10e-6, intra_Bps=1e9)
    bytes_PP = np.array([[7e6, 1e6], [5e5, 9e6]])        # the diagonal stays home: free
    # rank 0 sends 1 MB, receives 0.5 MB; rank 1 sends 0.5 MB, receives 1 MB -> 1 ms + 10 us
    assert pricing.a2a_seconds(bytes_PP, link) == pytest.approx(1e-3 + 10e-6)
    assert pricing.a2a_seconds(bytes_PP, link, calls=3) == pytest.approx(1e-3 + 30e-6)
    assert pricing.a2a_seconds(np.zeros((1, 1)), link) == 0.0


def test_a2a_time_across_nodes_uses_the_nic_share():
    # 4 ranks, 2 per node: intra 10 GB/s; one 1 GB/s NIC per node shared by 2 devices -> 0.5 GB/s
    prof = profiles.profile_from_dict({"name": "t", "world_size": 4, "devices_per_node": 2,
                                 "intra_node_GBps": 10.0, "intra_node_latency_us": 5.0, "inter_node_GBps": 1.0,
                                 "nics_per_node": 1, "inter_node_latency_us": 20.0, "device_TFLOPs": 1.0,
                                 "dtype": "bfloat16"})
    link = prof.at(4)
    bytes_PP = np.zeros((4, 4))
    bytes_PP[0, 1] = 1e7            # intra: 1 ms
    bytes_PP[0, 2] = 1e6            # inter: 2 ms (the slower link of rank 0)
    assert pricing.a2a_seconds(bytes_PP, link) == pytest.approx(20e-6 + 2e-3)
    # experts: 6 D F FLOPs per row forward, 12 backward, at 1 TFLOP/s
    assert pricing.expert_seconds([100, 300], 64, 32, link) == pytest.approx(6 * 300 * 64 * 32 / 1e12)
    assert pricing.expert_seconds([300], 64, 32, link, backward=True) == pytest.approx(12 * 300 * 64 * 32 / 1e12)
    with pytest.raises(ValueError, match="world_size=4"):
        prof.at(8)


def test_efficiency_scales_the_link():
    prof = profiles.profile_from_dict({"name": "t", "world_size": 2, "intra_node_GBps": 10.0,
                                 "link_efficiency": 0.5, "device_TFLOPs": 2.0, "compute_efficiency": 0.25,
                                 "dtype": "bfloat16"})
    assert prof.at(2).intra_Bps == pytest.approx(5e9) and prof.at(2).flops == pytest.approx(0.5e12)


def test_every_sim_profile_loads():
    names = profiles.available_profiles()
    assert {"sim_a6000x4", "sim_a6000x8", "sim_a6000x16", "sim_h100x8", "sim_h100x2node",
            "sim_h100x8node"} <= set(names)
    for name in names:
        p = profiles.load_profile(name)
        assert p.name == name and p.source


def test_calibration_fit_recovers_a_line():
    a, b = fit_line([0, 1e6, 2e6, 4e6], [0.5, 1.5, 2.5, 4.5])
    assert a == pytest.approx(0.5) and b == pytest.approx(1e-6)


# ---------------------------------------------------------------------------
# synthetic runs in the results schema
# ---------------------------------------------------------------------------

# the settings' columns of a run whose task and system have none of their fields
ABSENT_SETTINGS = {name: absent for name, (_, absent) in setting_columns().items()}


def _context(system, model, task, P, E, K, D, F, routing="uniform", T=64, options=None):
    """A run's context; the system's ``options`` that are settings are its columns too, as
    the runner writes them (:func:`occult.runner.run_settings`)."""
    options = options or {}
    return {"run_id": f"t/{system}/{model}/{task}/{P}/{K}/{routing}", "experiment": "synthetic", "label": "",
            "system": system, "impl": "harness", "system_options": json.dumps(options, sort_keys=True),
            "model": model, "init": "random", "task": task, "cluster": f"cpu{P}",
            "world_size": P, "num_experts": E, "top_k": K, "hidden_size": D, "expert_ffn_size": F,
            "tokens_per_rank": T, "routing": routing, "batch_size": 2, "seq_len": 32, "seed": 0,
            "config_hash": f"{system}{P}{K}{routing}", **ABSENT_SETTINGS,
            **{k: v for k, v in options.items() if k in ABSENT_SETTINGS}}


def _comm_rows(P, rows_per_peer, D, layers=(0,), directions=("forward", "backward")):
    out = []
    for layer in layers:
        for direction in directions:
            for phase in ("dispatch", "combine"):
                for s in range(P):
                    for d in range(P):
                        common = dict(layer=layer, rank=s, phase=phase, direction=direction, src_rank=s, dst_rank=d)
                        out += [row("rows", rows_per_peer, "rows", **common),
                                row("bytes", rows_per_peer * D * 4, "bytes", **common)]
    return out


def layer_run(system, P, K, ct, a2a_ms, rows_per_peer, E=16, D=32, F=16, T=64, routing="uniform"):
    rows = _comm_rows(P, rows_per_peer, D)
    for s in range(3):
        for r in range(P):
            for direction in ("forward", "backward"):
                for phase in ("dispatch", "combine"):
                    rows.append(row("a2a_time", a2a_ms * (1 + 0.01 * s), "ms", layer=0, rank=r, phase=phase,
                                    direction=direction, sample=s))
                    rows.append(row("a2a_wait", 0.1, "ms", layer=0, rank=r, phase=phase, direction=direction,
                                    sample=s))
            for phase, ms in (("route", 0.5), ("dispatch", a2a_ms), ("experts", 2.0), ("combine", a2a_ms)):
                rows.append(row("time", ms, "ms", layer=0, rank=r, phase=phase, direction="forward", sample=s))
            for direction, ms in (("forward", 4 * a2a_ms + 3), ("backward", 4 * a2a_ms + 5),
                                  ("forward+backward", 8 * a2a_ms + 8)):
                rows.append(row("time", ms, "ms", layer=0, rank=r, phase="layer", direction=direction, sample=s))
    for r in list(range(P)) + [-1]:
        rows.append(row("tokens", T * (P if r == -1 else 1), "tokens", layer=0, rank=r))
    rows += [row("ct_all", ct, "devices/token", layer=0), row("ct_remote", ct - 0.5, "devices/token", layer=0),
             row("intra_ratio", 0.2, "ratio", layer=0),
             row("rows_per_token", ct, "rows/token", layer=0, phase="dispatch", direction="forward")]
    return make_frame(rows, _context(system, "layer_small", "layer", P, E, K, D, F, routing, T))


def prefill_run(system, ttft_ms, rows_per_peer, P=4, E=16, K=4, D=32, F=16):
    rows = _comm_rows(P, rows_per_peer, D, layers=(0, 1), directions=("forward",))
    for s in range(2):
        rows.append(row("ttft", ttft_ms * (1 + 0.02 * s), "ms", phase="prefill", sample=s))
        rows.append(row("tokens_per_s", 1000.0 / ttft_ms, "tokens/s", phase="prefill", sample=s))
        for r in range(P):
            for layer in (0, 1):
                rows.append(row("a2a_time", 1.0, "ms", layer=layer, rank=r, phase="dispatch",
                                direction="forward", sample=s))
    for layer in (0, 1):
        rows.append(row("tokens", 64 * P, "tokens", layer=layer, rank=-1))
        rows.append(row("ct_all", 2.0, "devices/token", layer=layer))
    return make_frame(rows, _context(system, "olmoe_proxy", "prefill", P, E, K, D, F))


def calibration_run(P):
    rows = []
    for i, b in enumerate((0, 1 << 20, 4 << 20)):
        rows.append(row("calib_bytes", b, "bytes", layer=i))
        for r in range(P):
            for s in range(3):
                rows.append(row("calib_a2a_time", 0.5 + b / 1e6, "ms", layer=i, rank=r, sample=s))
    for i, n in enumerate((512, 4096)):
        rows.append(row("calib_expert_rows", n, "rows", layer=i))
        rows.append(row("calib_local_experts", 16 // P, "experts", layer=i))
        rows.append(row("calib_expert_hidden", 256, "D", layer=i))
        rows.append(row("calib_expert_ffn", 128, "F", layer=i))
        for r in range(P):
            rows.append(row("calib_expert_time", 1.0 + n / 1000, "ms", layer=i, rank=r))
    ctx = _context("naive", "layer_small", "calibrate", P, 16, 2, 32, 16)
    return make_frame(rows, ctx)


def write_trace(run_dir: Path, E=16, K=4, P=4, T=64, layers=(0, 1), seed=0):
    """routing.parquet + router_logits.npz as occult.tasks.traces writes them."""
    g = np.random.default_rng(seed)
    frames, logits = [], {}
    for layer in layers:
        lg = g.normal(size=(P * T, E)).astype(np.float32)
        lg[:, :4] += 1.5                                   # a few popular experts
        logits[f"layer_{layer}"] = lg
        ids = topk_from_logits(lg, K)
        for rank in range(P):
            block = ids[rank * T:(rank + 1) * T]
            frames.append(pd.DataFrame({"layer": layer, "rank": rank, "token": np.repeat(np.arange(T), K),
                                        "slot": np.tile(np.arange(K), T), "expert": block.flatten(),
                                        "weight": np.full(T * K, 0.25)}))
    pd.concat(frames).to_parquet(run_dir / "routing.parquet", index=False)
    np.savez(run_dir / "router_logits.npz", **logits)


@pytest.fixture
def synthetic_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    runs = {}
    for system, rows_per_peer, scale in (("naive", 64, 1.0), ("occult", 30, 0.6)):
        for K, ct in ((2, 1.6), (4, 2.5), (8, 3.4)):
            runs[f"{system}_k{K}"] = layer_run(system, 4, K, ct * (1 if system == "occult" else K / ct),
                                               a2a_ms=scale * ct, rows_per_peer=rows_per_peer * K // 8)
        runs[f"{system}_p2"] = layer_run(system, 2, 8, 1.9, a2a_ms=scale * 2, rows_per_peer=rows_per_peer)
        runs[f"{system}_prefill"] = prefill_run(system, 100.0 * scale, rows_per_peer)
    runs["tutel_prefill"] = prefill_run("tutel", 300.0, 80)
    runs["cal4"] = calibration_run(4)
    runs["cal2"] = calibration_run(2)
    for name, df in runs.items():
        write_results(df, sweep / name)
    write_trace(sweep / "naive_prefill")
    return sweep


# ---------------------------------------------------------------------------
# projections and reports
# ---------------------------------------------------------------------------

def test_projection_of_a_run_by_hand(tmp_path):
    run = layer_run("naive", 2, 8, 1.9, a2a_ms=1.0, rows_per_peer=100, D=32)
    run["run_dir"] = "r"
    prof = profiles.profile_from_dict({"name": "t", "world_size": 2, "intra_node_GBps": 1.0,
                                 "intra_node_latency_us": 10.0, "device_TFLOPs": 1.0, "dtype": "bfloat16"})
    proj = projection.project_run(run, prof)
    # each phase: every rank sends 100 rows x 32 x 4 bytes to the one other rank
    a2a = proj[proj.component == "a2a:dispatch"].ms.iloc[0]
    assert a2a == pytest.approx((10e-6 + 100 * 32 * 4 / 1e9) * 1e3)
    # re-sized to a target width in bfloat16: rows x 2048 x 2 bytes
    wide = projection.project_run(run, prof, projection.Target("wide", 2048, 1024, 16))
    assert wide[wide.component == "a2a:dispatch"].ms.iloc[0] == pytest.approx((10e-6 + 100 * 2048 * 2 / 1e9) * 1e3)
    # experts: T x K rows per rank (balanced), 6 D F each
    exp = proj[(proj.component == "experts") & (proj["pass"] == "forward")].ms.iloc[0]
    assert exp == pytest.approx(6 * 64 * 8 * 32 * 16 / 1e12 * 1e3)
    assert (proj.source == "projected").all()
    total = proj[proj.component == "moe"].ms.iloc[0]
    assert wide[wide.component == "moe"].target_moe_layers.iloc[0] == 16 and total > 0


def test_projected_rows_are_labelled(synthetic_sweep):
    from analysis.load import load_runs
    df = load_runs(synthetic_sweep)
    proj = projection.project_runs(df, profiles.load_profile("sim_a6000x4"), target="real")
    assert not proj.empty and set(proj.source) == {"projected"}
    assert set(proj.target_model) >= {"olmoe"}                     # olmoe_proxy -> olmoe
    totals = projection.projected_totals(proj)
    assert set(totals.source) == {"projected"} and (totals.moe_ms > 0).all()


def test_cost_model_check_against_synthetic_measurements(synthetic_sweep):
    from analysis.load import load_runs
    df = load_runs(synthetic_sweep)
    profile, where = check.cpu_profile(df)
    assert "calibration runs" in where and sorted(profile.calibration) == [2, 4]
    chk = check.check_against_measured(df, profile)
    assert set(chk.world_size) == {2, 4} and "a2a_total" in set(chk.quantity)
    assert np.isfinite(chk.error).all()


def test_cost_model_check_uses_a_runs_own_calibration():
    """A layer run with task.calibrate=true rows is projected with the line fitted to them
    (0.5 ms + 1 ms per MB), not with the sweep's profile; by hand for one collective."""
    own = layer_run("naive", 4, 8, 3.4, a2a_ms=1.0, rows_per_peer=64, D=32)
    cal = calibration_run(4)
    run = pd.concat([own, cal.assign(**{c: own[c].iloc[0] for c in ("task", "run_id")})], ignore_index=True)
    run["run_dir"] = "folder"
    other = layer_run("naive", 4, 8, 3.4, a2a_ms=1.0, rows_per_peer=64, D=32).assign(run_id="other")
    other["run_dir"] = "folder"
    # no sweep profile: the run without its own calibration is not checked
    chk = check.check_against_measured(pd.concat([run, other], ignore_index=True), None)
    assert set(chk.run_id) == {own.run_id.iloc[0]} and set(chk.calibration) == {"own run"}
    one = chk[chk.quantity == "a2a dispatch forward"].iloc[0]
    sent = 3 * 64 * 32 * 4                            # a rank sends 64 rows to each of 3 peers
    assert one.projected_ms == pytest.approx(0.5 + sent / 1e6, rel=1e-6)
    assert one.measured_ms == pytest.approx(1.01)     # median sample (1.00, 1.01, 1.02)


def test_calibration_points_from_rows():
    df = calibration_run(4)
    df["run_dir"] = "c"
    (pt,) = fit_points(df)
    assert pt["world_size"] == 4 and pt["latency_us"] == pytest.approx(500, rel=1e-6)
    assert pt["GBps"] == pytest.approx(1.0, rel=1e-6)                     # 1 ms per MB
    assert pt["TFLOPs"] > 0 and pt["expert_call_us"] >= 0
    assert profiles.profile_from_dict(profile_dict([pt], "test")).at(4).intra_Bps == pytest.approx(1e9, rel=1e-6)


def test_report_writes_tables_and_figures(synthetic_sweep, tmp_path, monkeypatch):
    monkeypatch.setattr("analysis.figures.fig3_lcc.LCC_DRAWS", 4)
    out = tmp_path / "report"
    path = write_report([synthetic_sweep], out,
                        builders="fig3_lcc,fig8_pattern,table1_ct_runtime,fig1_latency,fig12_scaling,costmodel_check")
    text = path.read_text()
    for title in ("Fig. 3", "Fig. 8", "Table 1", "Fig. 1", "Fig. 12", "Cost model vs this machine"):
        assert f"## {title}" in text, title
    assert "not drawn" not in text
    for stem in ("fig3_lcc", "fig8_pattern", "table1_ct_runtime", "fig1_latency", "fig12_scaling",
                 "costmodel_check"):
        assert (out / f"{stem}.png").is_file() and (out / f"{stem}.pdf").is_file(), stem
        assert f"]({stem}.png)" in text
    assert "| projected" in text and "2.7-8.7x" in text                  # labelled; paper quoted
    fits = pd.read_csv(out / "table1_fit.csv")
    occ = fits[(fits.system == "occult") & (fits.cluster == "cpu4") & (fits.y == "all-to-all, forward (ms)")]
    assert occ.pearson_r.iloc[0] == pytest.approx(1.0, abs=1e-3)        # synthetic: a2a = 0.6 C_T
    proj = pd.read_csv(out / "fig1_projected.csv")
    assert set(proj.source) == {"projected"}


def test_report_reads_builders_of_the_runs_experiments():
    from analysis.report import builders_of
    df = pd.DataFrame({"experiment": ["table1_ct_runtime", "fig3_lcc", "adhoc"]})
    assert builders_of(df) == ("fig3_lcc,table1_ct_runtime,costmodel_check", {})   # by experiment; adhoc: none
    assert builders_of(pd.DataFrame({"experiment": ["adhoc"]})) == ("", {})
    spec, options = builders_of(pd.DataFrame({"experiment": ["exflow_affinity"]}))
    assert spec == "exflow_affinity" and options == {"exflow_affinity": {"world_sizes": [4, 8], "time_limit_s": 60.0}}


def test_a_report_has_only_the_builders_it_names(synthetic_sweep, tmp_path):
    """The cost-model check is a builder like the others: no report gets it unasked."""
    text = write_report([synthetic_sweep], tmp_path, builders="table1_ct_runtime").read_text()
    assert "## Table 1" in text and "Cost model vs this machine" not in text


def test_builders_have_one_name_each():
    with pytest.raises(ValueError, match="fig3_lcc"):
        resolve_builders("fig99")
    with pytest.raises(ValueError, match="unknown report builder"):       # dotted paths are not names
        resolve_builders("analysis.figures.fig3_lcc.build")
    assert [b.__module__ for b in resolve_builders("fig3_lcc, table1_ct_runtime")] == \
        ["analysis.figures.fig3_lcc", "analysis.figures.table1_ct_runtime"]


def test_fit_helpers():
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert np.isnan(pearson([1, 2], [1, 2]))
    assert linear_fit([0, 1, 2], [1, 3, 5]) == pytest.approx((2.0, 1.0))


# ---------------------------------------------------------------------------
# sim clusters are refused as runs; the grids sweeper expands unions
# ---------------------------------------------------------------------------

def _cfg(*overrides, hydra: bool = False):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


@pytest.mark.parametrize("name", profiles.available_profiles())
def test_projection_profiles_are_not_clusters(name):
    """Profiles live in their own group (conf/profile): as a cluster they do not compose,
    and the one-line message points at the projection command."""
    from hydra.errors import MissingConfigException

    from occult.cli import describe
    with pytest.raises(MissingConfigException) as err:
        _cfg(f"cluster={name}")
    assert describe(err.value).startswith(f"cluster={name}: no such option; available: cpu1, cpu2")
    assert f"python -m analysis.project RUN_DIRS --profile {name}" in describe(err.value)


def test_profile_schema_names_a_bad_field():
    with pytest.raises(ValueError, match=r"profile=t: .*intra_node_gbps"):
        profiles.profile_from_dict({"name": "t", "intra_node_gbps": 10.0})


def test_experiments_compose():
    for name in ("fig1_latency", "fig3_lcc", "table1_ct_runtime", "fig8_pattern", "fig12_scaling", "lossy_front",
                 "default_study", "fig7_pruning", "pruning_no_finetune", "placement_study", "bench",
                 "calibrate", "exflow_affinity", "group_limit", "modern_models", "proxies"):
        cfg = _cfg(f"experiment={name}")
        assert cfg.experiment_name == name                   # each experiment writes its own folder
        assert resolve_builders(cfg.report)
        assert set(cfg.report_options) <= {b.strip() for b in cfg.report.split(",")}


def test_grids_sweeper_expands_a_union():
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra_plugins.occult_sweepers.grids_sweeper import GridsSweeper

    class Ctx:
        config_loader = None

    sw = GridsSweeper(max_batch_size=None, params={"cluster": "cpu4", "a/system": "naive,occult",
                                                   "a/model.top_k": "2", "b/task": "prefill"})
    sw.hydra_context = Ctx()
    cli = OverridesParser.create().parse_overrides(["model.top_k=4,8", "seed=1"])
    (points,) = sw.split_arguments(cli, None)
    as_sets = [frozenset(p) for p in points]
    assert frozenset({"cluster=cpu4", "system=naive", "model.top_k=4", "seed=1"}) in as_sets
    assert frozenset({"cluster=cpu4", "task=prefill", "seed=1"}) in as_sets     # top_k only where swept
    assert len(points) == 2 * 2 + 1


def test_a_long_point_keeps_the_folder_the_command_line_names():
    """A point whose overrides would name a folder past the limit gets a short name with a
    digest, unless the command line names its folder (``hydra.sweep.subdir=...``)."""
    from omegaconf import OmegaConf

    from hydra_plugins.occult_sweepers.grids_sweeper import MAX_FOLDER_NAME, GridsSweeper

    point = [f"model.hidden_size={'1' * MAX_FOLDER_NAME}"]
    sw = GridsSweeper(max_batch_size=None, params={})
    for subdir, shortened in (("${hydra.job.override_dirname}", True), ("placement_p4", False)):
        sw.config = OmegaConf.create({"hydra": {"job": {"config": {"override_dirname": {"exclude_keys": []}}},
                                                "sweep": {"subdir": subdir}}})
        assert (sw._short_folder(point) != point) == shortened, subdir


def test_every_experiments_sweeper_instantiates_and_refers_to_its_points():
    """Hydra instantiates the sweeper from the composed config (resolving it); a grid's
    reference to its point's config (``%{...}``) must survive that and reach the point."""
    from hydra.utils import instantiate
    from occult.config import CONF_DIR

    class Ctx:
        config_loader = None

    for path in sorted((CONF_DIR / "experiment").glob("*.yaml")):
        cfg = _cfg(f"experiment={path.stem}", hydra=True)
        if str(cfg.hydra.mode) != "RunMode.MULTIRUN":
            continue
        sw = instantiate(cfg.hydra.sweeper)
        sw.hydra_context, sw.config = Ctx(), None
        (points,) = sw.split_arguments([], None)
        assert points, path.stem
        if path.stem == "fig7_pruning":      # the label names the point's own budget
            point = next(p for p in points if any(o.startswith("label=score_") for o in p))
            job = _cfg(*[o for o in point if not o.startswith("hydra.")], "experiment=fig7_pruning")
            assert job.label == f"score_{job.system.budget}"


def finetune_run(run_dir: Path, label: str, system: str, budget, steps: int, pydoc_loss: float, ct: float,
                 budget_key: str = "budget"):
    """A task=finetune run folder as run.py writes it (the budget in system_options and its
    column, the arm in ``label``, as experiment=fig7_pruning names every point)."""
    rows = [row("train_loss", 6.0, "nats/token", sample=s) for s in range(steps)]
    for corpus, loss in (("pydoc", pydoc_loss), ("shakespeare", 5.0)):
        rows += [row("eval_loss", loss, "nats/token", phase=corpus),
                 row("eval_perplexity", float(np.exp(loss)), "ppl", phase=corpus),
                 row("eval_accuracy", 1.0 / loss, "ratio", phase=corpus),
                 row("eval_remote_bytes", 1e6 * ct, "bytes", phase=corpus)]
        rows += [row("ct_all", ct, "devices/token", layer=layer, phase=corpus) for layer in (0, 1)]
    options = {} if budget is None else {budget_key: budget}
    ctx = {**_context(system, "olmoe_proxy", "finetune", 4, 16, 4, 32, 16, options=options), "label": label,
           "run_id": f"t/{label}"}
    write_results(make_frame(rows, ctx), run_dir)


def test_fig7_pruning_figure_from_finetune_runs(tmp_path):
    from analysis.load import load_runs
    from analysis.figures import fig7_pruning
    arms = [("similarity_2", "occult_prune_sim", 2, 2, 5.905, 2.0), ("score_1", "occult_prune_score", 1, 2, 5.95, 1.0),
            ("no_finetune", "occult", None, 0, 7.0, 3.6), ("standard", "occult", None, 2, 5.9, 3.7),
            ("score_2", "occult_prune_score", 2, 2, 5.91, 2.0), ("similarity_1", "occult_prune_sim", 1, 2, 5.94, 1.0),
            ("score_1_no_finetune", "occult_prune_score", 1, 0, 6.9, 1.0)]
    for i, arm in enumerate(arms):
        finetune_run(tmp_path / f"run{i}", *arm)
    (section,) = fig7_pruning.build(load_runs([tmp_path]), tmp_path)
    assert (tmp_path / "fig7_pruning.png").is_file() and (tmp_path / "fig7_pruning.pdf").is_file()
    table = dict(section.tables)["fig7_pruning"].set_index("arm")
    assert list(table.index) == ["no_finetune", "standard", "score_1", "score_2", "similarity_1", "similarity_2",
                                 "score_1_no_finetune"]        # the reading order, whatever the folders' order
    assert table.loc["similarity_2", "pydoc_loss"] == pytest.approx(5.905)
    assert table.loc["score_1", "ct_all"] == pytest.approx(1.0)
    assert table.budget.fillna(-1).tolist() == [-1, -1, 1, 2, 1, 2, 1]      # the budget column; Occult has none


def test_group_limit_table_puts_each_arm_before_and_after_fine_tuning_on_one_row(tmp_path):
    from analysis.figures import group_limit
    from analysis.load import load_runs
    arms = [("occult_steps_0", "occult", None, 0, 7.0, 3.6), ("occult_steps_2", "occult", None, 2, 5.9, 3.7),
            ("group_1_steps_0", "group_limit", 1, 0, 6.8, 1.0), ("group_1_steps_2", "group_limit", 1, 2, 5.95, 1.0),
            ("group_2_steps_2", "group_limit", 2, 2, 5.92, 2.0),
            ("score_1_steps_2", "occult_prune_score", 1, 2, 5.97, 1.0)]
    for i, arm in enumerate(arms):
        finetune_run(tmp_path / f"run{i}", *arm, budget_key="topk_group" if arm[1] == "group_limit" else "budget")
    (section,) = group_limit.build(load_runs([tmp_path]), tmp_path)
    assert (tmp_path / "group_limit.png").is_file() and (tmp_path / "group_limit.md").is_file()
    table = dict(section.tables)["group_limit"]
    assert list(zip(table.system, table.devices_cap.fillna(0))) == [
        ("occult", 0), ("group_limit", 1), ("group_limit", 2), ("occult_prune_score", 1)]
    g1 = table[(table.system == "group_limit") & (table.devices_cap == 1)].iloc[0]
    assert (g1.pydoc_loss_before, g1.pydoc_loss_after) == (pytest.approx(6.8), pytest.approx(5.95))
    assert g1.ct_all == pytest.approx(1.0) and g1.remote_MB == pytest.approx(2.0)     # two domains, 1 MB each
    g2 = table[(table.system == "group_limit") & (table.devices_cap == 2)].iloc[0]
    assert np.isnan(g2.pydoc_loss_before) and g2.pydoc_loss_after == pytest.approx(5.92)


def test_proxies_table_has_a_row_per_pretrained_proxy_with_its_router(tmp_path):
    from analysis.figures import proxies
    from analysis.load import load_runs
    for name, loss, layers in (("deepseek_v3_proxy", 4.6, (1, 2, 3)), ("mixtral_proxy", 4.9, (0, 1, 2, 3))):
        rows = [row("val_loss", loss, "nats/token", rank=0), row("val_perplexity", float(np.exp(loss)), "ratio", rank=0),
                row("val_accuracy", 0.2, "ratio", rank=0), row("wall_time", 300.0, "s", rank=0),
                row("parameters", 9.9e6, "params", rank=0), row("unigram_val_loss", 6.3, "nats/token", rank=0)]
        for layer in layers:
            rows += [row("experts_never_chosen", float(layer == 1), "experts", layer=layer, rank=0),
                     row("expert_load_max_over_mean", 1.5 + layer / 10, "ratio", layer=layer, rank=0)]
        write_results(make_frame(rows, _context("", name, "pretrain", 1, 8, 2, 128, 16)), tmp_path / name)
    (section,) = proxies.build(load_runs([tmp_path]), tmp_path)
    table = dict(section.tables)["proxies"].set_index("proxy")
    v3 = table.loc["deepseek_v3_proxy"]
    assert (v3.E, v3.K, v3.layers, v3.shared) == (256, 8, "4 (1 dense)", "1")   # from its model config
    assert v3.router == "sigmoid + correction bias, top-4 of 8 groups, renormalised, x 2.5"
    assert v3.never_chosen == "1, 0, 0" and v3.busiest_over_mean == "1.60, 1.70, 1.80"
    assert table.loc["mixtral_proxy", "router"] == "softmax, renormalised"
    assert (tmp_path / "proxies.md").is_file()


def test_fig1_reference_row_is_measured_and_never_projected(tmp_path):
    """system=reference sends nothing: it gets a measured latency and ratio to naive in
    Fig. 1, and no projected row (there are no bytes to project)."""
    from analysis.figures import fig1_latency
    from analysis.load import load_runs
    sweep = tmp_path / "sweep"
    write_results(prefill_run("naive", 100.0, 64), sweep / "naive_prefill")
    rows = []
    for s in range(2):
        rows.append(row("ttft", 40.0, "ms", phase="prefill", sample=s))
        rows.append(row("tokens_per_s", 25.0, "tokens/s", phase="prefill", sample=s))
    ref = make_frame(rows, {**_context("reference", "olmoe_proxy", "prefill", 4, 16, 4, 32, 16), "impl": "library"})
    write_results(ref, sweep / "reference_prefill")
    (section,) = fig1_latency.build(load_runs([sweep]), tmp_path)
    tables = dict(section.tables)
    measured = tables["fig1_measured"].set_index("system")
    assert measured.loc["reference", "impl"] == "library"
    assert measured.loc["reference", "ratio_to_naive"] == pytest.approx(40.0 / 101.0)   # naive: 100, 102 ms
    assert set(tables["fig1_projected"].system) == {"naive"}
    assert (tmp_path / "fig1_latency.png").is_file()


def experiment_options(name: str) -> dict:
    """An experiment's ``report_options`` of its builder of the same name (its knobs)."""
    from omegaconf import OmegaConf

    from occult.config import read_conf
    return OmegaConf.to_container(read_conf("experiment", name).report_options[name])


def bench_layer_run(run_dir: Path, shape: str, naive_ms: float, occult_ms: float) -> None:
    """A task=bench run folder: naive and occult rows tagged with their system, as the task writes them."""
    rows = []
    for system, ms, raw in (("naive", naive_ms, 0.9), ("occult", occult_ms, 0.45)):
        tag = {"system": system, "impl": "harness", "system_options": "{}", "run_id": f"b/{shape}/{system}"}
        for s in range(3):
            for rank in range(2):
                for direction, scale in (("forward", 1.0), ("forward+backward", 2.5)):
                    rows.append({**row("time", ms * scale, "ms", layer=0, rank=rank, phase="layer",
                                       direction=direction, sample=s), **tag})
                rows.append({**row("time", ms * 0.1, "ms", layer=0, rank=rank, phase=f"{system}_index", sample=s),
                             **tag})
                for phase, share in (("route", 0.05), ("experts", 0.3)):
                    rows.append({**row("time", ms * share * (1 + rank), "ms", layer=0, rank=rank, phase=phase,
                                       direction="forward", sample=s), **tag})
                rows.append({**row("a2a_time", ms * 0.2 * (1 + rank), "ms", layer=0, rank=rank, phase="dispatch",
                                   direction="forward", sample=s), **tag})
                rows.append({**row("time", ms * 0.4 * (1 + rank), "ms", layer=0, rank=rank, phase="experts",
                                   direction="backward", sample=s), **tag})
                rows.append({**row("a2a_time_paired", 1.0, "ms", layer=0, rank=rank, phase="dispatch",
                                   direction="forward", sample=s), **tag})
                rows.append({**row("raw_a2a_time", raw, "ms", layer=0, rank=rank, phase="dispatch",
                                   direction="forward", sample=s), **tag})
        rows.append({**row("activation_bytes", 1e8, "bytes", layer=0, rank=0), **tag})
    ctx = {**_context("naive", shape, "bench", 2, 64, 8, 2048, 16), "task": "bench"}
    write_results(make_frame(rows, ctx), run_dir)


def test_bench_report_gives_ratios_efficiency_and_targets(tmp_path):
    from analysis.figures import bench
    from analysis.load import load_runs
    bench_layer_run(tmp_path / "comm", "bench_comm", 10.0, 5.0)
    bench_layer_run(tmp_path / "olmoe", "bench_olmoe", 10.0, 9.5)
    (section,) = bench.build(load_runs([tmp_path]), tmp_path, **experiment_options("bench"))
    tables = dict(section.tables)
    layers = tables["bench_layers"].set_index(["model", "system"])
    assert layers.loc[("bench_comm", "occult"), "layer_fwd_ms_ratio"] == pytest.approx(0.5)
    assert layers.loc[("bench_comm", "occult"), "own_index_work_share_fwd"] == pytest.approx(0.1)
    assert layers.loc[("bench_comm", "naive"), "a2a_efficiency"] == pytest.approx(0.9)
    # route + collectives + experts of the slowest rank (rank 1: twice rank 0's), over naive's layer
    assert layers.loc[("bench_comm", "occult"), "layer_fwd_floor_ratio"] == pytest.approx(2 * 0.55 * 5.0 / 10.0)
    assert layers.loc[("bench_comm", "occult"), "layer_fwd_bwd_floor_ratio"] == pytest.approx(2 * 0.95 * 5.0 / 25.0)
    targets = tables["bench_targets"].set_index("target")
    assert bool(targets.loc["comm-bound layer, forward", "met"])                 # 0.5 <= 0.58
    assert not bool(targets.loc["OLMoE-shaped layer, forward", "met"])           # 0.95 > 0.90
    assert targets.loc["OLMoE-shaped layer, forward", "measured_floor"] == pytest.approx(2 * 0.55 * 9.5 / 10.0)
    assert targets.loc["all-to-all bandwidth vs plain all_to_all_single, min over systems and shapes",
                       "measured"] == pytest.approx(0.45)
    assert (tmp_path / "bench.md").is_file() and (tmp_path / "bench.csv").is_file()


def bench_model_run(run_dir: Path, workload: str, naive_ms: float, occult_ms: float, raws: dict) -> None:
    """A task=bench_model run folder: each system's latency rows (decode: a prompt and two
    tokens per iteration) and its replayed collectives (``raws``: system -> raw ms per
    collective, two collectives per rank and iteration)."""
    rows = []
    for system, ms in (("naive", naive_ms), ("occult", occult_ms)):
        tag = {"system": system, "impl": "harness", "system_options": "{}", "run_id": f"m/{workload}/{system}"}
        for s in range(3):
            if workload == "decode":
                rows.append({**row("ttft", 2 * ms, "ms", phase="decode", sample=s), **tag})
                rows += [{**row("token_latency", ms, "ms", phase="decode", sample=2 * s + k), **tag} for k in range(2)]
            else:
                rows.append({**row("ttft", ms, "ms", phase="prefill", sample=s), **tag})
            for rank in range(2):
                for phase in ("dispatch", "combine"):
                    rows.append({**row("raw_a2a_time", raws[system] * (1 + rank), "ms", layer=0, rank=rank,
                                       phase=phase, direction="forward", sample=s), **tag})
    ctx = {**_context("naive", "olmoe_proxy", "bench_model", 2, 64, 8, 128, 64), "task": "bench_model"}
    write_results(make_frame(rows, ctx), run_dir)


def test_bench_models_say_what_the_bytes_alone_can_buy(tmp_path):
    """a2a_only_ratio = (naive's iteration - naive's raw all-to-all + occult's) / naive's
    iteration, raw summed per rank (slowest rank); decode's iteration is its prompt and tokens."""
    from analysis.figures.bench import model_table
    from analysis.load import load_runs
    bench_model_run(tmp_path / "p", "prefill", 100.0, 90.0, {"naive": 10.0, "occult": 4.0})
    bench_model_run(tmp_path / "d", "decode", 5.0, 5.0, {"naive": 2.0, "occult": 1.0})
    table = model_table(load_runs([tmp_path])).set_index(["workload", "system"])
    occ = table.loc[("prefill", "occult")]
    assert occ.latency_ratio == pytest.approx(0.9)
    assert occ.raw_a2a_ratio == pytest.approx(0.4)                           # 2 x 8 ms vs 2 x 20 ms
    assert occ.a2a_only_ratio == pytest.approx((100 - 40 + 16) / 100)
    dec = table.loc[("decode", "occult")]
    assert table.loc[("decode", "naive"), "iteration_ms"] == pytest.approx(20.0)   # 10 + 2 x 5
    assert dec.a2a_only_ratio == pytest.approx((20 - 8 + 4) / 20)


def lossy_run(run_dir: Path, system: str, label: str, steps: int, pydoc_loss: float, bytes_per_token: float,
              ttft_ms: float, rows_per_peer: int):
    """A lossy_front point: a finetune run with its evaluation bytes and timing probe."""
    rows = [row("train_loss", 6.0, "nats/token", sample=s) for s in range(steps)]
    for corpus, loss in (("pydoc", pydoc_loss), ("shakespeare", pydoc_loss - 1.0)):
        rows += [row("eval_loss", loss, "nats/token", phase=corpus),
                 row("eval_perplexity", float(np.exp(loss)), "ppl", phase=corpus),
                 row("eval_accuracy", 1.0 / loss, "ratio", phase=corpus),
                 row("eval_tokens", 1000, "tokens", phase=corpus),
                 row("eval_remote_bytes", 1000 * bytes_per_token, "bytes", phase=corpus),
                 row("ct_all", 2.0, "devices/token", layer=0, phase=corpus)]
    rows += [row("ttft", ttft_ms, "ms", phase="prefill", sample=s) for s in range(2)]
    rows += [row("a2a_time", 1.0, "ms", layer=0, rank=r, phase=p, direction="forward", sample=0)
             for r in range(4) for p in ("dispatch", "combine")]
    rows += [row("tokens", 64, "tokens", layer=0, rank=r) for r in range(4)]
    rows += [r for r in _comm_rows(4, rows_per_peer, 32, directions=("forward",))]
    rows += [row("ct_all", 9.0, "devices/token", layer=0, rank=-1)]        # the probe's: not the eval's C_T
    ctx = {**_context(system, "olmoe_proxy", "finetune", 4, 16, 4, 32, 16), "label": label,
           "run_id": f"t/{label}/{steps}", "config_hash": f"{label}{steps}"}
    write_results(make_frame(rows, ctx), run_dir)


def test_lossy_front_table_front_and_ratios(tmp_path):
    from analysis.load import load_runs
    from analysis.figures.lossy_front import build, pareto
    points = [("naive", "naive", 0, 7.0, 6000.0, 100.0, 16), ("occult", "standard", 2, 5.9, 4000.0, 80.0, 12),
              ("naive", "naive_int8", 2, 5.95, 1600.0, 90.0, 16), ("naive", "naive_int8", 0, 6.5, 1600.0, 90.0, 16),
              ("lsh", "lsh_4", 2, 6.2, 1000.0, 70.0, 4), ("lsh", "lsh_4", 0, 6.1, 1000.0, 70.0, 4)]
    for i, p in enumerate(points):
        lossy_run(tmp_path / f"run{i}", *p)
    (section,) = build(load_runs([tmp_path]), tmp_path)
    assert (tmp_path / "lossy_front.png").is_file() and (tmp_path / "lossy_front.csv").is_file()
    table = dict(section.tables)["lossy_front"]
    lsh = table[(table.arm == "lsh_4") & ~table.finetuned].iloc[0]
    assert lsh.family == "lsh" and lsh.pydoc_bytes_per_token == pytest.approx(1000.0)
    assert lsh.time_vs_naive == pytest.approx(0.7) and lsh.ct_all == pytest.approx(2.0)
    assert lsh.projected_vs_naive < 1.0         # a quarter of naive's rows: less to move
    front = "".join(section.text)
    # standard (4000 B, 5.9), naive_int8 tuned (1600 B, 5.95), lsh untuned (1000 B, 6.1) beat the rest
    assert front.split("fewest bytes first): ")[1].startswith("lsh_4 (no ft), naive_int8, standard.")
    assert list(pareto([3, 1, 2, 1], [1, 3, 2, 2])) == [3, 0]       # (2, 2): as good a loss, more bytes


def test_tutel_overlap_table_reads_degrees_padding_and_ratios(tmp_path):
    from analysis.load import load_runs
    from analysis.figures.tutel_overlap import overlap_table

    def tutel_run(degree, padding, a2a_ms):
        df = layer_run("tutel", 4, 8, 3.6, a2a_ms, 20)
        options = json.dumps({"a2a_ffn_overlap_degree": degree, "capacity_factor": 0.0}, sort_keys=True)
        df = df.assign(system_options=options, a2a_ffn_overlap_degree=degree, impl="library", run_id=f"t/tutel/{degree}")
        context = {k: df[k].iloc[0] for k in _context("tutel", "layer_small", "layer", 4, 16, 8, 32, 16)}
        pad = make_frame([row("padding_rows", padding, "rows", layer=0, rank=r) for r in range(4)], context)
        return pd.concat([df, pad], ignore_index=True)

    write_results(layer_run("naive", 4, 8, 3.6, 2.0, 8), tmp_path / "naive")
    for degree, padding, a2a_ms in ((1, 100, 3.0), (4, 150, 3.0)):
        write_results(tutel_run(degree, padding, a2a_ms), tmp_path / f"tutel_{degree}")
    table = overlap_table(load_runs([tmp_path])).set_index(["system", "degree"], drop=False)
    assert list(table.system) == ["naive", "tutel", "tutel"]
    tutel4 = table.loc[("tutel", 4)]
    assert tutel4.padding_rows == 600 and tutel4.padding_rows_vs_degree_1 == pytest.approx(1.5)
    assert tutel4.layer_fwd_bwd_ms_vs_naive == pytest.approx((8 * 3.0 + 8) / (8 * 2.0 + 8))
    assert tutel4.dispatch_remote_MB_vs_naive == pytest.approx(20 / 8)


def test_strategies_report_reads_whole_model_runs_beside_layer_runs(synthetic_sweep, tmp_path):
    """A sweep that also holds layer runs (several per system, e.g. the pipelining study's
    degrees) still gives one table row per (model, task, system) of its whole-model runs."""
    from analysis.load import load_runs
    from analysis.figures.strategies import strategies_table
    table = strategies_table(load_runs([synthetic_sweep]))
    prefill = table[table.task == "prefill"].set_index("system")
    assert set(prefill.index) == {"naive", "occult", "tutel"} and not table.duplicated(["model", "task", "system"]).any()
    assert prefill.loc["naive", "measured_vs_naive"] == pytest.approx(1.0)
    assert prefill.loc["occult", "measured_vs_naive"] < 1.0 < prefill.loc["tutel", "measured_vs_naive"]


# ---------------------------------------------------------------------------
# a run is its run_id: two configs of one system in one folder stay two runs
# ---------------------------------------------------------------------------

def _one_world(frames: list) -> pd.DataFrame:
    """Several runs' rows as one world writes them: one frame, one folder, a run_id each."""
    return pd.concat(frames, ignore_index=True)


def _configs_of_occult(make, **kw) -> list:
    """naive and two configs of occult (their payloads differ), each with its own run_id."""
    out = []
    for system, payload in (("naive", "fp32"), ("occult", "fp32"), ("occult", "int8")):
        options = json.dumps({"payload": payload}, sort_keys=True)
        run = make(system, **kw)
        out.append(run.assign(run_id=f"w/{run.task.iloc[0]}/{system}/{payload}", system_options=options))
    return out


def test_two_configs_of_one_system_in_one_folder_stay_two_rows(tmp_path):
    """Every summary and figure table keys on run_id: two configs of occult written into one
    folder (one world), and in one sweep, are two rows everywhere, never merged by folder."""
    from analysis.figures import bench, fig1_latency, fig12_scaling, table1_ct_runtime
    from analysis.figures.strategies import strategies_table
    from analysis.load import load_runs
    from analysis.summary import layer_table, run_table, task_latency, with_ratios

    sweep = tmp_path / "sweep"
    write_results(_one_world(_configs_of_occult(lambda s: layer_run(s, 4, 8, 3.4, 1.0, 16))), sweep / "layer")
    write_results(_one_world(_configs_of_occult(lambda s: prefill_run(s, 100.0, 16))), sweep / "prefill")
    df = load_runs([sweep])
    assert df.run_dir.nunique() == 2 and df.run_id.nunique() == 6

    def two_occults(table, name):
        occult = table[table.system == "occult"]
        assert len(occult) == 2 * max(1, table.task.nunique() if "task" in table else 1), name
        return occult

    two_occults(run_table(df), "run_table")
    two_occults(with_ratios(run_table(df)), "with_ratios")
    assert len(layer_table(df).query("system == 'occult'")) == 2
    assert len(task_latency(df).query("system == 'occult'")) == 2
    for module, table in ((fig1_latency, "fig1_measured"), (fig1_latency, "fig1_projected"),
                          (table1_ct_runtime, "table1_runs"), (fig12_scaling, "fig12_measured")):
        (section,) = module.build(df, tmp_path)
        shown = dict(section.tables)[table]
        assert len(shown[shown.system == "occult"]) == 2, table
    assert len(strategies_table(df).query("system == 'occult'")) == 2
    proj = projection.projected_totals(projection.project_runs(df, profiles.load_profile("sim_a6000x4")))
    assert proj.query("system == 'occult'").run_id.nunique() == 4           # layer and prefill, two each
    # the benchmark: both configs compared in one world, each its own row and ratio to naive
    world = _one_world(_configs_of_occult(lambda s: layer_run(s, 4, 8, 3.4, 1.0, 16))).assign(task="bench")
    table = bench.ratio_table(world, "naive")
    assert len(table[table.system == "occult"]) == 2 and table.layer_fwd_ms_ratio.notna().all()
    bench_model_run(tmp_path / "model", "prefill", 100.0, 90.0, {"naive": 10.0, "occult": 4.0})
    rows = pd.read_parquet(tmp_path / "model" / "results.parquet")
    other = rows[rows.system == "occult"].assign(run_id="m/prefill/occult/int8", system_options='{"payload": "int8"}')
    write_results(pd.concat([rows, other], ignore_index=True), tmp_path / "model")
    models = bench.model_table(load_runs([tmp_path / "model"]))
    assert len(models[models.system == "occult"]) == 2 and (models.latency_ratio.dropna() > 0).all()


def test_publish_writes_the_stamped_results_file(synthetic_sweep, tmp_path, monkeypatch):
    """The publish step (``python -m analysis.report RUNS --publish DIR``) on a small sweep:
    DIR/<experiment>.md stamped with the experiment, the commands, the runs' commit and
    dates and the machine, then the report's own tables and figures."""
    import subprocess
    import sys

    monkeypatch.setattr("analysis.figures.fig3_lcc.LCC_DRAWS", 2)
    docs = tmp_path / "docs"
    cmd = [sys.executable, "-m", "analysis.report", str(synthetic_sweep), "--out", str(tmp_path / "r"),
           "--figures", "table1_ct_runtime,fig12_scaling", "--publish", str(docs)]
    proc = subprocess.run(cmd, cwd=Path(CONF).parent, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (docs / "synthetic.md").read_text()
    df = pd.read_parquet(next(synthetic_sweep.rglob("results.parquet")))
    assert text.startswith("# Results: synthetic")
    assert "| experiment | `synthetic` |" in text and "`python run.py experiment=synthetic`" in text
    assert f"--publish {docs}" in text                                        # the command that published it
    assert f"| runs' commit | {df.git_commit.iloc[0]} |" in text
    assert f"| runs' dates | {df.time.iloc[0][:10]}" in text
    assert f"| machine | {df.device.iloc[0]} ({df.hostname.iloc[0]})" in text
    report = (tmp_path / "r" / "report.md").read_text()

    def table(markdown: str, name: str) -> list:
        """The Markdown table under a report's ``**name**`` line."""
        after = markdown.split(f"**{name}** (`{name}.csv`)\n\n", 1)[1].splitlines()
        return after[:next(i for i, line in enumerate(after) if not line.startswith("|"))]

    for name in ("summary", "table1_fit", "table1_runs", "fig12_measured", "fig12_projected"):
        assert len(table(text, name)) > 2 and table(text, name) == table(report, name), name   # the report's
    assert "![table1_ct_runtime](synthetic/table1_ct_runtime.png)" in text
    assert (docs / "synthetic" / "table1_ct_runtime.png").is_file()


def test_readme_is_a_manual_that_links_every_result():
    """The README stays a manual (at most 350 lines) and links every docs/results file;
    the default study's and the benchmark's are generated (stamped), not copied."""
    root = Path(CONF).parent
    readme = (root / "README.md").read_text()
    assert len(readme.splitlines()) <= 350
    results = sorted((root / "docs" / "results").glob("*.md"))
    for name in {p.name for p in results} | {"default_study.md", "bench.md"}:
        assert f"(docs/results/{name})" in readme, name
    for name in ("default_study", "bench"):
        path = root / "docs" / "results" / f"{name}.md"
        if path.is_file():
            text = path.read_text()
            assert text.startswith(f"# Results: {name}") and "| runs' commit |" in text and "Copied" not in text


def test_a_summary_shows_every_column_in_which_its_runs_differ(tmp_path):
    """Two naive prefill runs that differ only in their batch size (as in the default study)
    are two rows with their batch sizes in the summary, not two rows that look alike."""
    from analysis.report import overview
    from occult.records import CONTEXT_COLUMNS, make_frame, row, write_results

    for batch in (4, 8):
        context = {c: 0 for c in CONTEXT_COLUMNS}
        context.update(run_id=f"default_study/naive/olmoe_proxy/prefill/cpu4/b{batch}", experiment="default_study",
                       system="naive", impl="harness", label="", system_options="{}", model="olmoe_proxy",
                       init="random", task="prefill", cluster="cpu4", routing="router", batch_size=batch,
                       seq_len=128, tokens_per_rank=-1)
        rows = [row("ttft", 10.0 * batch, "ms", phase="prefill", sample=0), row("ct_all", 3.0, "devices/token")]
        write_results(make_frame(rows, context), tmp_path / f"b{batch}")
    df = load_runs([tmp_path])
    section = overview(df, tmp_path)
    summary = dict(section.tables)["summary"]
    assert "batch_size" in summary and sorted(summary.batch_size) == [4, 8]
    assert "seq_len" not in summary                   # the same in both: not shown


def test_report_words_and_tables_a_person_reads(tmp_path):
    """The summary shows only the options in which its rows differ (the CSV keeps the JSON), no
    folder paths, and says "measured on this machine" only of timed runs, "simulated" of
    clock=simulated ones; a long per-point table goes to its CSV only."""
    import json

    from analysis.report import overview
    from analysis.sections import Section, section_lines
    from occult.records import CONTEXT_COLUMNS, make_frame, row, write_results

    def one(name, system, options, clock, rows):
        context = {c: 0 for c in CONTEXT_COLUMNS}
        context.update(run_id=f"x/{name}", experiment="x", system=system, impl="harness", label="", model="m",
                       system_options=json.dumps(options), init="random", task="layer", cluster="cpu4",
                       routing="uniform", clock=clock, tokens_per_rank=8)
        write_results(make_frame(rows, context), tmp_path / "runs" / name)

    defaults = {"dispatch_mode": "dynamic", "payload": "none", "fused": True}
    one("a", "occult", {**defaults, "budget": 1}, "host", [row("ct_all", 2.0, "devices/token")])
    one("b", "occult", {**defaults, "budget": 2}, "host", [row("ct_all", 3.0, "devices/token")])
    df = load_runs([tmp_path / "runs"])
    section = overview(df, tmp_path)
    lines = "\n".join(section_lines(section, tmp_path))
    assert "| budget=1 " in lines and "dispatch_mode" not in lines and str(tmp_path / "runs") not in lines
    assert json.loads(pd.read_csv(tmp_path / "summary.csv").system_options.iloc[0])["dispatch_mode"] == "dynamic"
    assert "measured on this machine" in section.text[1] and "simulated" not in section.text[1]
    one("c", "naive", {}, "simulated", [row("ct_all", 4.0, "devices/token")])
    words = overview(load_runs([tmp_path / "runs"]), tmp_path).text[1]
    assert "the 2 timed run(s) (clock=host)" in words and "The 1 run(s) with clock=simulated timed nothing" in words
    one("a", "naive", {}, "simulated", [row("ct_all", 4.0, "devices/token")])
    one("b", "naive", {}, "simulated", [row("ct_all", 4.0, "devices/token")])
    words = overview(load_runs([tmp_path / "runs"]), tmp_path).text[1]
    assert "measured" not in words and "simulated" in words
    long = pd.DataFrame({"tokens": range(100), "lcc": range(100)})
    lines = section_lines(Section("t", data=[("curves", long)]), tmp_path)
    assert "**curves**: 100 rows in [curves.csv](curves.csv)" in "\n".join(lines) and "| 99 " not in "\n".join(lines)
    assert len(pd.read_csv(tmp_path / "curves.csv")) == 100


def test_a_summary_tells_apart_rows_that_differ_in_a_task_setting_or_in_one_systems_options(tmp_path):
    """Rows that differ only in a task setting no column shows (fine-tuning steps 0 and 100, as
    in experiment=lossy_front) show it; a system's options are compared with its own other
    configs only (naive's defaults are not listed because occult's differ)."""
    import json

    from analysis.sections import readable
    from analysis.summary import run_table
    from occult.records import CONTEXT_COLUMNS, make_frame, row, write_results, write_run_config

    def one(name, system, options, steps):
        context = {c: 0 for c in CONTEXT_COLUMNS}
        context.update(run_id=f"x/{name}", experiment="x", system=system, impl="harness", label="", model="m",
                       system_options=json.dumps(options), init="random", task="finetune", cluster="cpu4",
                       routing="router", clock="host", tokens_per_rank=8)
        write_results(make_frame([row("ct_all", 2.0, "devices/token")], context), tmp_path / name)
        write_run_config(tmp_path / name, {"task.name": "finetune", "task.steps": steps, "system.name": system})

    one("n0", "naive", {"payload": "none"}, 0)
    one("n1", "naive", {"payload": "none"}, 100)
    one("o1", "occult", {"budget": 1, "payload": "none"}, 100)
    one("o2", "occult", {"budget": 2, "payload": "none"}, 100)
    table = run_table(load_runs([tmp_path])).sort_values("run_id")
    shown = readable(table).set_index("run_id").options
    assert shown.to_dict() == {"x/n0": "task.steps=0", "x/n1": "task.steps=100",
                               "x/o1": "task.steps=100, budget=1", "x/o2": "task.steps=100, budget=2"}
    # a run of another task: its own fields are not compared with the finetune runs' (nor name / schema)
    context = {c: 0 for c in CONTEXT_COLUMNS}
    context.update(run_id="x/p", experiment="x", system="naive", impl="harness", label="", model="m",
                   system_options=json.dumps({"payload": "none"}), init="random", task="prefill", cluster="cpu4",
                   routing="router", clock="host", tokens_per_rank=8)
    write_results(make_frame([row("ct_all", 2.0, "devices/token")], context), tmp_path / "p")
    write_run_config(tmp_path / "p", {"task.name": "prefill", "task.schema": "occult.tasks.prefill.Config",
                                      "task.batch_size": 4, "system.name": "naive"})
    table = run_table(load_runs([tmp_path])).sort_values("run_id")
    shown = readable(table).set_index("run_id").options
    assert shown["x/p"] == "" and shown["x/n0"] == "task.steps=0" and shown["x/o2"] == "task.steps=100, budget=2"
    # one config per system and no system_options column: the settings still tell the rows apart, no path shown
    printed = readable(table[table.system == "naive"].drop(columns=["system_options"]))
    assert list(printed.options) == ["task.steps=0", "task.steps=100", ""] and "run_dir" not in printed
