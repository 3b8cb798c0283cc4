"""Micro-batch co-execution's turns (occult.ep.strands), in one process: the strands take
turns at their collectives, round robin, and a strand's error reaches the caller. (Against
the single-device model, with gradients, at P = 2 and 4: test_models.)"""
import threading

import pytest

from occult.ep import Exchange, Recorder
from occult.ep.strands import co_execute, current_strand


def strand_body(name: str, steps: int, log: list):
    def run():
        for i in range(steps):
            log.append(f"{name}{i}")                 # compute, then a collective starts ...
            current_strand().await_work(None, Exchange(i, "dispatch", REC), "forward")
        log.append(f"{name}-end")
        return name
    return run


REC = Recorder()


def test_strands_take_turns_at_each_collective_round_robin():
    log: list = []
    REC.clear()
    out = co_execute([strand_body("a", 3, log), strand_body("b", 2, log), strand_body("c", 1, log)], "cpu")
    assert out == ["a", "b", "c"]
    assert log == ["a0", "b0", "c0", "a1", "b1", "c-end", "a2", "b-end", "a-end"]
    # every collective's exposed time is logged, on the caller's thread once the strands have ended
    assert sorted(layer for layer, name, _, _ in REC.spans if name == "exposed_comm") == [0, 0, 0, 1, 1, 2]


def test_one_micro_batch_runs_inline_and_a_strands_error_reaches_the_caller():
    me = threading.get_ident()
    assert co_execute([lambda: (threading.get_ident(), current_strand())], "cpu") == [(me, None)]

    def bad():
        raise ValueError("strand 1 failed")
    with pytest.raises(ValueError, match="strand 1 failed"):
        co_execute([strand_body("a", 2, []), bad], "cpu")


def _static_layer(E: int = 8, K: int = 2, tokens: int = 3):
    """A one-rank naive layer with the static dispatch (fixed buffers of 4 tokens), float64."""
    import torch
    from occult.ep import EPGroup, MoELayer, system_config
    from occult.ep.experts import init_expert_weights
    g = torch.Generator(device="cpu").manual_seed(0)
    weights = init_expert_weights(E, 16, 8, g, torch.float64)
    router = torch.randn(E, 16, generator=g, device="cpu", dtype=torch.float64)
    system = {"name": "naive", "_target_": "baselines.naive.NaiveDispatcher", "dispatch_mode": "static",
              "max_tokens_per_rank": 4}
    layer = MoELayer.from_global(router, weights, K, system_config(system).build(EPGroup(), 0, E))
    return layer, [torch.randn(tokens, 16, generator=g, device="cpu", dtype=torch.float64) for _ in range(2)]


def test_a_fixed_buffers_valid_rows_are_logged_under_strands():
    """Two micro-batches of a static layer co-executed: each fixed-buffer collective keeps its
    valid rows (at most its wire rows; the rest padding), as it does without strands."""
    layer, xs = _static_layer()
    rec = Recorder()
    co_execute([lambda x=x: layer(x, rec) for x in xs], "cpu")
    rec.settle()
    assert len(rec.comm) == 4                       # dispatch and combine of each micro-batch
    for ev in rec.comm:
        assert ev.valid_P is not None, ev
        assert 0 < sum(ev.valid_P) < sum(ev.rows_P), ev     # 3 tokens in buffers of 4: padding travels


def test_a_library_collective_that_cannot_yield_reports_its_whole_time_as_exposed():
    """A collective run inside a library (Tutel's, DeepSpeed's: observed, occult.ep.observe)
    keeps the turn while it runs: under strands its exposed_comm is its whole time, one span
    per collective; outside strands none (a plain run's collectives are all exposed)."""
    import time
    from occult.ep import EPGroup
    from occult.ep.observe import CallTrace

    def library_call(rec):
        def run():
            trace = CallTrace(3, rec, EPGroup(), rows_P=[4], row_bytes=8)
            trace.start("dispatch", "forward")
            time.sleep(0.01)                           # the library's blocking exchange
            trace.stop("dispatch", "forward")
        return run
    rec = Recorder()
    co_execute([library_call(rec), library_call(rec)], "cpu")
    exposed = sorted(s for layer, name, _, s in rec.spans if name == "exposed_comm" and layer == 3)
    assert exposed == sorted(ev.seconds for ev in rec.comm) and len(exposed) == 2 and min(exposed) >= 0.01
    alone = Recorder()
    library_call(alone)()
    assert len(alone.comm) == 1 and not alone.spans
