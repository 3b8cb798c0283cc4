"""Rank functions and deliberately wrong systems for the tests (importable by spawned ranks)."""
import os
import time

import torch
import torch.distributed as dist

from baselines.naive import NaiveDispatcher, NaiveHandle
from occult.ep.capabilities import Capabilities
from occult.ep.payload import PAYLOADS
from occult.ep.replica_rules import REPLICA_POLICIES


class WeightlessDispatcher(NaiveDispatcher):
    """Naive EP that forgets the gate weights: the parity check must catch it."""

    capabilities = Capabilities(
        impl="harness", precision="float64", expert_parallel=True, exact_forward=True, exact_backward=True,
        static_dispatch=True,
        co_execution=True,
        yields=True,
        traffic_plan=True,
        migration=True,
        replica_rules=REPLICA_POLICIES, payloads=PAYLOADS, dropped_pairs=True,
        shortcut_overlap=False)

    def combine(self, y_RD, handle: NaiveHandle):
        ones = torch.ones_like(handle.weight_R)
        return super().combine(y_RD, NaiveHandle(handle.token_R, ones, handle.inv_perm_R, handle.send_P,
                                                 handle.recv_P, handle.num_tokens, handle.layer,
                                                 handle.recorder))


def raise_on_rank(ctx, bad_rank: int):
    """``bad_rank`` raises; the others wait in a collective that can never complete."""
    if ctx.rank == bad_rank:
        raise ValueError(f"deliberate failure on rank {ctx.rank}")
    t = torch.zeros(1)
    dist.all_reduce(t)
    return "unreachable"


def exit_on_rank(ctx, bad_rank: int, peers_wait_in_collective: bool = False):
    """``bad_rank`` dies without a Python traceback; the others sleep, or wait in a
    collective (and fail with a connection error when it dies)."""
    if ctx.rank == bad_rank:
        os._exit(3)
    if peers_wait_in_collective:
        dist.barrier()
    time.sleep(60)


def watching_threads(ctx):
    """The names of this rank's threads that watch its launcher."""
    import threading
    return [t.name for t in threading.enumerate() if t.name == "launcher-watch"]


def watch_then_sleep(ctx, pid: int):
    """Watches process ``pid`` as a rank watches its launcher, then sleeps (a rank at work)."""
    from occult.dist import watch_launcher
    watch_launcher(pid, every_s=0.1)
    time.sleep(30)


def rank_info(ctx):
    return ctx.rank, ctx.world_size, torch.initial_seed(), torch.get_num_threads()


def kill_rank(ctx, bad_rank: int):
    """``bad_rank`` is killed by SIGKILL while its peers wait for it in a collective."""
    import signal
    if ctx.rank == bad_rank:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.zeros(1)
    dist.all_reduce(t)
    return "unreachable"


class HostOnlyDispatcher(NaiveDispatcher):
    """Naive EP that makes one index tensor without the device of its inputs (an
    ``arange`` on torch's default device): the device test must catch it."""

    capabilities = Capabilities(
        impl="harness", precision="float64", expert_parallel=True, exact_forward=True, exact_backward=True,
        static_dispatch=True,
        co_execution=True,
        yields=True,
        traffic_plan=True,
        migration=True,
        replica_rules=REPLICA_POLICIES, payloads=PAYLOADS, dropped_pairs=True,
        shortcut_overlap=False)

    def combine(self, y_RD, handle: NaiveHandle):
        order_R = torch.arange(handle.token_R.numel())          # no device=: the defect
        token_R = handle.token_R[order_R]
        return super().combine(y_RD, NaiveHandle(token_R, handle.weight_R, handle.inv_perm_R, handle.send_P,
                                                 handle.recv_P, handle.num_tokens, handle.layer, handle.recorder))


def run_tasks(ctx, jobs: list) -> dict:
    """Each ``(label, entry, spec)`` of ``jobs``: the task's rank function on this rank;
    returns {label: number of rows}."""
    from occult.ep import import_object
    return {label: len(import_object(entry)(ctx, spec)) for label, entry, spec in jobs}


def backend_calls_at_one_rank(ctx):
    """An all-to-all, an all-gather, a broadcast and a barrier on this (one-rank) world,
    counting the calls that reached torch.distributed; returns (counts, rows back equal)."""
    from occult.ep import Exchange
    from occult.ep.comm import all_gather_rows, all_to_all_rows, broadcast_rows
    from occult.ep.measure import barrier

    calls = {}
    for name in ("all_to_all_single", "all_gather_single", "broadcast", "barrier"):
        real = getattr(dist, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] = calls.get(_name, 0) + 1
            return _real(*a, **kw)
        setattr(dist, name, counted)
    x = torch.arange(12.0, device=ctx.device).view(4, 3)
    same = torch.equal(all_to_all_rows(x, [4], [4], ctx.ep, Exchange(0, "dispatch", None)), x)
    same &= torch.equal(all_gather_rows(x, [4], ctx.ep, Exchange(0, "gather", None)), x)
    same &= torch.equal(broadcast_rows(x, 0, ctx.ep, Exchange(0, "weights", None), requires_grad=False), x)
    barrier(ctx.ep)
    return calls, bool(same)


def task_rows(ctx, jobs: list) -> dict:
    """Each ``(label, entry, spec)`` of ``jobs``: the task's rank function on this rank;
    returns {label: its rows}."""
    from occult.ep import import_object
    return {label: import_object(entry)(ctx, spec) for label, entry, spec in jobs}


def timed_tasks(ctx, jobs: list) -> dict:
    """:func:`run_tasks` with each job's seconds: {label: (rows, seconds)} (for profiling)."""
    from occult.ep import import_object
    out = {}
    for label, entry, spec in jobs:
        t0 = time.perf_counter()
        n = len(import_object(entry)(ctx, spec))
        out[label] = (n, time.perf_counter() - t0)
    return out
