"""The scale study's parts: per-rank totals priced as the peer pairs are, task=place, the
study's and the advisor's tables, sampled layers, node profiles, and their bad input."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from occult.errors import ConfigError
from occult.validate import validate
from test_plans import cfg_with, simulated_rows


def _frame(rows: pd.DataFrame, **context) -> pd.DataFrame:
    """Simulated rows with the context columns the projection reads."""
    base = {"run_id": "r", "model": "layer_small", "world_size": 16, "devices_per_node": 8, "num_experts": 64,
            "top_k": 8, "hidden_size": 256, "expert_ffn_size": 128, "tokens_per_rank": 32, "dtype": "float32",
            "task": "simulate", "system": "x", "label": "", "clock": "simulated", "system_options": "{}",
            "routing": "uniform", "experiment": "t", "impl": "harness", "cluster": "c", "init": "random",
            "batch_size": -1, "seq_len": -1, "seed": 0, "config_hash": "h", "placement": "", "migration": False, "dedup": "", "trace_sha256": "",
            **context}
    return rows.assign(**base)


@pytest.mark.timeout(120)
def test_per_rank_totals_price_as_the_peer_pairs_do_and_count_the_messages():
    """A world simulated without peer rows (task.peer_rows=false) projects to the same times as
    the same world with them, on a profile of two nodes; its messages are the peer pairs with rows."""
    from occult.ep.profiles import load_profile, profile_fields, profile_from_dict

    from analysis.projection import project_runs, projected_totals
    profile = load_profile("sim_h100_nodes")
    # the same, with a price per message and NVLink and the NIC in series
    priced = profile_from_dict({**profile_fields("sim_h100_nodes"), "name": "messages_in_series",
                                "intra_node_message_us": 1.0, "inter_node_message_us": 3.0, "overlap_links": False})
    for system in ("naive", "hierarchical", "allgather", "tutel"):
        args = ("cluster.world_size=16", "cluster.devices_per_node=8", f"system={system}", "task.tokens_per_rank=32",
                "model.dtype=bfloat16", "task.backward=false")
        peer = _frame(simulated_rows(*args), system=system, dtype="bfloat16")
        totals = _frame(simulated_rows(*args, "task.peer_rows=false"), system=system, dtype="bfloat16")
        assert "bytes" not in set(totals.metric)
        a, b = (projected_totals(project_runs(d, profile)) for d in (peer, totals))
        assert a.a2a_ms_per_layer.iloc[0] > 0
        assert a.a2a_ms_per_layer.iloc[0] == pytest.approx(b.a2a_ms_per_layer.iloc[0], rel=1e-12), system
        c, d = (projected_totals(project_runs(x, priced)) for x in (peer, totals))
        assert c.a2a_ms_per_layer.iloc[0] == pytest.approx(d.a2a_ms_per_layer.iloc[0], rel=1e-12), system
        assert c.a2a_ms_per_layer.iloc[0] > a.a2a_ms_per_layer.iloc[0], system        # messages cost, links add
        sent = peer[(peer.metric == "rows") & (peer.value > 0) & (peer.src_rank != peer.dst_rank)
                    & (peer["pass"] == "forward")]
        msgs = totals[(totals.metric == "messages") & (totals["pass"] == "forward")]
        assert len(sent) == msgs.value.sum() > 0, system
        cross = sent[sent.src_rank // 8 != sent.dst_rank // 8]
        assert len(cross) == totals[totals.metric == "inter_node_messages"].value.sum(), system


def test_a_point_is_named_by_its_system_and_hierarchical_by_its_dedup_column():
    """The scale study's (and the advisor's) strategy names read the ``dedup`` column, not the
    ``system_options`` JSON (a setting is a column, occult/columns.py): a frame whose JSON says
    otherwise is named by its column."""
    import json

    from analysis.figures.scale_study import point_table
    rows = simulated_rows("cluster.world_size=4", "cluster.devices_per_node=2", "task.tokens_per_rank=8",
                          "task.backward=false", "system=hierarchical", "system.dedup=node")
    for system, dedup, strategy in (("hierarchical", "node", "hierarchical_node"),
                                    ("hierarchical", "device", "hierarchical_device"), ("naive", "", "naive")):
        frame = _frame(rows, system=system, dedup=dedup, system_options=json.dumps({"dedup": "elsewhere"}))
        assert point_table(frame).strategy.tolist() == [strategy]


def test_totals_are_not_resized_to_another_width():
    from occult.ep.profiles import load_profile

    from analysis.projection import Target, project_runs
    rows = _frame(simulated_rows("cluster.world_size=16", "cluster.devices_per_node=8", "task.tokens_per_rank=8",
                                 "task.peer_rows=false", "task.backward=false"))
    with pytest.raises(ValueError, match="projected at the run's own width"):
        project_runs(rows, load_profile("sim_h100_nodes"), Target("olmoe", 2048, 1024, 16))


@pytest.mark.timeout(120)
def test_place_writes_an_artifact_no_worse_than_contiguous_and_occult_placed_runs_on_it(tmp_path):
    """swap_search starts from the contiguous placement among others: on the profiling tokens
    its C_T is at most the contiguous one's (without a load cap; with one, spreading Zipf's
    popular experts raises C_T, as the rows would show)."""
    from occult.runner import run
    cfg = cfg_with("task=place", "task.routing=zipf", "cluster.world_size=16", "task.total_tokens=2048",
                   "task.load_cap=null", "task.time_limit_s=1", "model=olmoe", "task.sample_layers=2",
                   f"out_dir={tmp_path / 'p'}")
    df = pd.read_parquet(run(cfg, tmp_path / "p"))
    ct = df[df.metric == "ct_all"].pivot_table(index="layer", columns="phase", values="value")
    assert list(ct.index) == [0, 15]                               # the first and the last MoE layer
    assert (ct.swap_search <= ct.contiguous).all()
    artifact = tmp_path / "p" / "placements.json"
    sim = simulated_rows("model=olmoe", "cluster.world_size=16", "task.routing=zipf", "task.sample_layers=2",
                         "system=occult_placed", f"system.placement_file={artifact}", "task.tokens_per_rank=16",
                         "task.peer_rows=false", "task.backward=false")
    assert sorted(sim[sim.metric == "ct_all"].layer.unique()) == [0, 15]


def test_a_synthetic_source_is_drawn_once_and_resampled_for_a_larger_world():
    rows = simulated_rows("cluster.world_size=4", "task.tokens_per_rank=32", "task.synthetic_tokens=64",
                          "task.peer_rows=false", "task.backward=false")
    flag = lambda name: float(rows[rows.metric == name].value.iloc[0])
    assert flag("source_size") == 64 and flag("resampled_tokens") == 1.0
    assert rows[(rows.metric == "tokens") & (rows["rank"] == -1)].value.iloc[0] == 128


def test_sampled_layers_are_evenly_spaced():
    from omegaconf import OmegaConf

    from occult.tasks.world import task_layers
    model = OmegaConf.create({"first_k_dense": 3, "num_layers": 61})
    assert task_layers(model, 0) == list(range(3, 61))
    assert task_layers(model, 1) == [32] and task_layers(model, 2) == [3, 60] and task_layers(model, 3) == [3, 32, 60]
    assert task_layers(model, 100) == list(range(3, 61))


@pytest.mark.parametrize("overrides, line", [
    (["task.total_tokens=1000", "cluster.world_size=16"],
     r"^task.total_tokens=1000 does not share out over cluster.world_size=16 ranks: give a multiple of 16"),
    (["model=deepseek_v3", "task.routing=router", "task.routers=olmoe_proxy", "cluster.world_size=8"],
     r"^task.routers=olmoe_proxy routes E=64, top-8 in 4 MoE layers; model=deepseek_v3 needs E=256"),
    (["task.routing=router", "task.routers=layer_small"], r"^task.routers=layer_small: a layer-only config has no routers"),
    (["task.sample_layers=-1"], r"^task.sample_layers=-1: must be at least 0"),
    (["task.routers=olmoe_proxy"], r"^task.routers="),
])
def test_scale_options_refuse_bad_input_in_one_line(overrides, line):
    with pytest.raises(ConfigError, match=line) as err:
        validate(cfg_with("task=simulate", "task.routing=uniform", *overrides))
    assert "\n" not in str(err.value)


def test_place_refuses_bad_input_in_one_line():
    for overrides, line in ((["task.optimiser=annealing"], r"^task.optimiser='annealing': allowed values are"),
                            (["task.load_cap=0.5"], r"^task.load_cap=0.5: allowed values are null"),
                            (["task.time_limit_s=0"], r"^task.time_limit_s=0.0: must be > 0")):
        with pytest.raises(ConfigError, match=line) as err:
            validate(cfg_with("task=place", "task.routing=uniform", *overrides))
        assert "\n" not in str(err.value)


def test_node_profiles_cover_whole_nodes_only():
    from occult.ep import profiles
    for name in ("sim_h100_nodes", "sim_h200_nodes"):
        p = profiles.load_profile(name)
        assert p.sizes() == [8, 16, 32, 64, 128, 256] and p.at(256) == p.at(8) and p.memory_GB > 0
        with pytest.raises(ValueError, match=r"has links for world sizes \[8, 16"):
            p.at(12)
    with pytest.raises(ValueError, match="world_sizes=\\[12\\]: allowed values are positive world sizes that fill whole"):
        profiles.profile_from_dict({"name": "t", "world_sizes": [12], "devices_per_node": 8, "intra_node_GBps": 1.0})


def test_crossovers_read_where_the_answer_changes():
    from analysis.figures.scale_study import crossovers
    rows = []
    for P, times in ((8, {"naive": 3, "occult": 1, "hierarchical_node": 2, "allgather": 2}),
                     (16, {"naive": 3, "occult": 2, "hierarchical_node": 1.5, "allgather": 4}),
                     (32, {"naive": 3, "occult": 3, "hierarchical_node": 1, "allgather": 9})):
        rows += [{"model": "m", "workload": "prefill", "world_size": P, "strategy": s, "h ms": t} for s, t in times.items()]
    c = crossovers(pd.DataFrame(rows), ["h"]).iloc[0]
    assert c["best by P"] == "8: occult, 16: hierarchical_node, 32: hierarchical_node"
    assert c["hierarchical beats occult from P"] == 16 and c["allgather beats naive up to P"] == 8


def test_project_command_takes_a_profile_path_and_names_its_files_by_the_profile(tmp_path, monkeypatch, capsys):
    """``python -m analysis.project RUN --profile path/to/profile.yaml``: the CSV files are named
    by the profile's ``name`` (a path in a file name was a folder that did not exist)."""
    import sys

    from analysis import project
    from occult.ep.profiles import profile_path
    from occult.records import write_results
    rows = _frame(simulated_rows("cluster.world_size=16", "cluster.devices_per_node=8", "task.tokens_per_rank=8",
                                 "task.peer_rows=false", "task.backward=false"))
    write_results(rows.drop(columns=[c for c in ("run_dir",) if c in rows]), tmp_path / "run")
    mine = tmp_path / "profiles" / "two_nodes.yaml"
    mine.parent.mkdir()
    mine.write_text(profile_path("sim_h100_nodes").read_text().replace("name: sim_h100_nodes", "name: my_nodes"))
    monkeypatch.setattr(sys, "argv", ["project", str(tmp_path / "run"), "--profile", str(mine)])
    project.main()
    assert sorted(p.name for p in (tmp_path / "run").glob("projected_*")) == ["projected_my_nodes.csv",
                                                                              "projected_my_nodes_totals.csv"]
    totals = pd.read_csv(tmp_path / "run" / "projected_my_nodes_totals.csv")
    assert (totals.source == "projected").all() and (totals.profile == "my_nodes").all()
    assert "projected_my_nodes_totals.csv" in capsys.readouterr().out


def test_the_categorical_loader_gives_the_study_the_same_tables(tmp_path):
    """analysis.load reads the label columns as categoricals (the study's 4.3 M rows fit in its
    memory budget that way); the study's tables are those of the same rows as strings."""
    from analysis.figures.scale_study import projected, study_table
    from analysis.load import load_runs
    from occult.records import make_frame, write_results
    for system, per_node in (("naive", 8), ("occult", 8), ("naive", 16)):
        rows = simulated_rows("cluster.world_size=16", f"cluster.devices_per_node={per_node}", f"system={system}",
                              "task.tokens_per_rank=16", "task.peer_rows=false", "task.backward=false")
        context = _frame(rows.iloc[:1], run_id=f"{system}{per_node}", system=system, devices_per_node=per_node,
                         label="decode" if per_node == 8 else "one_node").drop(columns=rows.columns).iloc[0].to_dict()
        write_results(make_frame(rows.to_dict("records"), context), tmp_path / f"{system}{per_node}")
    df = load_runs(tmp_path)
    assert isinstance(df.metric.dtype, pd.CategoricalDtype) and not isinstance(df.run_id.dtype, pd.CategoricalDtype)
    # the same files read as plain strings, as the loader before categoricals did
    plain = pd.concat([pd.read_parquet(f).assign(run_dir=str(f.parent)) for f in sorted(tmp_path.rglob("results.parquet"))],
                      ignore_index=True)
    assert not any(isinstance(plain[c].dtype, pd.CategoricalDtype) for c in plain)
    profiles = ["sim_h100_nodes", "sim_gb200_nvl72"]
    a, b = study_table(df, profiles), study_table(plain, profiles)
    pd.testing.assert_frame_equal(a, b)
    assert len(a) == 3 and a["sim_h100_nodes ms"].notna().sum() == 2          # nodes of 8 onto nodes of 8 only
    assert set(projected(df, ["sim_gb200_nvl72"]).run_id) == {"naive16"}       # one node of 16 onto one NVL72


def test_a_synthetic_draw_is_cached_under_everything_it_depends_on(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    from occult.tasks import world
    monkeypatch.setattr(world, "ROUTING_CACHE", tmp_path)
    cfg = OmegaConf.create({"seed": 0, "model": {"num_experts": 16, "top_k": 2, "norm_topk_prob": True,
                                                 "first_k_dense": 0, "num_layers": 4},
                            "task": {"routing": "uniform", "zipf_s": 1.2, "synthetic_tokens": 64, "sample_layers": 1}})
    first = world.synthetic_source(cfg)
    assert len(list(tmp_path.glob("synthetic_*.pt"))) == 1
    again = world.synthetic_source(cfg)                                    # read back: the same tensors
    for a, b in zip(first[2], again[2]):
        assert torch.equal(a, b)
    keys = {world.synthetic_key(cfg, 0), world.synthetic_key(cfg, 1)}
    for change in ({"seed": 1}, {"task": {"synthetic_tokens": 128}}, {"model": {"top_k": 4}},
                   {"task": {"routing": "zipf"}}, {"model": {"norm_topk_prob": False}}):
        keys.add(world.synthetic_key(OmegaConf.merge(cfg, change), 0))
    assert len(keys) == 7


def test_the_proxies_a_sweep_loads_are_pretrained_before_its_points(tmp_path, monkeypatch, caplog):
    """Before the first point, one config per checkpoint identity is composed and the missing
    proxies are announced (all of them, then each) and pre-trained, their time recorded apart."""
    import json
    import logging

    from occult import runner
    composed, trained = [], []
    monkeypatch.setattr(runner, "build_spec", lambda cfg, out, digest: cfg)
    monkeypatch.setattr(runner, "untrained_proxies", lambda spec: [spec] if spec.model.name.endswith("_proxy") else [])
    import occult.tasks.pretrain as pretrain
    monkeypatch.setattr(pretrain, "proxy_dir", lambda s: tmp_path / f"{s.model.name}-key")
    monkeypatch.setattr(pretrain, "expected_minutes", lambda s: 2.0)
    monkeypatch.setattr(pretrain, "announce", lambda s: f"pre-training model={s.model.name}")
    monkeypatch.setattr(pretrain, "ensure_trained", lambda s: trained.append(s.model.name))

    def compose(overrides):
        composed.append(overrides)
        model = next(o.split("=")[1] for o in overrides if o.startswith("model="))
        from types import SimpleNamespace
        return SimpleNamespace(model=SimpleNamespace(name=model))
    points = [[f"model={m}", f"system={s}", "cluster.world_size=8"] for m in ("olmoe_proxy", "olmoe", "mixtral_proxy")
              for s in ("naive", "occult")]
    with caplog.at_level(logging.INFO, logger="occult"):
        done = runner.before_sweep(points, compose, tmp_path)
    assert len(composed) == 3 and trained == ["olmoe_proxy", "mixtral_proxy"]
    text = caplog.text
    assert "2 proxy checkpoint(s)" in text and "olmoe_proxy (about 2 min)" in text
    assert text.index("2 proxy checkpoint(s)") < text.index("pre-training model=olmoe_proxy")
    from occult.records import SWEEP_COST_FILE
    assert json.loads((tmp_path / SWEEP_COST_FILE).read_text())["setup"] == done
    assert [d["what"] for d in done] == ["pre-trained olmoe_proxy (olmoe_proxy-key)",
                                         "pre-trained mixtral_proxy (mixtral_proxy-key)"]


def test_the_report_states_what_the_sweep_cost(tmp_path):
    import json

    from analysis.report import cost_section
    (tmp_path / "sweep_cost.json").write_text(json.dumps(
        {"setup": [{"what": "pre-trained x_proxy (x_proxy-1)", "seconds": 90.0}], "points_s": 600.0,
         "points_peak_rss": 1.5e9, "points_cpu_s": 300.0, "report_s": 120.0, "report_peak_rss": 3.25e9}))
    text = " ".join(cost_section([tmp_path])[0].text)
    assert "pre-trained x_proxy (x_proxy-1) in 1.5 min (not in the points' time)" in text
    assert "The points took 10.0 min" in text and "5.0 min of CPU), peak memory 1.50 GB" in text
    assert "The report at the sweep's end took 2.0 min (CPU not recorded), peak memory 3.25 GB" in text
    from analysis.callbacks import TreeMemory
    import time
    memory = TreeMemory(every_s=0.01).start()
    busy = time.process_time() + 0.2
    while time.process_time() < busy:
        pass
    assert memory.stop() > 0 and memory.cpu_s >= 0.15
    assert cost_section([tmp_path / "none"]) == []


def test_a_checkpoint_digest_is_remembered_until_a_file_changes(tmp_path, monkeypatch):
    import hashlib
    import os

    from occult.tasks import world
    monkeypatch.setattr(world, "ROUTING_CACHE", tmp_path / "cache")
    ckpt = tmp_path / "proxy"
    ckpt.mkdir()
    (ckpt / "model.safetensors").write_bytes(b"weights")
    (ckpt / "config.json").write_bytes(b"{}")
    direct = lambda: hashlib.sha256(b"config.json{}model.safetensors" + (ckpt / "model.safetensors").read_bytes())
    assert world.checkpoint_digest(ckpt) == direct().hexdigest()
    assert (tmp_path / "cache" / "digests.json").is_file()
    assert world.checkpoint_digest(ckpt) == direct().hexdigest()           # remembered
    (ckpt / "model.safetensors").write_bytes(b"other weights")
    os.utime(ckpt / "model.safetensors", ns=(1, 1))
    assert world.checkpoint_digest(ckpt) == direct().hexdigest()           # changed: hashed again
