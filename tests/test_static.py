"""Static-shape dispatch (``system.dispatch_mode=static``, :mod:`occult.ep.static`).

Its exactness is the parity suite's (tests/test_parity.py: naive and occult with
dispatch_mode=static are other exact paths of theirs, in every world, forward and
backward, with their traffic plans equal to what the ranks logged). Here: a static step
does nothing that synchronises a GPU (occult.ep.host_sync's guard, on an MoELayer in the
P = 2 world and a model's EPMoEBlock on one rank, on the contiguous placement and on
EPLB's slots; each kind of synchronisation put back into the path is caught); the decode
task runs its steps static on every proxy (in tests/test_devices.py's world, and behind its
parity gate here, slow); the bad inputs (too many tokens, a system without a static path,
CUDA graphs without CUDA or on a dynamic dispatch).
"""
import pytest
import torch
from hydra import compose, initialize_config_dir

from occult.config import CONF_DIR, register
from occult.dist import launch
from occult.ep import EPGroup, MoELayer, Placement, Recorder, import_object, system_config
from occult.ep.experts import init_expert_weights
from occult.parity import LayerCase
from occult.runner import build_spec
from occult.validate import ConfigError, validate

from static_helpers import INJECTIONS, NAIVE, OCCULT, STATIC_PROXIES, check_static_decode

P = 2
STATIC = {"dispatch_mode": "static"}


def _sys(target: str, **options) -> dict:
    return {"name": target.rsplit(".", 1)[-1], "_target_": target, **options}


# where the guarded world puts a synchronisation back: naive's and occult's static path
INJECT_AT = {"naive": "occult.ep.static.pair_slots", "occult": "occult.collab.static.weights_table"}


@pytest.fixture(scope="module")
def guarded():
    """One P = 2 world: static naive and occult, each a forward and backward with what would
    synchronise a GPU refused (occult.ep.host_sync), on the contiguous placement and on EPLB's
    slots (round_robin and local_first copies); the dynamic path; a recorder on the
    synchronised clock; and each kind of synchronisation put back into the static paths. (A
    model's EPMoEBlock: in one process, below: the world's ranks would import transformers.)"""
    pytest.importorskip("eplb")
    case = LayerCase(8, 2, (5, 3), routing="uniform", seed=1)
    naive, occult = _sys(NAIVE, **STATIC), _sys(OCCULT, **STATIC)
    jobs = [(f"{name} static {where}", system, case, where)
            for name, system in (("naive", naive), ("occult", occult)) for where in ("layer", "slots")]
    jobs += [(f"{name} static slots local_first", {**system, "replica_policy": "local_first"}, case, "slots")
             for name, system in (("naive", naive), ("occult", occult))]
    jobs += [("naive dynamic", _sys(NAIVE), case, "layer"), ("naive static clock", naive, case, "clock")]
    jobs += [(f"{name} + {sync}", system, case, f"inject:{sync}:{INJECT_AT[name]}")
             for name, system in (("naive", naive), ("occult", occult)) for sync in INJECTIONS]
    return launch(import_object("static_helpers.guarded_steps"), P, (jobs,), timeout_s=150, collective_timeout_s=30)


@pytest.mark.timeout(200)
def test_a_static_step_does_nothing_that_synchronises_a_gpu(guarded):
    """An MoELayer's static step, forward and backward, on both placement kinds (round_robin
    and local_first copies on EPLB's slots): no host read, no data-dependent shape, timed by
    marks."""
    for rank_out in guarded:
        steps = [label for label in rank_out if " static " in label and "clock" not in label]
        assert len(steps) == 6
        check_guarded(rank_out, steps)
        # the dynamic path counts its rows and reads the counts on the host (split sizes): the guard sees it
        assert rank_out["naive dynamic"][0].endswith("inside a static step"), rank_out["naive dynamic"]
        # the synchronised clock waits for the device: a static step times by marks
        assert rank_out["naive static clock"][0].startswith("occult.ep.measure.clock() synchronises")


def check_guarded(out: dict, labels: list) -> None:
    """Each guarded step of ``labels`` ran, and logged padding beside its valid rows."""
    for label in labels:
        status, rows = out[label]
        assert status == "ok", (label, status, rows)
        # padding travels on gloo: fewer valid rows than wire rows, none lost
        assert 0 < rows["valid_rows"] < rows["rows"] == rows["valid_rows"] + rows["padding_wire_rows"], (label, rows)


def test_a_models_static_block_does_nothing_that_synchronises_a_gpu():
    """A model's EPMoEBlock (the tiny OLMoE proxy's, its own router module) with static naive
    and occult, on the contiguous placement and on EPLB's slots: forward and backward under
    the guard, on one rank (its collectives local copies, logged like the world's)."""
    pytest.importorskip("eplb")
    from types import SimpleNamespace
    from static_helpers import guarded_steps
    ctx = SimpleNamespace(rank=0, world_size=1, ep=EPGroup(), device="cpu")
    jobs = [(f"{name} block {where}", _sys(target, **STATIC), None, where)
            for name, target in (("naive", NAIVE), ("occult", OCCULT)) for where in ("block", "block slots")]
    check_guarded(guarded_steps(ctx, jobs), [label for label, *_ in jobs])


@pytest.mark.timeout(200)
def test_what_synchronises_a_gpu_put_back_into_the_static_path_fails_the_guard(guarded):
    for rank_out in guarded:
        for name in ("naive", "occult"):
            for sync, (_, message) in INJECTIONS.items():
                status = rank_out[f"{name} + {sync}"][0]
                assert status.startswith(message) and status.endswith("inside a static step"), (name, sync, status)


def _one_rank_layer(system: dict, tokens: int, E: int = 8, K: int = 2):
    g = torch.Generator(device="cpu").manual_seed(0)
    weights = init_expert_weights(E, 16, 8, g, torch.float64)
    router = torch.randn(E, 16, generator=g, device="cpu", dtype=torch.float64)
    layer = MoELayer.from_global(router, weights, K, system_config(system).build(EPGroup(), 0, E))
    return layer, torch.randn(tokens, 16, generator=g, device="cpu", dtype=torch.float64)


@pytest.mark.parametrize("target", [NAIVE, OCCULT])
def test_more_tokens_than_max_tokens_per_rank_is_refused_naming_the_largest_seen(target):
    layer, x = _one_rank_layer(_sys(target, dispatch_mode="static", max_tokens_per_rank=4), tokens=6)
    layer(x[:4], Recorder())                    # at capacity: runs
    with pytest.raises(ValueError, match=r"system.max_tokens_per_rank=4 is below the tokens a rank has: rank 0 "
                                         r"has 6 tokens in one call of layer 0 \(the largest seen\)"):
        layer(x, Recorder())


def test_an_unsized_static_system_is_refused_at_its_first_call():
    layer, x = _one_rank_layer(_sys(NAIVE, dispatch_mode="static"), tokens=3)
    with pytest.raises(ValueError, match=r"system.max_tokens_per_rank is unset"):
        layer(x)


def cfg_with(*overrides):
    register()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=list(overrides))


@pytest.mark.parametrize("overrides, message", [
    (["system=megablocks", "system.dispatch_mode=static"],
     r"system.dispatch_mode=static: system=megablocks does not take system.dispatch_mode=static: MegaBlocks' "
     r"block-padded .*allowed value: "
     r"dynamic"),
    (["system=tutel_harness", "+system.dispatch_mode=static"],
     r"system.dispatch_mode: unknown option of system 'tutel_harness'; allowed: "),
    (["system=naive", "system.dispatch_mode=fixed"], r"system.dispatch_mode='fixed': allowed values are "
                                                     r"\['dynamic', 'static'\]"),
    (["system=naive", "system.dispatch_mode=static", "system.payload=int8"],
     r"system.dispatch_mode=static sends rows as they are: allowed payloads with it are payload=fp32"),
    (["system=occult", "system.dispatch_mode=static", "system.kernels=torch"],
     r"system.kernels='torch': dispatch_mode=static has one experts step of its own .* allowed value with it: auto"),
    (["system=naive", "system.max_tokens_per_rank=-1"], r"system.max_tokens_per_rank=-1: must be >= 0"),
    (["system=occult", "system.dispatch_mode=static", "system.replica_policy=collaborative"],
     r"system.replica_policy='collaborative': its choice is made on the host, which dispatch_mode=static may not "
     r"read; allowed values with it: \['round_robin', 'local_first'\]"),
    (["task=decode", "model=olmoe_proxy", "system=occult", "system.dispatch_mode=static", "task.cuda_graph=true"],
     r"task.cuda_graph=true captures the decode step in a CUDA graph, which needs CUDA ranks .*Allowed value here: "
     r"false"),
])
def test_bad_static_inputs_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(cfg_with(*overrides))


def test_cuda_graph_on_a_dynamic_dispatch_is_refused_with_the_reason():
    from occult.ep.graphs import refusal
    assert "needs system.dispatch_mode=static" in refusal("nccl", static=False, cuda=True)
    assert refusal("nccl", static=True, cuda=True) == ""
    assert "torch.cuda.is_available() is False" in refusal("nccl", static=True, cuda=False)


TINY = ["model.init=random", "model.hidden_size=32", "model.expert_ffn_size=16", "model.num_layers=2",
        "task.batch_size=2", "task.seq_len=8", "task.warmup=0", "task.iters=1", "task.new_tokens=2"]


def _decode_job(model: str, system: str, static: bool, tmp_path) -> tuple:
    cfg = cfg_with("task=decode", f"model={model}", f"cluster=cpu{P}", f"system={system}", *TINY,
                   *(["system.dispatch_mode=static"] if static else []))
    validate(cfg)
    spec = build_spec(cfg, tmp_path, "d")
    spec = import_object(spec.task.prepare)(spec)
    return f"{model}/{system}/{'static' if static else 'dynamic'}", spec.task.entry, spec


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_decode_runs_its_steps_static_on_every_proxy_behind_its_parity_gate(tmp_path):
    """task=decode with system.dispatch_mode=static on each proxy (random weights, P = 2), each
    run's parity gate first (the default suite runs the same decode steps without the gate in
    tests/test_devices.py's world): static_helpers.check_static_decode on every rank."""
    jobs = [_decode_job(m, s, True, tmp_path / f"{m}-{s}") for m in STATIC_PROXIES for s in ("naive", "occult")]
    jobs.append(_decode_job("olmoe_proxy", "naive", False, tmp_path / "dynamic"))
    per_rank = launch(import_object("helpers.task_rows"), P, (jobs,), timeout_s=560, collective_timeout_s=60)
    for rank, rank_out in enumerate(per_rank):
        for label, rows in rank_out.items():
            assert [r["value"] for r in rows if r["metric"] == "parity_checked" and r["rank"] == rank] == [1.0]
            check_static_decode(rows, rank, label, static=label.endswith("static"))
