"""Occult beyond exact: placement from artifacts (exact, any placement), collaboration
pruning in the expert-parallel model (budget respected), config errors, and the
fine-tuning task (frozen set, MoE weights trained, replicas kept identical)."""
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from occult.collab import variants
from occult.config import register
from occult.dist import launch
from occult.ep import Placement, ct_all, devices_per_token, system_config
from occult.parity import run_model_grid
from occult.placement import files as placement_files
from occult.placement import save_placements
from occult.validate import ConfigError, validate
from variant_helpers import finetune_changes, pruned_routing

ROOT = Path(__file__).resolve().parent.parent
CONF = str(ROOT / "conf")
register()

PLACED = {"occult_placed": "occult.collab.variants.OccultPlacedDispatcher",
          "naive_placed": "variant_helpers.PlacedNaiveDispatcher"}
PRUNING = {"score": "occult.collab.variants.OccultScorePruningDispatcher",
           "similarity": "occult.collab.variants.OccultSimilarityPruningDispatcher"}


def tiny(name: str) -> dict:
    """The proxy's config with every width shrunk (E, K, shared experts, dense layers kept)."""
    m = OmegaConf.to_container(OmegaConf.load(ROOT / f"conf/model/{name}.yaml"))
    m.update(hidden_size=32, expert_ffn_size=16, num_layers=2, shared_expert_ffn_size=32, dense_ffn_size=64,
             init="random")
    return m


def moe_layers(model: dict) -> list:
    return list(range(model.get("first_k_dense", 0), model["num_layers"]))


def random_placements(E: int, P: int, layers: list, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {layer: Placement.from_groups(torch.randperm(E, generator=g).view(P, E // P).tolist()) for layer in layers}


def cfg_with(*overrides):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        return compose("config", overrides=list(overrides))


# ---------------------------------------------------------------------------
# placement
# ---------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_any_placement_keeps_outputs_and_gradients(tmp_path):
    P = 4
    jobs = []
    for i, name in enumerate(["qwen_moe_proxy", "deepseek_moe_proxy"]):     # E = 60, 64; a dense first layer
        m = tiny(name)
        path = tmp_path / f"{name}.json"
        save_placements(path, random_placements(m["num_experts"], P, moe_layers(m), seed=i), {"test": True})
        for system, target in PLACED.items():
            jobs.append(({"model": m, "system": {"name": system, "_target_": target, "placement_file": str(path)},
                          "seed": 1}, 2, 8))
    per_rank = launch(run_model_grid, P, (jobs,), timeout_s=220)
    for rank, results in enumerate(per_rank):
        for (cfg, _, _), res in zip(jobs, results):
            bad = {k: v for k, v in res["errors"].items() if not v < 2e-5}
            assert not bad, (rank, cfg["model"]["name"], cfg["system"]["name"], bad)


def test_occult_placed_reads_its_artifact_once(tmp_path, monkeypatch):
    E, P, layers = 64, 4, [0, 1, 3]
    placements = random_placements(E, P, layers, seed=5)
    path = tmp_path / "pl.json"
    save_placements(path, placements, {"optimiser": "test"})
    reads = []
    real = placement_files.load_placements
    monkeypatch.setattr(placement_files, "load_placements", lambda p: reads.append(p) or real(p))
    def placed(path):
        return system_config({"name": "occult_placed", "_target_": PLACED["occult_placed"],
                              "placement_file": str(path), "kernels": "torch"})

    for layer in layers:
        got = placed(path).layer_placement(layer, E, P)
        assert got.groups() == placements[layer].groups()
        assert torch.equal(got.device_E, placements[layer].device_E)
    assert len(reads) == 1, "the artifact must be read once per process"
    with pytest.raises(ValueError, match="no placement for MoE layer 2; it has layers \\[0, 1, 3\\]"):
        placed(path).layer_placement(2, E, P)
    with pytest.raises(ValueError, match="places 64 experts on 4 devices; this run has model.num_experts=64 "
                                         "on world size 2"):
        placed(path).layer_placement(0, E, 2)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="system.placement_file=.*bad.json.* is not a placement artifact"):
        placed(tmp_path / "bad.json").layer_placement(0, E, P)


@pytest.mark.parametrize("overrides, message", [
    (["system=occult_placed"], r"system.placement_file is not set"),
    (["system=occult_placed", "system.placement_file=/nonexistent/pl.json"],
     r"system.placement_file='/nonexistent/pl.json': no such file"),
])
def test_placed_config_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_with("model=olmoe_proxy", "cluster=cpu4", *overrides))


# ---------------------------------------------------------------------------
# pruning
# ---------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_pruned_ep_model_respects_the_budget(tmp_path):
    P = 4
    jobs, expect = [], []
    g = torch.Generator().manual_seed(0)
    for i, name in enumerate(["olmoe_proxy", "qwen_moe_proxy", "deepseek_moe_proxy"]):
        m = tiny(name)
        E = m["num_experts"]
        sim_path = tmp_path / f"{name}.npz"
        np.savez(sim_path, **{f"layer_{layer}": torch.randn(256, E, generator=g).numpy() for layer in moe_layers(m)})
        pl_path = tmp_path / f"{name}.json"
        placements = random_placements(E, P, moe_layers(m), seed=10 + i)
        save_placements(pl_path, placements, {})
        for kind, target in PRUNING.items():
            for budget in (1, 2):
                system = {"name": f"occult_prune_{kind}", "_target_": target, "budget": budget, "kernels": "torch"}
                if kind == "similarity":
                    system["similarity_file"] = str(sim_path)
                if budget == 2:          # pruning on top of a placement artifact
                    system["placement_file"] = str(pl_path)
                jobs.append({"model": m, "system": system, "seed": 2})
                expect.append((name, kind, budget, m["top_k"],
                               placements if budget == 2 else
                               {layer: Placement.contiguous(E, P) for layer in moe_layers(m)}))
    per_rank = launch(pruned_routing, P, (jobs,), timeout_s=220)
    for rank, results in enumerate(per_rank):
        for (name, kind, budget, K, placements), res in zip(expect, results):
            label = (rank, name, kind, budget)
            assert {layer for layer, _ in res["routing"]} == set(placements), label
            assert res["placements"] == {layer: pl.groups() for layer, pl in placements.items()}, label
            for layer, ids_TK in res["routing"]:
                pl = placements[layer]
                assert ids_TK.shape[1] == K, label
                assert int(devices_per_token(ids_TK, pl).max()) <= budget, label
                assert ct_all(ids_TK, pl) <= budget + 1e-9, label
                assert bool((torch.sort(ids_TK, 1).values.diff(dim=1) > 0).all()), f"{label}: K distinct"


@pytest.mark.parametrize("system", ["occult_prune_score", "occult_prune_sim"])
def test_infeasible_budget_is_a_config_error(system):
    # E=8 on 4 devices: 2 experts per device, so top-4 needs at least 2 devices
    with pytest.raises(ConfigError, match=r"system.budget=1 is infeasible: 1 device\(s\) x 2 experts per device "
                                          r"= 2 < top_k=4; the minimum feasible budget is 2"):
        validate(cfg_with(f"system={system}", "system.budget=1", "model.num_experts=8", "model.top_k=4",
                          "cluster=cpu4"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # (task=finetune: similarity pruning profiles its router there; other tasks need a file)
        validate(cfg_with(f"system={system}", "system.budget=2", "model=olmoe_proxy", "task=finetune",
                          "model.num_experts=8", "model.top_k=4", "cluster=cpu4"))


def test_pruning_options_are_checked_and_similarity_cached(tmp_path):
    with pytest.raises(ConfigError, match=r"system.device_score='mean': allowed values are \['sum', 'max'\]"):
        validate(cfg_with("system=occult_prune_score", "system.device_score=mean"))
    with pytest.raises(ConfigError, match=r"system.weight_rule='avg'"):
        validate(cfg_with("system=occult_prune_sim", "system.weight_rule=avg"))
    path = tmp_path / "logits.npz"
    logits = torch.randn(100, 8, generator=torch.Generator().manual_seed(1))
    np.savez(path, layer_0=logits.numpy())
    with pytest.raises(ConfigError, match=r"layer_0 has 8 experts, model.num_experts=64"):
        validate(cfg_with("system=occult_prune_sim", f"system.similarity_file={path}", "model=olmoe_proxy"))
    sim = variants.layer_similarity(str(path), 0, 8)
    assert variants.layer_similarity(str(path), 0, 8) is sim
    from occult.pruning import expert_similarity
    assert torch.allclose(sim, expert_similarity(logits))
    assert not system_config({"name": "occult_prune_sim", "_target_": PRUNING["similarity"], "budget": 2}).is_exact()
    assert system_config({"name": "occult_placed", "_target_": PLACED["occult_placed"],
                          "placement_file": "x"}).is_exact()


# ---------------------------------------------------------------------------
# fine-tuning
# ---------------------------------------------------------------------------


def _is_moe_param(name: str) -> bool:
    return ".mlp." in name and any(k in name for k in (".gate.", ".experts.", ".shared_expert", ".shared_experts."))


@pytest.mark.timeout(200)
def test_finetune_trains_moe_weights_only():
    cfg = {"model": tiny("qwen_moe_proxy"), "seed": 4,
           "system": {"name": "occult_prune_score", "_target_": PRUNING["score"], "budget": 1, "kernels": "torch"}}
    per_rank = launch(finetune_changes, 2, (cfg,), timeout_s=180)
    for rank, res in enumerate(per_rank):
        for name, changed in res["changed"].items():
            if _is_moe_param(name):
                assert res["trainable"][name] and changed, (rank, name)
            else:
                assert not res["trainable"][name] and not changed, (rank, name)
        assert any(".shared_expert." in n for n in res["changed"]), "the Qwen proxy has a shared expert"
        assert len(res["losses"]) == 2
    # replicated weights (routers, shared experts) stay identical across ranks
    assert per_rank[0]["checksum"] == per_rank[1]["checksum"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_finetune_task_end_to_end(tmp_path):
    from analysis.figures.fig7_pruning import accuracy_table
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "run.py", "system=occult_prune_sim", "model=olmoe_proxy", "task=finetune", "cluster=cpu2",
         "model.init=random", "model.hidden_size=32", "model.expert_ffn_size=16", "model.num_layers=2",
         "task.steps=2", "task.seq_len=32", "task.tokens_per_rank=256", "system.budget=1",
         "system.profile_tokens=512", "task.timing_iters=1", "label=similarity_1", f"hydra.run.dir={run_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    df = pd.read_parquet(run_dir / "results.parquet")
    for corpus in ("shakespeare", "pydoc"):
        got = df[df.phase == corpus]
        assert {"eval_loss", "eval_perplexity", "eval_accuracy", "ct_all", "ct_remote"} <= set(got.metric)
        assert got[got.metric == "ct_all"].value.max() <= 1.0 + 1e-9
        assert got[got.metric == "eval_tokens"].value.item() == 2 * 256
        # remote bytes by hand: one row per (token, remote device) each way, D + e float32
        # values out (hidden state, gate weights), D back; plus the small counts exchanges
        rows = (got[got.metric == "ct_remote"].value * 2 * 256).sum()
        payload = rows * (32 + 32 + 32) * 4
        remote = got[got.metric == "eval_remote_bytes"].value.item()
        assert payload > 0 and 0 <= remote - payload <= 0.02 * payload, (remote, payload)
    # the timing probe: a timed prefill and its collectives, beside the evaluation
    assert (df.metric == "ttft").any() and (df.metric == "bytes").any()
    assert (df.metric == "train_loss").sum() == 2
    assert (run_dir / "profile_router_logits.npz").is_file()
    table = accuracy_table(run_dir)
    assert table.arm.tolist() == ["similarity_1"] and table.ct_all.item() <= 1.0 + 1e-9   # the run's label


# ---------------------------------------------------------------------------
# the run's parity gate for the wrapped and the pruned systems
# ---------------------------------------------------------------------------


@pytest.mark.timeout(240)
def test_a_placed_adaptive_base_and_a_pruned_system_are_gated_with_their_placement(tmp_path):
    """adaptive_topk over occult_placed runs the layer with the artifact's placement (C_T
    differs from the contiguous run, the parity gate passes on that placement); a pruned
    run is gated with its identity switch (prune=false): parity_checked 1, not 0."""
    import helpers
    from occult.runner import build_spec

    P, E = 2, 8
    path = tmp_path / "pl.json"
    save_placements(path, {0: Placement.from_groups([[0, 2, 4, 6], [1, 3, 5, 7]])}, {"test": True})
    base = ["system=adaptive_topk", "system.threshold=0.0", "system.base=occult.collab.variants.OccultPlacedDispatcher",
            "task=layer", "model=layer_small", f"model.num_experts={E}", "model.top_k=2", f"cluster=cpu{P}",
            "model.hidden_size=16", "model.expert_ffn_size=8", "task.tokens_per_rank=64", "task.routing=router",
            "task.warmup=0", "task.iters=1"]
    configs = {"placed": cfg_with(*base, f"+system.base_options.placement_file={path}"),
               "contiguous": cfg_with(*base[:2], "system.base=occult", *base[3:]),
               "pruned": cfg_with(*base[3:], "system=occult_prune_score", "system.budget=1")}
    validate(configs["placed"])
    placement = system_config(configs["placed"].system).layer_placement(0, E, P)
    assert placement.groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    jobs = []
    for label, cfg in configs.items():
        spec = build_spec(cfg, tmp_path, "d")
        jobs.append((label, spec.task.entry, spec))
    rows = launch(helpers.task_rows, P, (jobs,), timeout_s=200)[0]

    def values(label, metric):
        return [r["value"] for r in rows[label] if r["metric"] == metric and r["rank"] in (-1, 0)]

    # the same tokens and router (the run's seed): the placement alone moves C_T
    assert values("placed", "tokens") == values("contiguous", "tokens")
    assert values("placed", "ct_all") != values("contiguous", "ct_all")
    for label in configs:
        assert values(label, "parity_checked") == [1.0], label
    assert values("pruned", "loss_off_parity") == [1.0]
    assert max(values("pruned", "ct_all")) <= 1.0 + 1e-12          # budget 1: one device per token
