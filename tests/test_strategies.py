"""The field's exact strategies beside Occult: rows and bytes by hand, their options, their
rules, and parity in training (the shadowed and fetched experts' gradients).

Every world below runs its whole list of cases at once (starting ranks costs seconds).
The parity grid over every system (tests/test_parity.py) covers the default options.
"""
import pytest
import torch
import yaml

from analysis import pricing, projection
from occult.dist import launch
from occult.ep import Placement
from occult.ep.links import Link, pipeline_seconds
from occult.ep.profiles import Profile, link_at
from occult.parity import LayerCase, run_grid, run_model_grid

from systems import system
from test_models import tiny

ALLGATHER = "baselines.allgather.AllGatherDispatcher"
HIER = "baselines.hierarchical.HierarchicalDispatcher"
SHADOW = "baselines.shadow.ShadowDispatcher"
FETCH = "baselines.expert_fetch.ExpertFetchDispatcher"
PIPE = "baselines.pipelined.PipelinedDispatcher"
D, F = 16, 8                 # the parity problems' widths (float64: 128 bytes a hidden row)
TOKENS = (6, 5, 7, 4)


def explicit(E: int, K: int, tokens: tuple, seed: int, hot: int = -1) -> LayerCase:
    """A case with top-k ids drawn here (so the test knows them); ``hot``: an expert every
    token chooses first."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    ids = []
    for _ in range(sum(tokens)):
        if hot >= 0:
            rest = [i for i in torch.randperm(E, generator=g).tolist() if i != hot][:K - 1]
            ids += [hot] + rest
        else:
            ids += torch.randperm(E, generator=g)[:K].tolist()
    return LayerCase(E, K, tokens, routing="explicit", explicit_ids=tuple(ids), hidden=D, ffn=F, seed=seed)


def ids_of(case: LayerCase, rank: int) -> torch.Tensor:
    lo = sum(case.tokens[:rank])
    return torch.tensor(case.explicit_ids, dtype=torch.long).view(-1, case.top_k)[lo:lo + case.tokens[rank]]


def events(result: dict, phase: str, direction: str = "forward") -> list:
    return [ev for ev in result["comm"] if ev.phase == phase and ev.direction == direction]


def exact(result: dict) -> bool:
    return all(v <= 1e-9 for v in result["errors"].values())


AG_CASES = [explicit(8, 1, TOKENS, 1), explicit(8, 8, TOKENS, 2), explicit(8, 4, (6, 6, 6, 6), 3)]
HIER_CASE = explicit(8, 4, TOKENS, 4)
HOT_CASE = explicit(8, 2, (40, 40, 40, 40), 5, hot=0)
FETCH_CASE = explicit(16, 2, TOKENS, 6)
PIPE_CASES = [LayerCase(8, 2, (0, 1, 3, 2), seed=7), LayerCase(64, 8, TOKENS, routing="router", seed=8)]
WORLD4 = ([(system(ALLGATHER), c, None) for c in AG_CASES]
          + [(system(HIER, dedup=d), HIER_CASE, None) for d in ("none", "node", "device")]
          + [(system(SHADOW), HOT_CASE, None), (system(FETCH), FETCH_CASE, None)]
          + [(system(PIPE, degree=str(r)), c, None) for r in (2, 4) for c in PIPE_CASES])


@pytest.fixture(scope="module")
def world4():
    """Every case above on 4 ranks in 2 nodes of 2: per rank, one result per job."""
    return launch(run_grid, 4, (WORLD4,), timeout_s=240, collective_timeout_s=60, devices_per_node=2)


def results_of(world, target: str, **options) -> list:
    """[(case, [per-rank result])] of the jobs of ``target`` with ``options``."""
    out = []
    for i, (sysd, case, _) in enumerate(WORLD4):
        if sysd["_target_"] == target and all(sysd.get(k) == v for k, v in options.items()):
            out.append((case, [per_rank[i] for per_rank in world]))
    return out


def test_every_strategy_case_is_exact(world4):
    bad = [(WORLD4[i][0], WORLD4[i][1], r[i]["errors"]) for r in world4 for i in range(len(WORLD4)) if not exact(r[i])]
    assert not bad, bad[:3]


def test_allgather_sends_every_token_to_every_rank_whatever_k(world4):
    by_k = {}
    for case, per_rank in results_of(world4, ALLGATHER):
        total = sum(case.tokens)
        sent = {rank: events(res, "dispatch")[0] for rank, res in enumerate(per_rank)}
        for rank, res in enumerate(per_rank):
            ev = sent[rank]
            assert ev.collective == "all_gather" and ev.row_bytes == D * 8 and ev.meta_row_bytes == 0
            (meta,) = events(res, "dispatch_meta")                  # ids and weights: metadata, every byte
            assert meta.meta_row_bytes == meta.row_bytes == 2 * case.top_k * 8
            assert ev.rows_P == (case.tokens[rank],) * 4            # its tokens to every rank
            (back,) = events(res, "combine")
            assert back.collective == "reduce_scatter" and back.rows_P == case.tokens   # block j to rank j
            # what reached this rank from the others, from their logged split sizes
            received_remote = sum(sent[src].rows_P[rank] for src in sent if src != rank)
            assert received_remote == total - case.tokens[rank]     # every other rank's every token
            if len(set(case.tokens)) == 1:
                assert received_remote == total * 3 // 4            # (P - 1) / P of every token
        by_k[case.top_k] = [[ev.rows_P for ev in res["comm"] if ev.phase in ("dispatch", "combine")] for res in per_rank]
    assert by_k[1] == by_k[8]                                       # the same rows whatever K


def test_hierarchical_sends_a_token_once_per_remote_node(world4):
    pl = Placement.contiguous(8, 4)                                 # node 0: experts 0-3, node 1: 4-7
    for dedup in ("none", "node", "device"):
        ((case, per_rank),) = results_of(world4, HIER, dedup=dedup)
        intra_total, pairs, devices = 0, 0, 0
        for rank, res in enumerate(per_rank):
            ids = ids_of(case, rank)
            node_TK, g = pl.device_E[ids] // 2, rank % 2
            (inter,) = events(res, "dispatch_inter")
            for m in (0, 1):
                hits = (node_TK == m)
                expected = int(hits.sum()) if dedup == "none" else int(hits.any(1).sum())
                assert inter.rows_P[2 * m + g] == expected, (dedup, rank, m)
                assert inter.rows_P[2 * m + 1 - g] == 0           # across nodes only to the rail peer
            (counts_inter,), (counts_intra,) = events(res, "counts_inter"), events(res, "counts_intra")
            node = rank // 2
            assert [j for j, n in enumerate(counts_inter.rows_P) if n] == [g, 2 + g]        # the rails only
            assert [j for j, n in enumerate(counts_intra.rows_P) if n] == [2 * node, 2 * node + 1]
            (intra,) = events(res, "dispatch_intra")
            assert all(n == 0 for j, n in enumerate(intra.rows_P) if j // 2 != node)   # inside the node only
            intra_total += sum(intra.rows_P)
            pairs += ids.numel()
            devices += sum(len(set(row)) for row in pl.device_E[ids].tolist())
        assert intra_total == (devices if dedup == "device" else pairs), dedup


def test_shadow_moves_the_hot_experts_weights_not_its_tokens(world4):
    from baselines.shadow import ShadowCosts, fastermoe_shadowed
    ((case, per_rank),) = results_of(world4, SHADOW)
    all_ids = torch.tensor(case.explicit_ids).view(-1, case.top_k)
    costs = ShadowCosts.of(link_at("sim_a6000x4", 4), D, F, 8)
    shadowed = fastermoe_shadowed(torch.bincount(all_ids.flatten(), minlength=8), costs, training=True)
    assert shadowed[0]                                               # every token's first expert
    for rank, res in enumerate(per_rank):
        ids = ids_of(case, rank)
        (dispatch,) = events(res, "dispatch")
        assert sum(dispatch.rows_P) == int((~shadowed[ids]).sum())   # shadowed pairs stay home
        sent = events(res, "shadow_weights")
        assert [ev.collective for ev in sent] == ["broadcast"] * len(sent) and sent[0].row_bytes == 3 * D * F * 8
        owners = sorted({int(o) for o in torch.nonzero(shadowed).flatten() // 2})
        assert len(sent) == len(owners)
        back = events(res, "shadow_weights", "backward")              # training: gradients reduced to owners
        assert [ev.collective for ev in back] == ["reduce"] * len(owners)
        assert exact(res)                                            # the owner's gradients include every shadow's


def test_expert_fetch_moves_weights_and_no_tokens(world4):
    ((case, per_rank),) = results_of(world4, FETCH)
    pl = Placement.contiguous(16, 4)
    for rank, res in enumerate(per_rank):
        (fetch,) = events(res, "fetch_weights")
        assert fetch.row_bytes == 3 * D * F * 8
        for j in range(4):                                           # what rank j's tokens need of mine
            wanted = {int(i) for i in ids_of(case, j).flatten() if int(pl.device_E[i]) == rank} if j != rank else set()
            assert fetch.rows_P[j] == len(wanted), (rank, j)
        assert not events(res, "dispatch") and len(events(res, "fetch_weights", "backward")) == 1


def test_pipelined_runs_one_exchange_per_chunk_both_ways(world4):
    for r in (2, 4):
        for case, per_rank in results_of(world4, PIPE, degree=str(r)):
            for res in per_rank:
                for phase in ("dispatch", "combine"):
                    for direction in ("forward", "backward"):
                        assert len(events(res, phase, direction)) == r, (r, case, phase, direction)
                assert len(events(res, "counts")) == 1                # one counts exchange for all chunks


def test_fastermoe_rule_by_hand():
    from baselines.shadow import ShadowCosts, fastermoe_shadowed
    costs = ShadowCosts(comp_s=1.0, feat_s=0.0, model_s=2.5)
    # inference: latency = load + 2.5 per shadowed expert; 10 -> 6 + 2.5; then 5 + 5 is worse
    assert fastermoe_shadowed(torch.tensor([6, 10, 1, 5]), costs, training=False).tolist() == [False, True, False, False]
    assert fastermoe_shadowed(torch.tensor([1, 20, 10]), costs, training=False).tolist() == [False, True, True]
    # training: 3 x compute per pair and two weight transfers per expert (broadcast, gradient reduce)
    assert fastermoe_shadowed(torch.tensor([10, 9]), costs, training=True).tolist() == [False, False]
    assert fastermoe_shadowed(torch.tensor([10, 0]), costs, training=True).tolist() == [True, False]
    assert not fastermoe_shadowed(torch.tensor([3, 3, 3]), costs, training=False).any()   # flat loads: nothing to gain


def test_pipeline_degree_rule_by_hand():
    from baselines.pipelined import auto_degree
    rows_PP = torch.tensor([[10, 90], [90, 10]])          # 90 remote rows each way, 100 rows per rank's experts
    balanced = Link(intra_latency_s=0.0, intra_Bps=90.0, flops=100 * 6.0)   # 1 s per a2a and 1 s of experts
    assert auto_degree(rows_PP, balanced, row_bytes=1, hidden=1, ffn=1, local_experts=1) == 8
    slow_calls = Link(intra_latency_s=10.0, intra_Bps=90.0, flops=100 * 6.0)
    assert auto_degree(rows_PP, slow_calls, row_bytes=1, hidden=1, ffn=1, local_experts=1) == 1
    assert pipeline_seconds(1.0, 1.0, 1.0, 1) == 3.0
    assert pipeline_seconds(0.5, 0.5, 0.5, 2) == 1.5 + 1.0


def test_placement_replicas_leave_the_placement_as_it_was():
    pl = Placement.contiguous(8, 4)
    shadowed = pl.with_replicas(torch.tensor([True] + [False] * 7))
    assert torch.equal(shadowed.device_E, pl.device_E) and torch.equal(shadowed.slot_E, pl.slot_E)
    assert shadowed.replicas_EP[0].all() and not shadowed.replicas_EP[1:].any()
    assert pl.replicas_EP is None and shadowed.to("cpu").replicas_EP is shadowed.replicas_EP
    with pytest.raises(ValueError, match="replicas_EP must be"):
        Placement(pl.device_E, pl.slot_E, 4, torch.zeros(8, 2, dtype=torch.bool))


@pytest.mark.parametrize("target, options, message", [
    (HIER, {"dedup": "rack"}, r"system.dedup='rack': allowed values are \['none', 'node', 'device'\]"),
    (HIER, {"kernels": "triton"}, r"system.kernels='triton': allowed values are \['auto', 'torch', 'epd'\]"),
    (PIPE, {"degree": "3"}, r"system.degree='3': allowed values are \['1', '2', '4', 'auto'\]"),
    (PIPE, {"profile": "nowhere"}, r"system.profile='nowhere': no profile"),
    (SHADOW, {"profile": "sim_cpu_loopback"}, r"system.profile='sim_cpu_loopback': .*not 3"),
])
def test_bad_options_are_one_line_errors(target, options, message):
    from occult.ep import system_config
    with pytest.raises(ValueError, match=message):
        system_config(system(target, **options)).check(num_experts=12, top_k=2, world_size=3)


def test_hierarchical_merges_its_experts_step_on_a_cpu_only_for_a_large_epd():
    """kernels=auto: the pairs gathered while [Q, D] is at most FUSE_FROM_BYTES, merged into
    the rows above; torch and epd whatever the size; never merged off the CPU (a meta tensor
    stands for a GPU's)."""
    from occult.ep import system_config
    from occult.ep.comm import EPGroup
    from occult.ep.merged import FUSE_FROM_BYTES
    from baselines.hierarchical import HierarchicalDispatcher
    x_UD = torch.zeros(4, 128)
    at_bound = FUSE_FROM_BYTES // (128 * 4)
    for kernels, small, large in (("auto", False, True), ("torch", True, True), ("epd", False, False)):
        d = HierarchicalDispatcher(EPGroup(), Placement.contiguous(8, 1), system_config(system(HIER, kernels=kernels)))
        assert (d._merges(x_UD, at_bound), d._merges(x_UD, at_bound + 1)) == (small, large), kernels
    d = HierarchicalDispatcher(EPGroup(), Placement.contiguous(8, 1), system_config(system(HIER)))
    assert not d._merges(torch.zeros(4, 128, device="meta"), at_bound + 1)


@pytest.mark.slow    # 8 s; their forward and backward are the parity suite's
@pytest.mark.timeout(300)
def test_shadowed_and_fetched_experts_train_like_the_single_device_model(tmp_path):
    """Whole models, forward and backward: a profile whose links are fast and whose
    matmuls are slow makes FasterMoE's rule shadow most experts of a random model."""
    eager = tmp_path / "eager.yaml"
    eager.write_text(yaml.safe_dump({"name": "eager", "world_size": 4, "intra_node_GBps": 1e6,
                                     "device_TFLOPs": 1e-9, "dtype": "float32"}))
    systems = [system(SHADOW, name="shadow", profile=str(eager)), system(FETCH, name="expert_fetch"),
               system(HIER, name="hierarchical"), system(PIPE, name="pipelined", degree="2")]
    jobs = [({"model": tiny(n), "system": s, "seed": 1}, 2, 8) for n in ("olmoe_proxy", "deepseek_moe_proxy")
            for s in systems]
    per_rank = launch(run_model_grid, 4, (jobs,), timeout_s=280, devices_per_node=2)
    for rank, results in enumerate(per_rank):
        for (cfg, _, _), res in zip(jobs, results):
            bad = {k: v for k, v in res["errors"].items() if not v < 2e-5}
            assert not bad, (rank, cfg["model"]["name"], cfg["system"]["name"], bad)
    for i in range(0, len(jobs), len(systems)):                      # the shadow jobs: it did shadow, both ways
        for direction in ("forward", "backward"):
            assert sum(r[i]["sent_rows"].get(("shadow_weights", direction), 0) for r in per_rank) > 0, direction


# ---------------------------------------------------------------------------
# the cost model's view of these collectives
# ---------------------------------------------------------------------------


def _run_frame(rows: list, P: int = 2, devices_per_node: int = 0):
    """A run's result rows as the cost model reads them (only the columns it uses)."""
    import pandas as pd
    base = {"layer": 0, "rank": 0, "phase": "", "pass": "", "sample": -1, "src_rank": -1, "dst_rank": -1,
            "unit": ""}
    df = pd.DataFrame([{**base, **r} for r in rows])
    ctx = {"world_size": P, "devices_per_node": devices_per_node, "hidden_size": 10, "expert_ffn_size": 10,
           "top_k": 1, "num_experts": 2, "tokens_per_rank": 100, "model": "toy", "run_dir": "x",
           "microbatches": 1}
    return df.assign(**ctx)


def _collective(phase, direction, src, dst, nbytes, calls, kind="all_to_all"):
    """The rows of ``calls`` collectives of one phase that moved ``nbytes`` from src to dst."""
    rows = [{"metric": "bytes", "value": nbytes, "unit": "bytes", "phase": phase, "pass": direction,
             "src_rank": src, "dst_rank": dst},
            {"metric": "rows", "value": nbytes / 80, "unit": "rows", "phase": phase, "pass": direction,
             "src_rank": src, "dst_rank": dst},
            {"metric": f"{kind}_calls", "value": calls, "unit": "calls", "phase": phase, "pass": direction}]
    rows += [{"metric": "a2a_time", "value": 1.0, "unit": "ms", "phase": phase, "pass": direction, "sample": 0}
             for _ in range(calls)]
    return rows


def test_broadcasts_are_priced_once_per_link_not_once_per_peer():
    link = Link(intra_latency_s=1e-5, intra_Bps=1e9)
    bytes_PP = torch.zeros(4, 4).numpy()
    bytes_PP[1, :] = 1e6                                  # rank 1's 1 MB to every rank
    assert pricing.rooted_seconds(bytes_PP, link, 1, "broadcast") == pytest.approx(1e-5 + 1e-3)
    assert pricing.a2a_seconds(bytes_PP, link, 1) == pytest.approx(1e-5 + 3e-3)     # what a per-peer model would say
    assert pricing.rooted_seconds(bytes_PP.T, link, 1, "reduce") == pytest.approx(1e-5 + 1e-3)


def test_a_pipelined_layer_is_projected_with_its_overlap():
    rows = (_collective("dispatch", "forward", 0, 1, 1e6, 2) + _collective("combine", "forward", 1, 0, 1e6, 2)
            + [{"metric": "tokens", "value": 100, "unit": "tokens", "rank": r} for r in (0, 1)]
            + [{"metric": "pipeline_degree", "value": 2, "unit": "chunks", "rank": r} for r in (0, 1)])
    profile = Profile("toy", 2, "float32", link=Link(intra_latency_s=0.0, intra_Bps=1e9, flops=3e7))
    proj = projection.project_run(_run_frame(rows), profile).set_index("component")
    # 1 ms per exchange, 2 ms of experts; 2 chunks: 0.5 + 1 + 0.5 + max(0.5 + 0.5, 1) = 3 ms, not 4
    assert proj.loc["a2a:dispatch", "ms"] == pytest.approx(1.0) and proj.loc["experts", "ms"] == pytest.approx(2.0)
    assert proj.loc["overlap", "ms"] == pytest.approx(-1.0) and proj.loc["moe", "ms"] == pytest.approx(3.0)


def test_weight_rows_are_resized_to_the_target_model():
    weight_row = 3 * 10 * 10 * 4                          # one expert of the run (D = F = 10, float32)
    rows = _collective("fetch_weights", "forward", 0, 1, 5 * weight_row, 1)
    rows[1]["value"] = 5                                    # five experts
    profile = Profile("toy", 2, "bfloat16", link=Link(intra_latency_s=0.0, intra_Bps=1e9))
    proj = projection.project_run(_run_frame(rows), profile, projection.Target("big", 100, 200, 1)).set_index("component")
    assert proj.loc["a2a:fetch_weights", "ms"] == pytest.approx(5 * 3 * 100 * 200 * 2 / 1e9 * 1e3)


def test_metadata_rows_keep_their_size_and_decode_pipelines_per_step():
    # 10 float64 metadata values a row: 80 bytes = D x 8, which only the metadata flag tells
    # apart from a float64 hidden row; as metadata it is not re-sized to the target's width
    meta = _collective("dispatch_meta", "forward", 0, 1, 800.0, 1)
    meta.append({**meta[0], "metric": "meta_bytes"})
    hidden = _collective("dispatch", "forward", 0, 1, 800.0, 1)
    profile = Profile("toy", 2, "float32", link=Link(intra_latency_s=0.0, intra_Bps=1e9))
    big = projection.Target("big", 100, 10, 1)
    proj = projection.project_run(_run_frame(meta + hidden), profile, big).set_index("component")
    assert proj.loc["a2a:dispatch_meta", "ms"] == pytest.approx(800 / 1e9 * 1e3)
    assert proj.loc["a2a:dispatch", "ms"] == pytest.approx(10 * 100 * 4 / 1e9 * 1e3)
    # decode: 3 steps of 2 chunks each; the counters add up over the steps
    rows = (_collective("dispatch", "forward", 0, 1, 1e6, 6) + _collective("combine", "forward", 1, 0, 1e6, 6)
            + _collective("counts", "forward", 0, 1, 16.0, 3)
            + [{"metric": m, "value": v, "unit": "", "rank": r} for r in (0, 1)
               for m, v in (("pipeline_degree", 6), ("pipeline_calls", 3))])
    run = _run_frame(rows)
    assert projection.pipeline_degree(run, 0) == 2 and projection.layer_calls(projection._collectives(run), 0) == 6


def test_runs_grouped_into_nodes_project_only_onto_the_same_layout():
    two_nodes, one_node = Link(1e-5, 1e9, devices_per_node=8), Link(1e-5, 1e9, devices_per_node=16)
    run = _run_frame([{"metric": "x", "value": 0}], P=16, devices_per_node=8)
    assert projection.same_nodes(run, two_nodes) and not projection.same_nodes(run, one_node)
    undeclared = _run_frame([{"metric": "x", "value": 0}], P=16, devices_per_node=0)
    assert projection.same_nodes(undeclared, two_nodes) and projection.same_nodes(undeclared, one_node)


# ---------------------------------------------------------------------------
# the report and its experiment
# ---------------------------------------------------------------------------


def test_node_traffic_and_exposed_communication_by_hand():
    from analysis.figures.strategies import exposed_ms, node_traffic
    sent = [(0, 1, 100.0), (0, 2, 50.0), (1, 3, 0.0), (2, 2, 999.0)]     # in-node, across, empty, to itself
    rows = [{"metric": "bytes", "value": v, "unit": "bytes", "phase": "dispatch", "pass": "forward",
             "src_rank": s, "dst_rank": d} for s, d, v in sent]
    spans = {(0, 0): {"dispatch": 2, "experts": 5, "combine": 1}, (0, 1): {"dispatch": 1, "experts": 9, "combine": 4},
             (1, 0): {"dispatch": 1, "experts": 5, "combine": 1}, (1, 1): {"dispatch": 0.5, "experts": 5, "combine": 0.5}}
    rows += [{"metric": "time", "value": v, "unit": "ms", "phase": phase, "pass": "forward", "sample": sample,
              "rank": rank} for (sample, rank), d in spans.items() for phase, v in d.items()]
    run = _run_frame(rows, P=4, devices_per_node=2)
    t = node_traffic(run)
    assert (t["intra_MB"], t["inter_MB"]) == pytest.approx((100e-6, 50e-6))
    assert t["inter_messages"] == pytest.approx(1 / 4)                 # one pair crossed nodes, 4 ranks, 1 layer
    # exposed = dispatch + combine; slowest rank per sample: 5 then 2; median 3.5
    assert exposed_ms(run) == pytest.approx(3.5)
    whole = _run_frame([{"metric": "time", "value": v, "unit": "ms", "phase": p, "pass": "forward", "sample": 0}
                        for p, v in (("moe", 10.0), ("experts", 4.0))])
    assert exposed_ms(whole) == pytest.approx(6.0)                     # a layer timed as one span, minus its experts


def test_the_strategies_experiment_runs_every_exact_system():
    from hydra import compose, initialize_config_dir
    from occult.config import CONF_DIR, register
    from systems import exact_systems
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=strategies"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    measured = set(params["m/system"].split(",")) | {params["placed/system"]} | set(params["sc/system"].split(","))
    exact = {name for name in exact_systems() if "(" not in name}     # not the variants (other paths, loss off)
    assert measured == exact, exact ^ measured
    assert params["sc/model"] == "scmoe_proxy" and str(params["mig/task.migration"]) == "true"
    assert str(params["b16/cluster.world_size"]) == "16" and str(params["b16/cluster.devices_per_node"]) == "8"
    assert params["r8/system.profile"] == "sim_h100x8" and params["r16/system.profile"] == "sim_h100x2node"
    # the schedules (docs/schedules.md): co-executed micro-batches, prefill and train; the gradient syncs
    assert str(params["mb/task.microbatches"]) == "2" and set(params["mb/task"].split(",")) == {"prefill", "train"}
    assert set(params["gs/task.grad_sync"].split(",")) == {"overlap", "lina"} and params["gs/task"] == "train"


def test_modern_models_runs_every_exact_system_on_todays_proxies():
    from hydra import compose, initialize_config_dir
    from occult.config import CONF_DIR, register
    from systems import exact_systems
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=modern_models"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    # occult_placed needs an artifact; scmoe overlaps only in its own shortcut-connected proxy
    exact = {name for name in exact_systems() if "(" not in name} - {"occult_placed", "scmoe"}
    assert set(params["system"].split(",")) == exact, exact ^ set(params["system"].split(","))
    assert set(params["model"].split(",")) == {"deepseek_v3_proxy", "qwen3_moe_proxy", "mixtral_proxy"}
    assert set(params["task"].split(",")) == {"prefill", "decode", "train"} and params["cluster"] == "cpu4"


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_modern_models_experiment_runs_and_reports(tmp_path):
    """experiment=modern_models end to end on random-init, shrunk proxies: every point
    parity-gated with its model's router and measured, and the strategies report."""
    import subprocess
    import sys
    from pathlib import Path

    import pandas as pd
    root = Path(__file__).resolve().parent.parent
    tiny = ["model.init=random", "model.hidden_size=32", "model.expert_ffn_size=16", "model.num_layers=2",
            "task.batch_size=2", "task.seq_len=16", "task.warmup=0", "task.iters=1"]
    proc = subprocess.run([sys.executable, "run.py", "experiment=modern_models", *tiny,
                           f"hydra.sweep.dir={tmp_path}"], cwd=root, capture_output=True, text=True, timeout=3500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    frames = [pd.read_parquet(p) for p in tmp_path.rglob("results.parquet")]
    assert len(frames) == 3 * 3 * 12
    for df in frames:
        assert (df[df.metric == "parity_checked"].value == 1).all(), df.run_id.iloc[0]
    assert (tmp_path / "report.md").is_file()


def _schedule_run(task: str, label: str, latency: float, rows: list, settings: dict = None):
    """A whole-model run at P = 4 of naive on a toy model: its latency row and ``rows``, with
    ``settings`` as its columns (None: a table written before they were columns, whose rows
    hold them)."""
    import pandas as pd
    from analysis.summary import RUN_KEYS
    metric, phase = {"prefill": ("ttft", "prefill"), "train": ("step_time", "train")}[task]
    base = {"layer": -1, "rank": -1, "phase": "", "pass": "", "sample": -1, "unit": ""}
    df = pd.DataFrame([{**base, **r} for r in [{"metric": metric, "value": latency, "phase": phase, "sample": 0},
                                                *rows]])
    keys = {k: 0 for k in RUN_KEYS} | {"experiment": "x", "model": "toy", "task": task, "cluster": "cpu4",
                                       "world_size": 4, "routing": "router", "placement": ""} | (settings or {})
    return df.assign(**keys, system="naive", impl="harness", label=label, system_options="{}", run_dir="x",
                     run_id=f"{task}/{label}")


def _schedule_runs(old: bool):
    """Four runs (plain and scheduled prefill and train): in today's table, their settings as
    columns; ``old``: as a table written at 57d74c1 held them, metric rows of rank 0 (the
    gradient sync's schedule as its index in GRAD_SYNCS then)."""
    import pandas as pd
    fwd = lambda rank, v, phase="dispatch": {"metric": "a2a_time", "value": v, "phase": phase, "pass": "forward",
                                            "layer": 0, "rank": rank, "sample": 0}
    waits = lambda rank, v: {"metric": "time", "value": v, "phase": "exposed_comm", "pass": "forward", "layer": 0,
                             "rank": rank, "sample": 0}
    settings = lambda mb, sync: (None if old else {"microbatches": mb, "grad_sync": sync, "migration": False,
                                                   "dispatch_mode": "dynamic"})
    old_rows = lambda *rows: list(rows) if old else []
    return pd.concat([
        _schedule_run("prefill", "", 10.0, [fwd(0, 2.0), fwd(0, 1.0, "combine"), fwd(1, 4.0),
                                            *old_rows({"metric": "microbatches", "value": 1})], settings(1, "")),
        _schedule_run("prefill", "mb2", 8.0, [fwd(0, 5.0), fwd(1, 5.0), waits(0, 1.0), waits(0, 0.5), waits(1, 2.0),
                                              *old_rows({"metric": "microbatches", "value": 2})], settings(2, "")),
        _schedule_run("train", "", 20.0, [fwd(0, 1.0), *old_rows({"metric": "microbatches", "value": 1},
                                                                 {"metric": "grad_sync_mode", "value": 0})],
                      settings(1, "end")),
        _schedule_run("train", "lina", 30.0, [
            fwd(0, 1.0), *old_rows({"metric": "microbatches", "value": 1}, {"metric": "grad_sync_mode", "value": 2}),
            {"metric": "time", "value": 3.0, "phase": "grad_sync", "pass": "backward", "rank": 0, "sample": 0},
            {"metric": "grad_sync_allreduces", "value": 21, "rank": 0, "sample": 0},
            {"metric": "grad_sync_started_in_backward", "value": 9, "rank": 0, "sample": 0}], settings(1, "lina"))],
        ignore_index=True)


def test_the_schedules_section_by_hand():
    """Co-executed micro-batches: their exposed waits beside a plain run's collective time;
    the gradient sync's all-reduce left after the backward and its calls; latencies over the
    same system's plain run. A table written at 57d74c1 (settings as metric rows) gives the
    same section once loaded (:func:`analysis.load.settings_as_columns`)."""
    import pandas as pd
    from analysis.figures.strategies import schedules
    from analysis.load import settings_as_columns
    df = _schedule_runs(old=False)
    old = settings_as_columns(_schedule_runs(old=True))
    assert set(old.metric) == set(df.metric) and len(old) == len(df)      # the settings' rows read as columns
    [(_, from_old)] = schedules(old)[0].tables
    [section] = schedules(df)
    pd.testing.assert_frame_equal(from_old, section.tables[0][1], check_like=True)
    t = section.tables[0][1].set_index(["task", "label"])
    assert t.loc[("prefill", ""), "exposed_comm_ms_per_layer"] == t.loc[("prefill", ""), "collectives_ms_per_layer"] == 4.0
    assert t.loc[("prefill", "mb2"), "exposed_comm_ms_per_layer"] == 2.0          # slowest rank's waits
    assert t.loc[("prefill", "mb2"), "vs_plain"] == pytest.approx(0.8)
    lina = t.loc[("train", "lina")]
    assert (lina.grad_sync, lina.vs_plain, lina.grad_sync_exposed_ms) == ("lina", 1.5, 3.0)
    assert (lina.allreduces, lina.allreduces_in_backward) == (21, 9)
