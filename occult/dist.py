"""Starting expert-parallel ranks: P processes on this machine (gloo on loopback),
or joining a torchrun world (NCCL on GPUs).

    results = launch(fn, world_size=4, args=(cfg,))   # fn(ctx, *args) on every rank

``launch`` returns each rank's return value, in rank order. Every collective
runs under the process group's timeout; if any rank raises, the others are
stopped at once and :class:`RankFailed` carries that rank's error and
traceback, so a run never hangs on a dead peer.
"""
from __future__ import annotations

import datetime
import os
import queue
import signal
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import multiprocessing as mp
import pickle

from .ep.comm import EPGroup


class RankFailed(RuntimeError):
    """A rank raised (or died); the message holds its traceback."""


@dataclass(frozen=True)
class RankContext:
    """What a rank function learns about the world it runs in."""

    rank: int
    world_size: int
    ep: EPGroup
    seed: int


def rank_seed(seed: int, rank: int) -> int:
    """Deterministic per-rank seed derived from the run seed."""
    return seed * 1_000_003 + rank


def default_threads(world_size: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(world_size, 1))


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or another launcher that sets RANK)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_rank(rank: int, world_size: int, init_method: Optional[str], backend: str,
               timeout_s: float, threads: int, seed: int) -> RankContext:
    torch.set_num_threads(threads)
    torch.manual_seed(rank_seed(seed, rank))
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    kwargs = dict(backend=backend, rank=rank, world_size=world_size,
                  timeout=datetime.timedelta(seconds=timeout_s))
    if init_method is not None:
        kwargs["init_method"] = init_method
    dist.init_process_group(**kwargs)
    return RankContext(rank, world_size, EPGroup(rank, world_size, dist.group.WORLD), seed)


def _worker(rank, world_size, port, backend, timeout_s, threads, seed, fn, args, results, errors):
    try:
        ctx = _init_rank(rank, world_size, f"tcp://127.0.0.1:{port}", backend, timeout_s, threads, seed)
        out = fn(ctx, *args)
        # plain pickle: tensors travel by value (torch's queue reducers would pass shared
        # memory handles that die with this process)
        results.put((rank, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        errors.put((rank, time.time(), traceback.format_exc()))
        raise SystemExit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable[..., Any], world_size: int, args: tuple = (), *, seed: int = 0,
           timeout_s: float = 600.0, collective_timeout_s: float = 120.0, threads: int = 0,
           backend: str = "gloo") -> list:
    """Runs ``fn(ctx, *args)`` on ``world_size`` ranks; returns the results in rank order.

    Under torchrun the current process is one rank: the result list is
    gathered to rank 0 (other ranks get ``None``). Otherwise ``world_size``
    processes are spawned on this machine. ``fn`` and ``args`` must be
    picklable (``fn`` defined at module level).
    """
    threads = threads or default_threads(world_size)
    if under_torchrun():
        return _launch_torchrun(fn, args, seed, collective_timeout_s, threads)
    ctx = mp.get_context("spawn")
    results, errors = ctx.Queue(), ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, port, backend, collective_timeout_s, threads, seed,
                               fn, args, results, errors))
             for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        return _supervise(procs, results, errors, timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)


def _supervise(procs, results, errors, timeout_s) -> list:
    """Collects results; on the first error or a dead rank, fails with that rank's traceback
    (a rank killed by a signal is named as the cause of its peers' errors)."""
    deadline = time.monotonic() + timeout_s
    out: dict = {}
    while len(out) < len(procs):
        try:
            rank, value = results.get(timeout=0.05)
            out[rank] = pickle.loads(value)
            continue
        except queue.Empty:
            pass
        failure = _first_error(errors)
        if failure is not None:
            rank, tb = failure
            raise RankFailed(_killed(procs, out) or f"rank {rank} of {len(procs)} failed:\n{tb}")
        for r, p in enumerate(procs):
            if r not in out and not p.is_alive() and p.exitcode not in (0, None):
                failure = _first_error(errors, wait=1.0)
                killed = _killed(procs, out)
                if killed:
                    raise RankFailed(killed)
                if failure is not None:
                    raise RankFailed(f"rank {failure[0]} of {len(procs)} failed:\n{failure[1]}")
                raise RankFailed(f"rank {r} of {len(procs)} died with exit code {p.exitcode} "
                                 "and no Python traceback (killed, out of memory, or a crash in C)")
        if time.monotonic() > deadline:
            missing = sorted(set(range(len(procs))) - set(out))
            raise RankFailed(f"run timed out after {timeout_s:.0f} s waiting for ranks {missing}")
    return [out[r] for r in range(len(procs))]


def _killed(procs, out: dict) -> str:
    """'rank r of P was killed by SIGKILL ...' when a rank without a result died from a
    signal (its peers then fail with connection errors that are not the cause), else ''."""
    for p in procs:
        p.join(timeout=0.2 if p.is_alive() else 0)
    dead = [(r, p.exitcode) for r, p in enumerate(procs)
            if r not in out and p.exitcode is not None and p.exitcode < 0]
    if not dead:
        return ""
    names = ", ".join(f"rank {r} of {len(procs)} was killed by {_signal_name(-code)} (exit code {code})"
                      for r, code in dead)
    return (f"{names}; the other ranks' errors (e.g. 'Connection reset by peer') follow from it. "
            "Look for what sent the signal (the out-of-memory killer, a timeout, a user).")


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _first_error(errors, wait: float = 0.0):
    """The earliest error reported (peers of a dead rank fail after it, with
    'connection closed' errors): once one error is seen, collect for a moment
    more and return the one with the earliest time stamp."""
    found = []
    try:
        found.append(errors.get(timeout=max(wait, 0.01)))
    except queue.Empty:
        return None
    end = time.monotonic() + 0.5
    while time.monotonic() < end:
        try:
            found.append(errors.get(timeout=0.05))
        except queue.Empty:
            pass
    rank, _, tb = min(found, key=lambda f: f[1])
    return rank, tb


def _launch_torchrun(fn, args, seed, collective_timeout_s, threads):
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    ctx = _init_rank(rank, world_size, None, backend, collective_timeout_s, threads, seed)
    value = fn(ctx, *args)
    gathered = [None] * world_size if rank == 0 else None
    dist.gather_object(value, gathered, dst=0)
    dist.destroy_process_group()
    return gathered
