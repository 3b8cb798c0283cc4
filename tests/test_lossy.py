"""The lossy systems (compressed payloads, lsh, luffy, adaptive_topk): their bytes are what
they claim (by hand), they compute what their docstrings state (against independent
single-device statements), and their options are checked. With their loss switched
off they are in the parity suite (tests/systems.py, ``lossless_options``).

Shapes: D hidden, e local experts.
"""
import numpy as np
import pytest

from occult.dist import launch
from occult.ep import system_config
from occult.errors import ConfigError
from occult.parity import LayerCase

from lossy_helpers import lossy_world
from systems import system

P, E, D = 2, 8, 16
e = E // P
NAIVE, OCCULT = "baselines.naive.NaiveDispatcher", "occult.collab.dispatcher.OccultDispatcher"
LSH, ADAPTIVE = "baselines.lsh.LSHDispatcher", "baselines.adaptive_topk.AdaptiveTopKDispatcher"
LUFFY = "baselines.luffy.LuffyDispatcher"

# (system, hand-computed wire bytes per row of: dispatch, combine; the tolerance of the output)
PAYLOAD_CASES = [
    (system(NAIVE, payload="int8"), D + 4, D + 4, 4e-2),
    (system(NAIVE, payload="bf16"), 2 * D, 2 * D, 2e-2),
    (system(NAIVE, payload="fp8", combine_payload="bf16"), D + 4, 2 * D, 0.15),
    (system(OCCULT, payload="int8"), D + 4 + 4 * e, D + 4, 4e-2),      # + e float32 gate weights
    (system(OCCULT, payload="bf16"), 2 * D + 4 * e, 2 * D, 2e-2),
    (system(OCCULT, payload="fp8"), D + 4 + 4 * e, D + 4, 0.15),
]
PAYLOAD_CASE = LayerCase(E, 2, (20, 13), hidden=D, routing="router", seed=11, dtype="float32")
LSH_CASE = LayerCase(E, 2, (40, 33), hidden=D, routing="uniform", seed=12)
ADAPTIVE_CASE = LayerCase(E, 4, (30, 21), hidden=D, routing="router", seed=13)
LOSSY_JOBS = ([("lsh", system(LSH, bits=b), LSH_CASE) for b in (0, 1, 3)]
              + [("luffy", system(LUFFY, threshold=0.3), LSH_CASE)]      # threshold 1: REPEAT_JOBS
              + [("adaptive", system(ADAPTIVE, base=b, threshold=0.3), ADAPTIVE_CASE)
                 for b in ("naive", "occult", "megablocks")])
# Luffy's exact case on tokens that repeat (each rank's tokens twice; the router routes)
REPEAT_CASE = LayerCase(E, 2, (40, 33), hidden=D, routing="router", seed=12)
REPEAT_JOBS = [(system(LUFFY, threshold=1.0), REPEAT_CASE)]


@pytest.fixture(scope="module")
def world():
    grid = [(s, PAYLOAD_CASE, None) for s, *_ in PAYLOAD_CASES]
    return launch(lossy_world, P, (grid, LOSSY_JOBS, REPEAT_JOBS), timeout_s=240, collective_timeout_s=60)


@pytest.mark.timeout(300)
def test_compressed_payload_bytes_by_hand(world):
    for rank, (grid, *_) in enumerate(world):
        for (sysd, dispatch_bytes, combine_bytes, tol), res in zip(PAYLOAD_CASES, grid):
            want = {"dispatch": dispatch_bytes, "combine": combine_bytes}
            seen = set()
            for ev in res["comm"]:
                if ev.phase in want:
                    # rows x (D values at the payload's size + its scale + metadata), both passes
                    assert ev.row_bytes == want[ev.phase], (sysd, ev)
                    seen.add((ev.phase, ev.direction))
            assert seen == {(p, d) for p in want for d in ("forward", "backward")}, (sysd, seen)
            errs = res["errors"]
            assert 0 < errs["out"] <= tol, (sysd, errs)          # lossy, within the payload's precision
            assert errs["grad_x"] <= 2 * tol and errs["grad_w_down"] <= 2 * tol, (sysd, errs)


@pytest.mark.timeout(300)
def test_lsh_and_adaptive_compute_what_they_state(world):
    for rank, (_, checks, _) in enumerate(world):
        for (kind, sysd, case), res in zip(LOSSY_JOBS, checks):
            assert res["err"] <= 1e-9, (rank, sysd, res)
            assert res["grad_finite"], (rank, sysd, res)
            if kind == "lsh" and sysd["bits"] == 0:
                assert res["sent_rows"] == res["pairs"], res        # every pair its own bucket
            elif kind in ("lsh", "luffy"):
                assert 0 < res["sent_rows"] < res["pairs"], res     # centroids / leaders: fewer rows than pairs
            else:
                assert res["kept_pairs"] < res["pairs"], res        # threshold 0.3 drops pairs
                if sysd["base"] != "occult":                        # one row per kept pair
                    assert res["sent_rows"] == res["kept_pairs"], res


@pytest.mark.timeout(300)
def test_luffy_at_threshold_1_on_repeated_tokens_is_exact_but_for_each_copys_input_gradient(world):
    """Luffy at threshold 1 on tokens that repeat condenses (each copy shares its first
    copy's row) and against the single-device reference gives the output, the router's and
    the experts' gradients, and the input gradient summed over each token's copies, to
    float64 rounding; each copy's own input gradient is not (the first copy gets the sum):
    why training at threshold 1 is refused (next test)."""
    for rank, (*_, repeats) in enumerate(world):
        for (sysd, case), res in zip(REPEAT_JOBS, repeats):
            assert res["sent_rows"] < res["pairs"], (rank, res)        # the condensation condenses
            exact = {k: v for k, v in res.items() if k.startswith(("out", "grad_")) and k != "grad_x"}
            assert all(v <= 1e-9 for v in exact.values()), (rank, exact)
            assert res["grad_x"] > 1e-3, (rank, res)


def test_luffy_refuses_training_at_threshold_1_in_one_line():
    """At threshold 1 Luffy's backward is not each token's gradient (previous test): a
    training task is refused at validation, in one line naming the field; threshold < 1
    trains (lossy by design) and threshold 1 runs the tasks without a backward to train."""
    from hydra import initialize_config_dir
    from test_task_options import cfg_with, spec_of

    from occult.config import CONF_DIR
    from occult.tasks.compare import prepare
    from occult.validate import validate
    with pytest.raises(ConfigError) as err:
        validate(cfg_with("task=train", "model=olmoe_proxy", "system=luffy", "system.threshold=1.0"))
    assert str(err.value).startswith("system.threshold=1.0: task=train would train through Luffy's condensation")
    assert "\n" not in str(err.value)
    bench = spec_of("task=bench_model", "model=olmoe_proxy", "task.workload=train",
                    "task.compare=[naive,{name:luffy,threshold:1.0}]")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"), \
            pytest.raises(ConfigError, match=r"^task.compare\[1\]: system.threshold=1.0: task=train"):
        prepare(bench)
    config = system_config(system(LUFFY, threshold=1.0))
    with pytest.raises(ValueError, match=r"^system.threshold=1.0: task=finetune"):
        config.check_task("finetune")
    for task in ("prefill", "decode", "layer", "bench", "bench_model"):
        config.check_task(task)
    system_config(system(LUFFY, threshold=0.9)).check_task("train")


@pytest.mark.parametrize("options, field", [
    ({"_target_": NAIVE, "payload": "int4"}, "system.payload"),
    ({"_target_": OCCULT, "combine_payload": "fp16"}, "system.combine_payload"),
    ({"_target_": LSH, "bits": 17}, "system.bits"),
    ({"_target_": LUFFY, "threshold": 1.5}, "system.threshold"),
    ({"_target_": LUFFY, "threshold": -2.0}, "system.threshold"),
    ({"_target_": ADAPTIVE, "threshold": 1.0}, "system.threshold"),
    ({"_target_": ADAPTIVE, "base": "tutel"}, "system.base"),
    ({"_target_": ADAPTIVE, "base": "baselines.tutel.TutelDispatcher"}, "does not take dropped pairs"),
    ({"_target_": ADAPTIVE, "base_options": {"payload": "int4"}}, "system.payload"),
])
def test_lossy_options_are_checked(options, field):
    options = dict(options)
    with pytest.raises((ValueError, ConfigError), match=field):
        target = options.pop("_target_")
        system_config(system(target, **options)).check(num_experts=E, top_k=2, world_size=P)


def test_compressed_rows_keep_their_size_in_projections():
    from analysis.projection import wire_matrix
    rows, D_run, D_target = 10, 16, 64
    meta = np.full((2, 2), rows / 4 * 8.0)             # scale + 1 weight per row, float32
    int8 = np.full((2, 2), rows / 4 * D_run * 1.0)     # 1 byte per element
    fp32 = np.full((2, 2), rows / 4 * D_run * 4.0)
    # int8 onto a bf16 target: still 1 byte per element, scale and weights as they were
    assert np.allclose(wire_matrix(int8, meta, rows, D_run, D_target, 2), rows / 4 * D_target + meta)
    # float32 onto bf16: 2 bytes per element, metadata values at 2 bytes too
    assert np.allclose(wire_matrix(fp32, meta, rows, D_run, D_target, 2), rows / 4 * D_target * 2 + meta / 2)
    # rows that are not hidden-state rows keep their bytes
    assert wire_matrix(fp32 * 1000, meta, rows, D_run, D_target, 2) is None


def test_adaptive_topk_takes_any_system_that_takes_dropped_pairs():
    pruned = system(ADAPTIVE, base="occult.collab.variants.OccultScorePruningDispatcher", base_options={"budget": 1})
    config = system_config(pruned)
    config.check(num_experts=E, top_k=2, world_size=P)
    assert config.base_config().budget == 1 and not config.is_exact()


def test_luffy_clusters_follow_their_definition():
    """Leader clustering on worked examples: identical tokens share a leader at threshold 1
    (a scaled copy does not), cosine similarity decides below 1, and groups never mix."""
    import torch

    from baselines.luffy import leader_clusters

    x_RD = torch.tensor([[1.0, 0.0], [2.0, 0.0], [1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [1.0, 0.0]],
                        dtype=torch.float64)
    group_R = torch.tensor([0, 0, 0, 0, 0, 1])
    assert leader_clusters(x_RD, group_R, 1.0).tolist() == [0, 1, 0, 3, 4, 5]
    assert leader_clusters(x_RD, group_R, 0.95).tolist() == [0, 0, 0, 0, 4, 5]   # cos(0.9, 0.1) ~ 0.994
    assert leader_clusters(x_RD, group_R, -1.0).tolist() == [0, 0, 0, 0, 0, 5]
    # a later pair joins the first leader it is close to, not the closest one
    y_RD = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]], dtype=torch.float64)
    assert leader_clusters(y_RD, torch.zeros(3, dtype=torch.long), 0.5).tolist() == [0, 1, 0]
    assert leader_clusters(x_RD[:0], group_R[:0], 0.5).numel() == 0


def test_adaptive_keep_follows_its_definition():
    """Which experts a token keeps, against the rule written out token by token
    (lossy_helpers.adaptive_by_hand) and against examples worked by hand."""
    import torch

    from baselines.adaptive_topk import adaptive_keep
    from lossy_helpers import adaptive_by_hand

    w_TK = torch.tensor([[0.1, 0.5, 0.3, 0.1],        # 0.5, then 0.3 reach 0.75: slots 1 and 2
                         [0.25, 0.25, 0.25, 0.25],    # three of four reach 0.75; a tie keeps the lower slots
                         [0.9, 0.05, 0.03, 0.02]],    # one is enough
                        dtype=torch.float64)
    want = [[False, True, True, False], [True, True, True, False], [True, False, False, False]]
    assert adaptive_keep(w_TK, 0.25).tolist() == want
    assert adaptive_keep(w_TK, 0.0).all()                      # threshold 0 keeps every expert
    g = torch.Generator(device="cpu").manual_seed(3)
    for threshold in (0.05, 0.2, 0.5, 0.9):
        w = torch.rand(200, 6, generator=g, dtype=torch.float64)
        ids = torch.arange(6).repeat(200, 1)
        kept_ids, _ = adaptive_by_hand(ids, w, threshold)
        assert torch.equal(adaptive_keep(w, threshold), kept_ids >= 0), threshold


def test_luffy_sits_beside_lsh_in_the_lossy_front():
    from hydra import compose, initialize_config_dir

    from analysis.figures.lossy_front import family_of
    from occult.config import CONF_DIR, register
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        params = compose("config", overrides=["experiment=lossy_front"], return_hydra_config=True).hydra.sweeper.params
    assert params["luffy/system"] == "luffy" and params["lsh/system"] == "lsh"
    assert family_of("luffy_0.9") == "luffy" and family_of("lsh_4") == "lsh"
