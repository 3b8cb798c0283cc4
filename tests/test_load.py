"""The load axis: slot placements (EPLB's layout) and their round_robin copies, EPLB (the
real library) and its artifacts, the load workloads (imbalance tuned to a target, incast,
trace replay), and their one-line refusals at validation. Multi-rank checks live in the
worlds of tests/test_parity.py (naive on EPLB's slots; the imbalance target at P = 4) and
tests/test_models.py (train's copied-expert gradients); nothing here starts ranks."""
import pandas as pd
import pytest
import torch

from occult.ep import system_config
from occult.ep.comm import EPGroup
from occult.ep.placement import Placement, SlotPlacement
from occult.ep.plan import RowShape, plan_world
from occult.errors import ConfigError
from occult.validate import validate
from occult.workloads import (imbalance_routing, incast_topk, largest_max_over_mean, received_max_over_mean,
                              trace_sha256, workload_generator, workload_topk)

from systems import exact_systems
from test_task_options import cfg_with


def slots(expert_S, device_S, P, E):
    return SlotPlacement(torch.tensor(expert_S), torch.tensor(device_S), P, E)


def test_a_slot_placement_holds_copies_and_refuses_what_it_cannot_be():
    pl = slots([0, 1, 0, 2, 3, 0], [0, 0, 0, 1, 1, 1], 2, 4)     # expert 0: twice on device 0, once on 1
    assert pl.copies_E().tolist() == [3, 1, 1, 1] and pl.num_local == 3
    assert pl.local_experts(0).tolist() == [0, 1, 0] and pl.local_experts(1).tolist() == [2, 3, 0]
    for bad, why in [(([0, 1, 2], [0, 0, 1], 2, 3), "do not split equally"),
                     (([0, 1, 2, 3], [0, 0, 0, 1], 2, 4), "must hold 2 slots each"),
                     (([0, 1, 0, 1], [0, 0, 1, 1], 2, 3), r"experts \[2\] have no slot")]:
        with pytest.raises(ValueError, match=why):
            slots(*bad)


def test_round_robin_sends_pair_i_of_an_expert_to_copy_i_mod_copies():
    pl = slots([0, 1, 0, 2, 3, 0], [0, 0, 0, 1, 1, 1], 2, 4)     # expert 0's copies: slots 0, 2, 5
    ids_TK = torch.tensor([[0, 1], [2, 0], [0, 3], [0, -1]])
    assert pl.pair_slots(ids_TK).tolist() == [[0, 1], [3, 2], [5, 4], [0, -1]]
    device_TK, local_TK = pl.pair_local(ids_TK)
    assert device_TK[:, 0].tolist() == [0, 1, 1, 0] and local_TK[2].tolist() == [2, 1]
    # several ranks' pairs concatenated: each rank counts its own (home_T), as it does alone
    both = torch.cat([ids_TK, ids_TK])
    home_T = torch.tensor([0] * 4 + [1] * 4)
    assert torch.equal(pl.pair_slots(both, home_T), torch.cat([pl.pair_slots(ids_TK)] * 2))
    # one copy each: the contiguous placement's devices and slots
    flat = SlotPlacement.from_phy2log(torch.arange(4), 2, 4)
    assert torch.equal(flat.pair_local(ids_TK.clamp_min(0))[0], Placement.contiguous(4, 2).pair_local(ids_TK)[0])


def test_eplb_the_library_builds_slots_and_its_artifact_names_it(tmp_path):
    pytest.importorskip("eplb")
    from occult.placement.eplb import eplb_placements, load_slot_placements, num_redundant_error, save_slot_placements
    from occult.placement.eplb import built_by_eplb
    load_E = torch.tensor([400.0] + [10.0] * 15)
    pl = eplb_placements({3: load_E}, 4, 4)[3]                  # E/4 redundant on 4 GPUs: 5 slots each
    assert pl.num_slots == 20 and pl.copies_E()[0] == 5 and int(pl.copies_E().sum()) == 20
    path = save_slot_placements(tmp_path / "p.json", {3: pl}, built_by_eplb(), {"load_E": load_E.tolist()})
    back, doc = load_slot_placements(path)
    assert torch.equal(back[3].expert_S, pl.expert_S) and torch.equal(back[3].device_S, pl.device_S)
    assert doc["built_by"]["name"] == "eplb" and doc["built_by"]["impl"] == "library"
    assert "d52c72d" in doc["built_by"]["source"]
    (tmp_path / "bad.json").write_text('{"format": "occult-placements/v1"}')
    with pytest.raises(ValueError, match="format must be 'occult-slots/v1'"):
        load_slot_placements(tmp_path / "bad.json")
    assert num_redundant_error(8, 64, 4) == "" and "divisible by the 4 GPUs" in num_redundant_error(2, 64, 4)


@pytest.mark.parametrize("P", [4, 8])
def test_imbalance_reaches_its_target_on_naive_at_P4_and_P8(P):
    """max / mean 2.0 within 2 %, read from naive's dispatch rows: its plan for every rank of
    the world (the functions its dispatch sizes the collective with; tests/test_parity.py holds
    plan and logged rows equal, and the P = 4 world checks the rows its ranks really sent)."""
    E, K, T = 64, 8, 512
    ids, _, got = imbalance_routing([T] * P, K, E, 2.0, seed=0)
    assert got == pytest.approx(2.0, rel=0.02)
    assert all(len(set(r)) == K for r in torch.cat(ids).tolist())           # without replacement
    ep = EPGroup(0, P, None, "cpu", 0)
    naive = system_config(exact_systems()["naive"]).build(ep, 0, E)
    world = plan_world(naive, [(i, torch.full(i.shape, 1.0 / K)) for i in ids], RowShape(16, 8, torch.float64))
    recv_P = next(c for c in world if c.phase == "dispatch" and c.direction == "forward").rows_PP.sum(0).double()
    assert float(recv_P.max() / recv_P.mean()) == pytest.approx(2.0, rel=0.02)
    assert float(recv_P.max() / recv_P.mean()) == pytest.approx(received_max_over_mean(torch.cat(ids), E, P))


def test_incast_and_trace_workloads(tmp_path):
    E, K, P = 64, 8, 4
    ids = incast_topk(4000, K, E, P, 2, 0.6, workload_generator(0, 0))
    on_2 = (ids // (E // P) == 2).float().mean().item()
    assert on_2 == pytest.approx(0.6, abs=0.01) and all(len(set(r)) == K for r in ids.tolist())
    # a trace: rank r replays tokens [r T, (r + 1) T) of the trace's first layer
    trace = pd.DataFrame([{"layer": 1, "rank": t // 6, "token": t % 6, "slot": k, "expert": (t + 3 * k) % E,
                           "weight": 0.5} for t in range(12) for k in range(K)])
    trace.to_parquet(tmp_path / "routing.parquet")
    got = workload_topk("trace", 1, [6, 6], K, E, 0, trace=str(tmp_path))
    assert got[0].tolist() == [(6 + 3 * k) % E for k in range(K)] and len(trace_sha256(tmp_path)) == 64


def eplb_world(P=4, E=64, K=8, T=256, r=16, seed=0):
    """EPLB's slots (the real library) on a skewed load, and every rank's routing drawn from it."""
    pytest.importorskip("eplb")
    from occult.placement.eplb import eplb_placements
    g = torch.Generator().manual_seed(seed)
    pop_E = 1.0 / torch.arange(1, E + 1, dtype=torch.float64)
    ids = torch.stack([torch.multinomial(pop_E, K, generator=g) for _ in range(T * P)])
    load_E = torch.bincount(ids.flatten(), minlength=E).double()
    return eplb_placements({0: load_E}, r, P)[0], ids, torch.arange(P).repeat_interleave(T)


def test_every_replica_rule_serves_each_pair_by_a_copy_of_its_expert_as_each_rank_alone():
    """Each rule picks a slot holding the pair's expert (dropped pairs: -1); with several ranks'
    pairs concatenated each rank decides its own, as it does alone; local_first and grace take
    the sending rank's copy whenever it holds one."""
    from occult.ep.replica_rules import REPLICA_POLICIES, first_slot_EP
    pl, ids, home_T = eplb_world(T=64)
    ids[3, 5] = -1
    for rule in REPLICA_POLICIES:
        ruled = pl.with_rule(rule)
        slot_TK = ruled.pair_slots(ids, home_T)
        assert slot_TK[3, 5] == -1
        keep = ids >= 0
        assert torch.equal(pl.expert_S[slot_TK[keep]], ids[keep]), rule
        per_rank = torch.cat([ruled.pair_slots(ids[home_T == r], torch.full((64,), r)) for r in range(4)])
        assert torch.equal(slot_TK, per_rank), rule
        if rule in ("local_first", "grace"):
            local_TK = first_slot_EP(pl)[ids.clamp_min(0), home_T.unsqueeze(1).expand_as(ids)] >= 0
            assert bool((pl.device_S[slot_TK][keep & local_TK] == home_T.unsqueeze(1).expand_as(ids)[keep & local_TK]
                         ).all()), rule
    assert pl.to("cpu").with_rule("grace", 0.3).to("cpu").replica_policy == "grace"


def test_collaborative_touches_fewer_devices_and_its_cap_bounds_the_load():
    """The collaborative rule's greedy cover gives a lower C_T than round_robin on EPLB's slots;
    with its cap (slack 0.1) the busiest device's share of a rank's pairs is lower than
    without one (slack 100; only copied experts' pairs can move, so the cap is not a bound),
    and grace's is no higher than local_first's."""
    from occult.ep.accounting import devices_per_token
    pl, ids, home_T = eplb_world()

    def ct(rule, slack=0.1):
        return devices_per_token(ids, pl.with_rule(rule, slack), home_T).double().mean().item()

    def worst(rule, slack=0.1):
        dev_TK = pl.device_S[pl.with_rule(rule, slack).pair_slots(ids, home_T)]
        return max(torch.bincount(dev_TK[home_T == r].flatten(), minlength=4).max().item() for r in range(4))

    assert ct("collaborative", 100.0) < ct("collaborative") < ct("round_robin")
    assert worst("collaborative") < worst("collaborative", 100.0)
    assert worst("grace") <= worst("local_first")


def test_a_replica_rule_on_a_placement_without_copies_is_a_note():
    notes = validate(cfg_with("task=layer", "system=occult", "system.replica_policy=collaborative"))
    assert any(n.startswith("system.replica_policy=collaborative has no effect here") for n in notes)
    assert not any("replica_policy" in n for n in validate(cfg_with(
        "task=layer", "system=occult", "system.replica_policy=collaborative", "task.placement=eplb",
        "task.num_redundant=8", "model=olmoe_layer", "cluster=cpu4")))


@pytest.mark.parametrize("overrides, line", [
    (["task=layer", "task.placement=eplb", "task.num_redundant=-1"], "task.num_redundant=-1: must be >= 0"),
    (["task=layer", "task.placement=eplb", "task.num_redundant=3", "model=olmoe_layer", "cluster=cpu4"],
     "task.num_redundant=3: EPLB needs the physical count E + num_redundant = 67 divisible by the 4 GPUs"),
    (["task=layer", "task.num_redundant=8"], "task.num_redundant=8: task=layer does not read it here"),
    (["task=layer", "task.placement=eplb", "system=allgather"], "task.placement='eplb': system=allgather does not "
                                                                 "run on physical slots"),
    (["task=layer", "system=occult", "system.slack=-0.5"], "system.slack=-0.5: must be >= 0"),
    (["task=layer", "system=naive", "system.replica_policy=nearest"], "system.replica_policy='nearest': allowed "
                                                                      "values are"),
    (["task=layer", "task.routing=imbalance", "task.max_over_mean=0.5"], "task.max_over_mean=0.5: allowed values are"),
    (["task=layer", "task.routing=imbalance", "task.max_over_mean=3.9", "model=olmoe_layer", "cluster=cpu2"],
     "task.max_over_mean=3.9: allowed values are 1.0 to 2 here (the largest reachable with E=64, K=8, P=2"),
    (["task=layer", "task.routing=incast", "task.incast_share=1.5"], "task.incast_share=1.5: allowed values are"),
    (["task=layer", "task.routing=trace"], "task.trace is not set"),
])
def test_bad_load_options_are_one_line_at_validation(overrides, line):
    with pytest.raises(ConfigError) as err:
        validate(cfg_with(*overrides))
    assert str(err.value).startswith(line) and "\n" not in str(err.value), str(err.value)


def test_a_trace_of_another_shape_is_refused_in_one_line(tmp_path):
    pd.DataFrame([{"layer": 0, "rank": 0, "token": t, "slot": k, "expert": k, "weight": 0.5}
                  for t in range(4) for k in range(2)]).to_parquet(tmp_path / "routing.parquet")
    with pytest.raises(ConfigError) as err:
        validate(cfg_with("task=layer", "model=olmoe_layer", "task.routing=trace", f"task.trace={tmp_path}"))
    assert "does not match the run" in str(err.value) and "\n" not in str(err.value)
    assert largest_max_over_mean(64, 8, 4) == 4.0 and largest_max_over_mean(8, 4, 4) == 2.0


def test_the_layer_tasks_eplb_placement_is_built_from_a_profiling_draw_and_written(tmp_path):
    """task.placement=eplb on task=layer: EPLB's slots from the workload drawn again at seed + 1,
    the artifact written by rank 0 into the run folder; under them the run's own imbalance
    routing (max / mean 2.0 on the contiguous placement) reaches its devices more evenly."""
    pytest.importorskip("eplb")
    import json
    from types import SimpleNamespace

    from occult.runner import build_spec
    from occult.tasks.one_layer import rank_workload, task_placement
    cfg = cfg_with("task=layer", "model=olmoe_layer", "cluster=cpu4", "task.routing=imbalance",
                   "task.placement=eplb", "task.num_redundant=8")
    cfg = build_spec(cfg, tmp_path, "d")
    ctx = SimpleNamespace(rank=0, world_size=4, ep=EPGroup(0, 4, None, "cpu", 0), device="cpu")
    pl = task_placement(ctx, cfg)
    doc = json.loads((tmp_path / "placement_eplb.json").read_text())
    assert doc["built_by"]["name"] == "eplb" and doc["num_slots"] == pl.num_slots == 72
    ids = [rank_workload(cfg, r, 4, cfg.seed) for r in range(4)]
    home_T = torch.cat([torch.full((i.shape[0],), r) for r, i in enumerate(ids)])
    on_eplb = torch.bincount(pl.pair_devices(torch.cat(ids), home_T).flatten(), minlength=4).double()
    assert received_max_over_mean(torch.cat(ids), 64, 4) == pytest.approx(2.0, rel=0.02)
    assert float(on_eplb.max() / on_eplb.mean()) < 1.2


def _device_max_over_mean(pl, load_E: torch.Tensor) -> float:
    """Max / mean of the devices' loads when each expert's load splits evenly over its copies."""
    per_S = (load_E / pl.copies_E().double())[pl.expert_S]
    load_P = torch.zeros(pl.num_devices, dtype=torch.float64).index_add_(0, pl.device_S, per_S)
    return float(load_P.max() / load_P.mean())


def test_eplb_balances_as_well_on_several_nodes_as_on_one():
    """EPLB (and the affinity packing of its counts) on 2, 4 or 8 nodes balances the devices
    within 10 % of one node: without a model's expert groups EPLB takes its global policy (the
    nodes are not groups: one group per node pinned each node's E / nodes experts to it, GPU
    loads [800, 800, 4, 4] on the load below). With the model's groups (model.n_group) it
    packs them whole onto nodes (its hierarchical policy)."""
    pytest.importorskip("eplb")
    from occult.placement.affinity import affinity_placements
    from occult.placement.eplb import eplb_placements
    load_E = torch.tensor([200.0] * 8 + [1.0] * 8)          # the example: 16 slots, 2 nodes of 2
    assert _device_max_over_mean(eplb_placements({0: load_E}, 0, 4, 2)[0], load_E) == pytest.approx(1.0)
    E, K = 64, 8
    g = torch.Generator().manual_seed(0)
    pop_E = (1.0 / torch.arange(1, E + 1, dtype=torch.float64) ** 1.2)[torch.randperm(E, generator=g)]
    ids_NK = torch.multinomial(pop_E.expand(1024, E), K, generator=g)
    load_E = torch.bincount(ids_NK.flatten(), minlength=E).double()
    for P, per_node in ((4, 2), (16, 4), (16, 2)):
        for r in (P, 2 * P):
            one = _device_max_over_mean(eplb_placements({0: load_E}, r, P)[0], load_E)
            many = _device_max_over_mean(eplb_placements({0: load_E}, r, P, per_node)[0], load_E)
            assert many <= 1.1 * one, (P, per_node, r, one, many)
    for P, per_node in ((4, 2), (16, 4)):         # the affinity packing (a loop over slots): one count
        one = _device_max_over_mean(affinity_placements({0: ids_NK}, E, P, P)[0], load_E)
        many = _device_max_over_mean(affinity_placements({0: ids_NK}, E, P, P, per_node)[0], load_E)
        assert many <= 1.1 * one, ("affinity", P, per_node, one, many)
    # the model's 8 groups on 4 nodes: each group's slots on one node (EPLB's hierarchical policy)
    pl = eplb_placements({0: load_E}, 16, 16, 4, num_groups=8)[0]
    node_S = pl.device_S // 4
    for group in range(8):
        assert len(set(node_S[pl.expert_S // 8 == group].tolist())) == 1, group


def test_affinity_packing_keeps_eplbs_counts_and_trades_load_for_c_t():
    """Affinity-aware EPLB: the library's replica counts, every GPU e slots, copies of an
    expert on distinct GPUs; a co-activation weight above 0 lowers C_T on routing whose
    experts come in co-activated groups (round robin on both)."""
    pytest.importorskip("eplb")
    from occult.ep.accounting import devices_per_token
    from occult.placement.affinity import affinity_placements
    from occult.placement.eplb import eplb_placements
    E, K, P, T = 32, 4, 4, 128
    g = torch.Generator().manual_seed(0)
    group_N = torch.randint(0, 4, (2 * T * P,), generator=g)
    pop_NE = (1.0 / torch.arange(1, E + 1, dtype=torch.float64)).expand(2 * T * P, E).clone()
    pop_NE[(torch.arange(E) % 4).unsqueeze(0) == group_N.unsqueeze(1)] *= 20
    ids = torch.multinomial(pop_NE, K, generator=g)
    prof, ev = ids[:T * P], ids[T * P:]
    load_E = torch.bincount(prof.flatten(), minlength=E).double()
    eplb = eplb_placements({0: load_E}, 4, P)[0]
    home = torch.arange(P).repeat_interleave(T)
    ct = {}
    for w in (0.0, 0.25):
        pl = affinity_placements({0: prof}, E, 4, P, 0, w)[0]
        assert torch.equal(pl.copies_E(), eplb.copies_E()) and pl.num_local == (E + 4) // P
        for x in (pl.copies_E() > 1).nonzero().flatten().tolist():
            assert pl.device_S[pl.expert_S == x].unique().numel() == int(pl.copies_E()[x])
        ct[w] = devices_per_token(ev, pl, home).double().mean().item()
    assert ct[0.25] < ct[0.0]


def test_placement_load_plans_every_arm_and_its_rows_are_the_plans():
    """task=placement_load's arms: every placement with naive and occult, every rule where
    there are copies; an arm's received rows are its plan's, C_T its pairs' devices."""
    pytest.importorskip("eplb")
    from occult.ep.accounting import devices_per_token
    from occult.ep.comm import EPGroup
    from occult.tasks.placement_load import arm_rows, arms
    pl, ids, home_T = eplb_world(T=32, r=8)
    found = arms({"contiguous": Placement.contiguous(64, 4), "eplb_r8": pl})
    assert [a[0] for a in found][:3] == ["contiguous:naive:-", "contiguous:occult:-", "eplb_r8:naive:round_robin"]
    assert len(found) == 2 + 2 * 4
    dims = {"E": 64, "K": 8, "D": 16, "F": 8, "P": 4, "G": 0}
    ep = EPGroup(0, 4, None, "cpu", 0)
    for arm in (found[2], found[-1]):                     # naive round robin, occult collaborative
        rows = arm_rows(RowShape(16, 8, torch.float32), dims, ep, arm, ids, 0)
        value = {r["metric"]: r["value"] for r in rows if r["rank"] == -1 and "/" not in r["phase"]}
        ruled = pl.with_rule(arm[3])
        assert value["ct_all"] == pytest.approx(devices_per_token(ids, ruled, home_T).double().mean().item())
        recv = [r["value"] for r in rows if r["metric"] == "recv_rows"]
        if arm[2] == "naive":
            assert recv == torch.bincount(pl.device_S[ruled.pair_slots(ids, home_T)].flatten(), minlength=4).tolist()
        assert value["recv_max_over_mean"] == pytest.approx(max(recv) / (sum(recv) / 4))
        assert value["expert_slots"] == 18


def test_the_device_replica_rules_read_the_placements_tables_without_a_host_sync():
    """round_robin and local_first (the rules a static dispatch takes) choose their copies
    from the slot placement's tables, computed when it was built: no host read and no shape
    that depends on the data (occult.ep.host_sync), the same choice as before."""
    from occult.ep.host_sync import no_host_sync
    from occult.ep.replica_rules import DEVICE_POLICIES, choose_slots
    pl, ids, home_T = eplb_world(T=16)
    for policy in DEVICE_POLICIES:
        want = choose_slots(pl, ids, home_T, policy)
        with no_host_sync("a replica rule"):
            got = choose_slots(pl, ids, home_T, policy)
        assert torch.equal(got, want) and bool((pl.expert_S[got] == ids).all()), policy
