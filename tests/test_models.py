"""The models: EP versions equal the single-device model (and, in the P = 2 world, sequence
migration equals plain EP and ScMoE's overlapped schedule its step-by-step run); each
family's router is the gate rule the harness states for it; checkpoints; KV-cache decode."""

import pytest
import torch
from omegaconf import OmegaConf

from occult.dist import launch
from occult.models.build import CheckpointError, hf_config, init_model, load_checkpoint, save_checkpoint
from occult.ep import GateRule, Placement
from occult.models.families import family_of, gate_rule
from occult.pruning import GroupLimit

from migration_helpers import models_and_migration

PROXIES = ["olmoe_proxy", "qwen_moe_proxy", "deepseek_moe_proxy", "deepseek_v3_proxy", "qwen3_moe_proxy",
           "mixtral_proxy", "scmoe_proxy"]
SYSTEMS = [("naive", "baselines.naive.NaiveDispatcher"), ("occult", "occult.collab.dispatcher.OccultDispatcher")]
SCMOE = ("scmoe", "baselines.scmoe.ScMoEDispatcher")


def tiny(name: str) -> dict:
    """The proxy's config with every width shrunk (E, K, shared experts, dense layers kept)."""
    m = OmegaConf.to_container(OmegaConf.load(f"conf/model/{name}.yaml"))
    m.update(hidden_size=32, expert_ffn_size=16, num_layers=2, shared_expert_ffn_size=32, dense_ffn_size=64)
    return m


# every family's full config, shrunk (router fields kept): the router each family's
# transformers class builds
FULL = ["olmoe", "qwen_moe", "deepseek_moe", "deepseek_v3", "kimi_k2", "deepseek_v4", "qwen3_moe", "qwen3_5_moe",
        "gpt_oss", "mixtral"]
TINY_ATTENTION = {"deepseek_v2": {"q_lora_rank": None, "kv_lora_rank": 8, "qk_nope_head_dim": 8,
                                  "qk_rope_head_dim": 8, "v_head_dim": 8},
                  "deepseek_v4": {"num_key_value_heads": 1, "head_dim": 16, "qk_rope_head_dim": 8,
                                  "index_n_heads": 2, "index_head_dim": 8, "o_groups": 2}}
TINY_ATTENTION["deepseek_v3"] = TINY_ATTENTION["deepseek_v2"]


def routers(name: str):
    """The transformers router of a shrunk ``name`` (one learned-top-k MoE layer; random
    weights and correction bias) and the model config."""
    m = OmegaConf.to_container(OmegaConf.load(f"conf/model/{name}.yaml"))
    m.update(hidden_size=32, expert_ffn_size=8, num_layers=2, num_heads=4, shared_expert_ffn_size=8,
             dense_ffn_size=16, first_k_dense=min(m.get("first_k_dense", 0), 1), max_position=64,
             hf_overrides=TINY_ATTENTION.get(m["family"], {"num_key_value_heads": 4, "head_dim": 8}))
    fam = family_of(m["family"])
    model = init_model(fam, hf_config(OmegaConf.create(m), 64), 0)
    block = [layer.mlp for layer in model.model.layers if fam.is_moe_block(layer.mlp)][-1]
    gate = getattr(block, "gate", None) or block.router
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(gate.weight.shape, generator=g))
        if hasattr(gate, "e_score_correction_bias"):
            gate.e_score_correction_bias.copy_(torch.rand(gate.weight.shape[0], generator=g) * 0.3)
    return gate, m


@pytest.mark.parametrize("name", FULL)
def test_each_family_router_is_the_stated_gate_rule(name):
    """The harness's GateRule of the model config (scores, bias, group limit, weights)
    chooses the experts the family's transformers router chooses, with its weights."""
    gate, m = routers(name)
    x_TD = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits_TE, w_TK, ids_TK = gate(x_TD)
        bias_E = getattr(gate, "e_score_correction_bias", None)
        rule = gate_rule(m)
        _, _, ids2_TK, w2_TK = rule.route(logits_TE, m["top_k"], bias_E)
    order, order2 = ids_TK.argsort(1), ids2_TK.argsort(1)
    assert torch.equal(ids_TK.gather(1, order), ids2_TK.gather(1, order2)), name
    assert torch.allclose(w_TK.float().gather(1, order), w2_TK.gather(1, order2), rtol=1e-5, atol=1e-6), name
    probs_TE = rule.expert_weights(rule.scores(logits_TE), ids2_TK)
    assert torch.allclose(probs_TE.gather(1, ids2_TK), w2_TK)
    if rule.group_limited:      # the limit binds: without it some tokens choose otherwise
        free = GateRule(rule.scoring, rule.normalize, rule.scaling).route(logits_TE, m["top_k"], bias_E)[2]
        assert not torch.equal(free.sort(1).values, ids2_TK.sort(1).values)


def test_group_limit_over_devices_is_deepseek_v3s_router_with_devices_as_groups():
    """GroupLimit(M) over the contiguous placement of P devices, on the router's choice
    without a limit, chooses what DeepSeek-V3's router chooses with n_group = P,
    topk_group = M (selection scores with the correction bias)."""
    gate, m = routers("deepseek_v3")
    E, K, P = m["num_experts"], m["top_k"], 8
    x_TD = torch.randn(64, 32, generator=torch.Generator().manual_seed(2))
    for M in (1, 2, 4):
        gate.num_group, gate.topk_group = P, M
        with torch.no_grad():
            logits_TE, _, ids_TK = gate(x_TD)
            free = GateRule("sigmoid", True, m["routed_scaling_factor"])
            scores_TE, choice_TE, free_TK, w_TK = free.route(logits_TE, K, gate.e_score_correction_bias)
            out_TK, _ = GroupLimit(M)(free.expert_weights(scores_TE, free_TK), free_TK, w_TK,
                                      Placement.contiguous(E, P), choice_TE=choice_TE)
        assert torch.equal(out_TK.sort(1).values, ids_TK.sort(1).values), M


@pytest.fixture(scope="module", params=[2, 4], ids=lambda P: f"P{P}")
def model_world(request):
    """Every proxy on naive and occult, and the OLMoE proxy on naive over EPLB's slot
    placements and on occult (collaborative rule) over the affinity-aware packing, in one
    world per P: ``(P, jobs, per_rank grid results, per_rank migration results, per_rank
    ScMoE results, per_rank whole-model gate results)``; the P = 2 world also runs sequence
    migration (migration_helpers; its transformers import is already paid) and the runs'
    whole-model gate (scmoe_helpers.gate_world)."""
    P = request.param
    jobs = [({"model": tiny(n), "system": {"name": s, "_target_": t}, "seed": 1}, 2, 8)
            for n in PROXIES for s, t in SYSTEMS + ([SCMOE] if n == "scmoe_proxy" else [])]
    jobs += eplb_model_jobs(P)
    jobs += schedule_jobs()
    per_rank = launch(models_and_migration, P,
                      (jobs, P == 2, tiny("scmoe_proxy"), tiny("olmoe_proxy") if P == 2 else None), timeout_s=360)
    return (P, jobs, [r[0] for r in per_rank], [r[1] for r in per_rank], [r[2] for r in per_rank],
            [r[3] for r in per_rank])


@pytest.mark.timeout(400)
def test_ep_models_match_single_device(model_world):
    """Every proxy on naive and occult, the OLMoE proxy on naive over EPLB's slot
    placements (E/8 redundant: copies of the hot experts, the training gradient of a copied
    expert summed over its copies) and under the schedules (micro-batches, gradient sync),
    equal the single-device model."""
    P, jobs, per_rank, *_ = model_world
    for rank, results in enumerate(per_rank):
        for (cfg, *_), res in zip(jobs, results):
            bad = {k: v for k, v in res["errors"].items() if not v < 2e-5}
            assert not bad, (P, rank, cfg["model"]["name"], cfg["system"]["name"], cfg.get("task"), bad)
            moe_layers = {layer for layer, _ in res["routing"]}
            first_dense = cfg["model"].get("first_k_dense", 0)
            assert moe_layers == set(range(first_dense, cfg["model"]["num_layers"]))
        check_schedules(jobs, results)


# the schedules (issue 28) on the OLMoE proxy: two co-executed micro-batches, and the
# gradient sync's three modes (small buckets and partitions, so that several start during the
# backward); each against the single-device model like every job above
SCHEDULES = [("naive", {"microbatches": 2}), ("occult", {"microbatches": 2, "grad_sync": "overlap",
                                                          "bucket_bytes": 4096}),
             ("naive", {"grad_sync": "lina", "bucket_bytes": 4096, "partition_bytes": 1024})]


def schedule_jobs() -> list:
    """The schedules on the OLMoE proxy, and the shortcut-connected model under system=scmoe
    with two co-executed micro-batches (each strand carries its own shortcut)."""
    targets = dict(SYSTEMS)
    return [({"model": tiny("olmoe_proxy"), "system": {"name": s, "_target_": targets[s]}, "seed": 1, "task": t}, 2, 8)
            for s, t in SCHEDULES] + \
        [({"model": tiny("scmoe_proxy"), "system": {"name": SCMOE[0], "_target_": SCMOE[1]}, "seed": 1,
           "task": {"microbatches": 2}}, 2, 8)]


def check_schedules(jobs: list, results: list) -> None:
    """Co-executed micro-batches send what the whole batch sends and time every forward
    collective's exposed part; overlap and lina start all-reduces before the backward ends
    (lina one partition per gap between the backward's MoE collectives, the rest after it)."""
    by = {(cfg["model"]["name"], cfg["system"]["name"], tuple(sorted(cfg.get("task", {}).items())), len(more)): res
          for (cfg, *more), res in zip(jobs, results)}
    whole, split = by[("olmoe_proxy", "naive", (), 2)], by[("olmoe_proxy", "naive", (("microbatches", 2),), 2)]
    tokens = lambda res: {k: v for k, v in res["sent_rows"].items() if k[0] != "counts"}   # counts: one per micro-batch
    assert tokens(split) == tokens(whole) and whole["exposed_comm_spans"] == 0
    assert split["exposed_comm_spans"] == split["forward_collectives"] == 2 * whole["forward_collectives"] > 0
    synced = [res["grad_sync"] for (cfg, *_), res in zip(jobs, results) if cfg.get("task", {}).get("grad_sync")]
    (overlap, lina), end = synced, whole["grad_sync"]
    assert end == {"allreduces": 1, "started_in_backward": 0}
    assert 0 < overlap["started_in_backward"] <= overlap["allreduces"]
    assert 0 < lina["started_in_backward"] < lina["allreduces"]      # partitions in the gaps, the rest after


@pytest.mark.timeout(400)
def test_scmoe_microbatches_route_every_layer_as_one_batch(model_world):
    """The shortcut-connected model under system=scmoe with two co-executed micro-batches
    (one thread each, both in the same blocks at once) equals the single-device model and
    routes every MoE layer as the one-batch run: the same expert loads (issue 38: the
    strands shared one shortcut carrier, so a strand's block read the other's representation)."""
    P, jobs, per_rank, *_ = model_world
    keys = [(cfg["model"]["name"], cfg["system"]["name"], cfg.get("task", {}).get("microbatches", 1))
            for cfg, *_ in jobs]
    one, two = keys.index(("scmoe_proxy", "scmoe", 1)), keys.index(("scmoe_proxy", "scmoe", 2))
    E = tiny("scmoe_proxy")["num_experts"]

    def loads(res):
        layers = sorted({layer for layer, _ in res["routing"]})
        return {layer: sum(torch.bincount(ids.flatten().cpu(), minlength=E)
                           for li, ids in res["routing"] if li == layer) for layer in layers}

    for rank, results in enumerate(per_rank):
        bad = {k: v for k, v in results[two]["errors"].items() if not v < 2e-5}
        assert not bad, (P, rank, bad)
        a, b = loads(results[one]), loads(results[two])
        assert a.keys() == b.keys() == set(range(tiny("scmoe_proxy")["num_layers"]))
        for layer in a:
            assert torch.equal(a[layer], b[layer]), (P, rank, layer)


@pytest.mark.timeout(400)
def test_run_gate_checks_the_whole_model_under_the_runs_schedule(model_world):
    """The runs' whole-model gate (model_parity_gate, float64): the shortcut-connected model
    with two co-executed micro-batches (training: forward and backward; prefill: forward)
    and the OLMoE model training with sequence migration pass it (to 1e-9); with the strands
    sharing one shortcut carrier (issue 38's defect 2) it stops the run, where the one-layer
    gate passes on the same run."""
    P, *_, gates = model_world
    if P != 2:
        pytest.skip("the gate's runs are in the P = 2 world")
    for rank, out in enumerate(gates):
        for key in ("shortcut", "shortcut_prefill", "migration"):
            rows = out[key]
            assert isinstance(rows, list), (rank, key, rows)
            by = {r["metric"]: r["value"] for r in rows}
            checked = {"model_parity_logits", "model_parity_loss"}
            if key != "shortcut_prefill":
                checked |= {"model_parity_grad_replicated", "model_parity_grad_experts"}
            assert by.pop("model_parity_checked") == 1.0 and by.keys() == checked, (rank, key, by)
            assert all(v <= 1e-9 for v in by.values()), (rank, key, by)
        broken = out["shared_carrier"]
        assert isinstance(broken, str) and "the whole model disagrees with the single-device model" in broken, rank
        assert "task.microbatches=2" in broken and "nothing was timed" in broken
        layer = {r["metric"]: r["value"] for r in out["shared_carrier_layer"]}
        assert layer["parity_checked"] == 1.0 and layer["parity_out"] <= 1e-9, rank


def test_schedule_changes_name_what_the_whole_model_gate_checks():
    """The whole-model gate runs where the run computes beyond one layer, and nowhere else."""
    import dataclasses
    from types import SimpleNamespace

    from occult.config import read_conf
    from occult.tasks.common import schedule_changes

    def changes(model: str, **task):
        typed = dataclasses.replace(read_conf("task", "train"), **task)
        return schedule_changes(SimpleNamespace(model=OmegaConf.create(tiny(model)), task=typed))

    assert changes("olmoe_proxy") == changes("olmoe_proxy", microbatches=1, grad_sync="end") == []
    assert changes("olmoe_proxy", microbatches=2) == ["task.microbatches=2"]
    assert changes("scmoe_proxy") == ["model.family=scmoe (shortcut-connected)"]
    assert changes("olmoe_proxy", migration=True, grad_sync="overlap") == ["task.migration=true",
                                                                          "task.grad_sync=overlap"]


def _migration(model_world) -> list:
    P, _, _, migration, _, _ = model_world
    if P != 2:
        pytest.skip("sequence migration runs in the P = 2 world")
    return migration


def _close(a, b):
    return (a - b).abs().max().item() <= 1e-9 * max(b.abs().max().item(), 1e-30)


@pytest.mark.timeout(400)
def test_sequence_migration_is_exact_forward_and_backward(model_world):
    """task.migration's model (every sequence moved; then the table counted from that step)
    gives plain EP's logits and synchronised gradients of every weight, float64."""
    for rank, out in enumerate(_migration(model_world)):
        for key in ("swap", "counted"):
            assert _close(out[key]["logits"], out["plain"]["logits"]), (rank, key)
            grads, plain = out[key]["grads"], out["plain"]["grads"]
            assert len(grads) == len(plain) > 0, (rank, key)
            for name, g in plain.items():
                assert _close(grads["model." + name], g), (rank, key, name)


@pytest.mark.timeout(400)
def test_sequence_migration_moves_hidden_states_once_each_way(model_world):
    from migration_helpers import B, D, S
    for rank, out in enumerate(_migration(model_world)):
        by_phase = {(phase, direction): (rows, row_bytes) for phase, direction, rows, row_bytes in out["swap"]["comm"]}
        for phase in ("migrate", "migrate_return"):
            for direction in ("forward", "backward"):
                rows, row_bytes = by_phase[(phase, direction)]
                # every sequence moved: B * S rows to the other rank, none to itself, D float64 each
                assert rows[1 - rank] == B * S and rows[rank] == 0 and row_bytes == 8 * D, (phase, direction)
        assert by_phase[("migrate_ids", "forward")][0][1 - rank] == B * S
        assert out["swap"]["counters"]["migrated_sequences"] == B
        assert not out["plain"]["comm"]


@pytest.mark.timeout(400)
def test_sequence_migration_counts_remote_pairs_at_home_and_where_they_ran(model_world):
    """After the swap rank r runs rank 1-r's sequences: their pairs off their home rank are
    plain EP's remote pairs of rank 1-r, those off rank r are the ones the step sent; the
    tables (profiled, counted) hold each seen token's pairs per rank (2 layers x K = 2)."""
    world = _migration(model_world)
    for rank, out in enumerate(world):
        counters = out["swap"]["counters"]
        assert counters["remote_pairs_home"] == world[1 - rank]["plain"]["remote_plain"]
        assert counters["remote_pairs_migrated"] == out["swap"]["remote_plain"]
        for table in (out["table_after"], out["profiled"]):
            seen = table.sum(1) > 0
            assert table.shape[1] == 2 and seen.any() and torch.all(table.sum(1)[seen] == 4.0)


@pytest.mark.timeout(400)
def test_scmoe_overlapped_schedule_equals_step_by_step(model_world):
    """The shortcut-connected model (float64) under system=scmoe, each block's dispatch
    started one block early (its counts exchanged before the previous block's combine) and
    its wait reported as exposed_comm, gives the logits and synchronised gradients of the
    same model run step by step (naive); the shortcut changes the model (not a no-op)."""
    P, *_, schedules, _ = model_world
    for rank, out in enumerate(schedules):
        step, over = out["step_by_step"], out["overlapped"]
        assert _close(over["logits"], step["logits"]), rank
        assert set(over["grads"]) == set(step["grads"]) and step["grads"]
        for name, g in step["grads"].items():
            assert _close(over["grads"][name], g), (rank, name)
        layers = tiny("scmoe_proxy")["num_layers"]
        for layer in range(1, layers):
            at = over["order"].index
            assert at((layer, "counts")) < at((layer - 1, "combine")), (rank, layer, over["order"])
            assert step["order"].index((layer, "counts")) > step["order"].index((layer - 1, "combine"))
        assert over["exposed"] == list(range(layers)) and step["exposed"] == []
        assert out["no_shortcut_diff"] > 1e-5             # float32 rounding is ~1e-7 here


def eplb_model_jobs(P: int) -> list:
    """The OLMoE proxy on naive over EPLB's slots of a skewed seeded load per layer, and on occult
    with the collaborative rule over the affinity-aware packing of the same counts ([] without eplb)."""
    try:
        import eplb  # noqa: F401
        from occult.placement.eplb import eplb_placements
    except ImportError:
        return []
    m = tiny("olmoe_proxy")
    E = m["num_experts"]
    g = torch.Generator().manual_seed(P)
    loads = {layer: (1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2)[torch.randperm(E, generator=g)]
             for layer in range(m["num_layers"])}
    from occult.placement.affinity import affinity_placements
    ids = {layer: torch.stack([torch.multinomial(load_E, m["top_k"], generator=g) for _ in range(256)])
           for layer, load_E in loads.items()}
    occult = {"name": "occult", "_target_": dict(SYSTEMS)["occult"], "replica_policy": "collaborative"}
    return [({"model": m, "system": {"name": "naive", "_target_": SYSTEMS[0][1]}, "seed": 1}, 2, 8,
             eplb_placements(loads, E // 8, P)),
            ({"model": m, "system": occult, "seed": 1}, 2, 8, affinity_placements(ids, E, E // 8, P))]


def _model(name, seed=0):
    m = OmegaConf.create(tiny(name))
    return init_model(family_of(m.family), hf_config(m, 128), seed), family_of(m.family)


@pytest.mark.parametrize("name", PROXIES)
def test_checkpoint_round_trip(tmp_path, name):
    model, fam = _model(name)
    save_checkpoint(model, tmp_path / "ckpt", {"note": "test"})
    back = load_checkpoint(fam, tmp_path / "ckpt")
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, back(input_ids=ids).logits)


def test_bad_checkpoints_are_clear_errors(tmp_path):
    model, fam = _model("olmoe_proxy")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(fam, tmp_path / "nowhere")
    save_checkpoint(model, tmp_path / "ckpt")
    other, _ = _model("qwen_moe_proxy")
    with pytest.raises(CheckpointError, match="does not fit|cannot load"):
        load_checkpoint(family_of("qwen2_moe"), tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    (tmp_path / "ckpt" / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_checkpoint(fam, tmp_path / "ckpt")


@pytest.mark.parametrize("name", PROXIES)
def test_kv_cache_decode_equals_recompute(name):
    model, _ = _model(name, seed=3)
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache, nxt = out.cache, out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(5):
            ids = torch.cat([ids, nxt], 1)
            step = model(input_ids=nxt, cache=cache, use_cache=True)
            full = model(input_ids=ids).logits[:, -1]
            assert torch.allclose(step.logits[:, -1], full, atol=1e-5)
            assert torch.equal(step.logits[:, -1].argmax(-1), full.argmax(-1))
            cache, nxt = step.cache, step.logits[:, -1].argmax(-1, keepdim=True)
