"""Traffic plans (occult.ep.plan) and task=simulate.

Simulated equals measured: every planned system (at its own options and at the options that
change its traffic) runs in a world of 8 ranks (one node, and as 2 nodes of 4) and, marked
``slow``, of 16 ranks as 2 nodes of 8; its plan for every rank, on the routing each rank
logged, must equal every rank's logged collectives per peer pair, forward and backward.
P = 1-4 are checked in the parity worlds (tests/test_parity.py). Then the plan core's own
rules, the systems left out, and task=simulate: one process for a world of 64 ranks, and one
line for each bad input.
"""
import dataclasses

import pandas as pd
import pytest
import torch

from occult.dist import launch
from occult.ep import system_config
from occult.ep.comm import ALL_TO_ALL
from occult.ep.plan import Planned, metadata_sends, returned, sends, world_traffic
from occult.parity import run_grid
from occult.validate import ConfigError, validate

from plan_helpers import (plan_disagreements, similarity_file, traffic_cases, traffic_jobs, traffic_systems)
from systems import system_configs
from test_task_options import cfg_with


@dataclasses.dataclass
class World:
    P: int
    devices_per_node: int
    labels: list
    results: list


def traffic_world(P: int, devices_per_node: int, layouts: tuple, folder, cases=None, timeout_s: float = 250) -> World:
    """Every planned system's traffic grid in one world of P ranks (``layouts``: the node
    layouts it runs in, None the world's own)."""
    systems = traffic_systems(similarity_file(folder, P))
    jobs, labels = traffic_jobs(P, systems, layouts, cases)
    results = launch(run_grid, P, (jobs,), timeout_s=timeout_s, collective_timeout_s=60,
                     devices_per_node=devices_per_node)
    return World(P, devices_per_node, labels, results)


def disagreements_of(world: World) -> list:
    failures = []
    for i, (name, case, system, groups, layout) in enumerate(world.labels):
        per_rank = [r[i] for r in world.results]
        G = world.devices_per_node if layout is None else layout
        failures += plan_disagreements(name, system, case, per_rank, world.P, G, groups)
    return failures


@pytest.fixture(scope="module")
def world8(tmp_path_factory) -> World:
    # one node, and the systems that read the node layout also as 2 nodes of 4
    return traffic_world(8, 0, (None, 4), tmp_path_factory.mktemp("similarity8"))


@pytest.mark.timeout(300)
def test_simulated_traffic_equals_what_8_ranks_logged(world8):
    failures = disagreements_of(world8)
    assert not failures, "\n".join(failures[:20])
    assert {label[0].split("(")[0] for label in world8.labels} == set(planned_names())


def _logged(world: World, name: str, phase: str, layout=None) -> int:
    """Rows ``name``'s runs (in ``layout``, None: the world's own) logged in ``phase`` over
    every case and rank (forward)."""
    return sum(sum(ev.rows_P) for i, label in enumerate(world.labels) if label[0] == name and label[4] == layout
               for r in world.results for ev in r[i]["comm"] if ev.phase == phase and ev.direction == "forward")


@pytest.mark.timeout(300)
def test_the_traffic_grid_runs_every_branch_of_the_plans(world8):
    """The cases exercise what the plans state: shadowed experts broadcast, both stages of
    the hierarchical exchange, ExFlow's top-1 and top-k legs, pairs dropped by capacity and
    by adaptive top-k, a second chunk."""
    assert _logged(world8, "shadow", "shadow_weights") > 0
    assert _logged(world8, "hierarchical", "dispatch_inter", layout=4) > 0
    assert _logged(world8, "hierarchical", "dispatch_intra", layout=4) > 0
    assert _logged(world8, "exflow", "combine") > 0 and _logged(world8, "exflow", "return_home") > 0
    top1 = [i for i, label in enumerate(world8.labels) if label[0] == "exflow" and label[1].top_k == 1]
    assert top1 and all(ev.phase != "combine" for i in top1 for r in world8.results for ev in r[i]["comm"])
    dropped = [i for i, label in enumerate(world8.labels) if label[0].startswith("adaptive_topk")]
    assert any(bool((r[i]["routing"][0] < 0).any()) for i in dropped for r in world8.results)
    chunks = [ev for i, label in enumerate(world8.labels) if label[0] == "pipelined(degree=4)"
              for ev in world8.results[0][i]["comm"] if ev.phase == "dispatch" and ev.direction == "forward"]
    assert len(chunks) == 4 * len(traffic_cases(8))


@pytest.mark.timeout(300)
def test_the_comparison_catches_a_plan_that_is_not_the_systems(world8):
    """Occult's logged rows against naive EP's plan on the same routing: they differ (the
    comparison can fail), and against its own they agree."""
    i = next(i for i, label in enumerate(world8.labels) if label[0] == "occult" and label[3] is None)
    name, case, system, groups, _ = world8.labels[i]
    per_rank = [r[i] for r in world8.results]
    naive = system_configs()["naive"]
    assert plan_disagreements("naive-for-occult", naive, case, per_rank, 8, 0, groups)
    assert not plan_disagreements(name, system, case, per_rank, 8, 0, groups)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_simulated_traffic_equals_what_16_ranks_as_2_nodes_of_8_logged(tmp_path):
    world = traffic_world(16, 8, (None,), tmp_path, timeout_s=850)
    failures = disagreements_of(world)
    assert not failures, "\n".join(failures[:20])


def planned_names() -> list:
    """conf/system names whose systems have a traffic plan."""
    return [name for name, cfg in system_configs().items()
            if system_config(cfg).expert_parallel and not system_config(cfg).plan_refusal()]


def test_every_expert_parallel_system_has_a_plan_but_lsh_and_luffy_which_say_why():
    from pathlib import Path
    unplanned = {name: system_config(cfg).plan_refusal() for name, cfg in system_configs().items()
                 if system_config(cfg).expert_parallel and system_config(cfg).plan_refusal()}
    assert set(unplanned) == {"lsh", "luffy"} and all("activations" in why for why in unplanned.values())
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert "`lsh`" in readme and "`luffy`" in readme and "[docs/simulate.md](docs/simulate.md)" in readme


def test_world_traffic_adds_the_ranks_and_transposes_returns_and_the_backward():
    P = 3
    plans = [[metadata_sends("counts", r, [1] * P, 8), sends("dispatch", r, [r, 1, 2 * r], 16),
              returned("combine", 1, 16)] for r in range(P)]
    world = world_traffic(plans, P)
    by = {(c.phase, c.direction): c for c in world}
    assert by[("dispatch", "forward")].rows_PP.tolist() == [[0, 1, 0], [1, 1, 2], [2, 1, 4]]
    assert torch.equal(by[("combine", "forward")].rows_PP, by[("dispatch", "forward")].rows_PP.t())
    assert torch.equal(by[("dispatch", "backward")].rows_PP, by[("combine", "forward")].rows_PP)
    assert ("counts", "backward") not in by          # metadata: no backward
    assert [c.kind for c in world] == [ALL_TO_ALL] * 5
    odd = [plans[0], plans[1], plans[2][:2] + [returned("combine", 1, 8)]]
    with pytest.raises(ValueError, match="rank 2's plan lists other collectives"):
        world_traffic(odd, P)
    with pytest.raises(ValueError, match="back=0"):
        returned("combine", 0, 8)
    assert Planned("x", ALL_TO_ALL, 8).back == 0


# ---------------------------------------------------------------------------
# task=simulate
# ---------------------------------------------------------------------------


def simulate_cfg(*overrides):
    return cfg_with("task=simulate", "task.routing=uniform", *overrides)


def simulated_rows(*overrides) -> pd.DataFrame:
    """task=simulate's rank function in this process (what the runner's one process runs)."""
    from occult.dist import RankContext
    from occult.ep.comm import EPGroup
    from occult.runner import build_spec
    from occult.tasks.simulate import run as run_rank
    spec = build_spec(simulate_cfg(*overrides), ".", "d")
    return pd.DataFrame(run_rank(RankContext(0, 1, EPGroup(), 0), spec))


@pytest.mark.timeout(120)
def test_simulate_plans_a_world_of_64_ranks_in_one_process():
    df = simulated_rows("cluster.world_size=64", "cluster.devices_per_node=8", "system=occult",
                        "task.tokens_per_rank=32")
    assert not {"time", "a2a_time", "a2a_wait"} & set(df.metric)
    sent = df[(df.metric == "rows") & (df.phase == "dispatch") & (df["pass"] == "forward")]
    assert len(sent) == 64 * 64 and set(sent.src_rank) == set(range(64))
    got = df[(df.metric == "received_rows") & (df.phase == "dispatch") & (df["pass"] == "forward")]
    assert got.value.sum() == sent.value.sum() > 0
    assert set(df[df.metric == "ct_all"]["rank"]) == set(range(-1, 64))
    for metric in ("planning_time", "planning_peak_memory", "intra_node_bytes", "inter_node_bytes",
                   "all_to_all_calls", "rows_per_token"):
        assert metric in set(df.metric), metric
    back = df[(df.metric == "rows") & (df.phase == "combine") & (df["pass"] == "backward")]
    assert back.value.sum() == sent.value.sum()          # the combine's backward is the dispatch again
    # intra + inter-node bytes are the bytes each rank sends to other ranks
    remote = df[(df.metric == "bytes") & (df.src_rank != df.dst_rank)].value.sum()
    assert df[df.metric.isin(["intra_node_bytes", "inter_node_bytes"])].value.sum() == remote


@pytest.mark.timeout(120)
def test_simulate_runs_in_one_process_and_labels_its_rows_simulated(tmp_path):
    from occult.runner import run
    cfg = simulate_cfg("cluster.world_size=8", "cluster.devices_per_node=4", "system=hierarchical",
                       "task.tokens_per_rank=16", "task.peer_rows=false", f"out_dir={tmp_path}")
    df = pd.read_parquet(run(cfg, tmp_path))
    assert set(df.clock) == {"simulated"} and set(df.world_size) == {8} and set(df.devices_per_node) == {4}
    assert "rows" not in set(df.metric) and (df.metric == "inter_node_bytes").any()      # per-rank totals only
    assert set(df[df.metric == "received_rows"]["rank"]) == set(range(8))


def _trace(folder, layers=(0,), expert=3, top_k=8) -> str:
    from occult.routing_traces import ROUTING_FILE
    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"layer": [layer for layer in layers for _ in range(top_k)], "rank": 0, "token": 0,
                  "slot": list(range(top_k)) * len(layers), "expert": [expert + k for k in range(top_k)] * len(layers),
                  "weight": 0.1}).to_parquet(folder / ROUTING_FILE, index=False)
    return str(folder)


@pytest.mark.parametrize("overrides, line", [
    (["cluster.world_size=48"], r"^model.num_experts=64 is not divisible by the world size 48"),
    (["cluster.world_size=64", "cluster.devices_per_node=6"],
     r"^cluster.devices_per_node=6: allowed values are 0 \(one node\) or a divisor of cluster.world_size=64"),
    (["task.routing=router"], r"^task.routing=router routes held-out text through the model's routers; "
                              r"model=layer_small is a layer-only config"),
    (["task.routing=trace"], r"^task.trace is not set: task.routing=trace needs a run folder"),
    (["system=lsh"], r"^system=lsh has no traffic plan: its rows are bucket centroids"),
    (["system=luffy"], r"^system=luffy has no traffic plan: its rows are cluster representatives"),
    (["system=reference"], r"^system=reference has no expert-parallel dispatcher; task=simulate needs one"),
])
def test_simulate_refuses_bad_input_in_one_line(overrides, line):
    with pytest.raises(ConfigError, match=line) as err:
        validate(simulate_cfg(*overrides))
    assert "\n" not in str(err.value)


def test_simulate_refuses_a_trace_of_another_model_in_one_line(tmp_path):
    ok = _trace(tmp_path / "ok")
    validate(cfg_with("task=simulate", "task.routing=trace", f"task.trace={ok}"))
    cases = [(_trace(tmp_path / "ids", expert=60), r"routes to expert ids 60..67; model=layer_small has "
                                                   r"model.num_experts=64 \(ids 0..63\)"),
             (_trace(tmp_path / "layers", layers=(0, 1)), r"has 2 MoE layer\(s\) \[0, 1\]; model=layer_small has 1: \[0\]"),
             (_trace(tmp_path / "k", top_k=4), r"has top-4 routing; model=layer_small has model.top_k=8")]
    for trace, line in cases:
        with pytest.raises(ConfigError, match=line) as err:
            validate(cfg_with("task=simulate", "task.routing=trace", f"task.trace={trace}"))
        assert "\n" not in str(err.value)
