"""Starting expert-parallel ranks: P processes on this machine (gloo on loopback, or NCCL
with one local GPU each), or joining a world a job launcher started (torchrun; Slurm or
local jobs through Hydra's submitit launcher).

    results = launch(fn, world_size=4, args=(cfg,))   # fn(ctx, *args) on every rank

``launch`` returns each rank's return value, in rank order. Every collective
runs under the process group's timeout; if any rank raises, the others are
stopped at once and :class:`RankFailed` carries that rank's error and
traceback, so a run never hangs on a dead peer.

Every rank computes on its device, ``ctx.device``: ``cuda:<local rank>`` under NCCL,
``cpu`` under gloo.

**A launcher's world** (:func:`job_world`): under torchrun (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``) or in a submitit job with several tasks (``hydra/launcher=submitit_slurm``
or ``submitit_local`` with ``tasks_per_node``), this process is one rank of a world
that lives as long as the process. Its default process group is made once
(:func:`join_job_world`); each run (each sweep point) then makes its own process
group from it, on every rank in step, and ends it at the end of the run, so that a
multirun's points follow one another in the same world. Rank 0 decides what the
others do (skip, resume, fail) and hands them the prepared config
(:func:`broadcast_from_rank0`); only rank 0 writes results.
"""
from __future__ import annotations

import atexit
import datetime
import os
import queue
import signal
import socket
import threading
import time
import traceback
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import multiprocessing as mp
import pickle

from .ep.comm import EPGroup
from .ep.measure import use_device


class RankFailed(RuntimeError):
    """A rank raised (or died); the message holds its traceback."""


@dataclass(frozen=True)
class RankContext:
    """What a rank function learns about the world it runs in."""

    rank: int
    world_size: int
    ep: EPGroup
    seed: int

    @property
    def device(self) -> torch.device:
        """Where this rank computes: ``cuda:<local rank>`` under NCCL, ``cpu`` under gloo."""
        return torch.device(self.ep.device)


@dataclass(frozen=True)
class JobWorld:
    """This process's place in a world a job launcher started."""

    kind: str             # "torchrun" or "submitit"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def rank_seed(seed: int, rank: int) -> int:
    """Deterministic per-rank seed derived from the run seed."""
    return seed * 1_000_003 + rank


def default_threads(ranks_on_this_machine: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(ranks_on_this_machine, 1))


def rank_device(backend: str, local_rank: int) -> str:
    """The device a rank computes on: one GPU per rank under NCCL, the CPU under gloo."""
    return f"cuda:{local_rank}" if backend == "nccl" else "cpu"


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or another launcher that sets RANK)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def _submitit_env():
    """submitit's JobEnvironment when this process is a task of a submitit job, else None."""
    if not any(k.startswith(("SUBMITIT_", "SLURM_JOB_ID")) for k in os.environ):
        return None
    try:
        import submitit

        env = submitit.JobEnvironment()
        env.global_rank                       # raises outside a job
        return env
    except Exception:  # noqa: BLE001 - not in a job (or submitit missing)
        return None


# the launcher world this process joined (join_job_world), kept for the process's life
_JOINED: Optional[JobWorld] = None


def job_world() -> Optional[JobWorld]:
    """The launcher's world this process belongs to, or None (``launch`` then spawns ranks)."""
    if _JOINED is not None:
        return _JOINED
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        return JobWorld("torchrun", int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", 0)),
                        int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    env = _submitit_env()
    if env is not None and env.num_tasks > 1:
        per_node = max(env.num_tasks // max(env.num_nodes, 1), 1)
        return JobWorld("submitit", env.global_rank, env.num_tasks, env.local_rank, per_node)
    return None


def _submitit_rendezvous(env) -> None:
    """MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE for ``init_process_group`` from a
    submitit job: the first host of the job, a port derived from the job id."""
    os.environ.setdefault("MASTER_ADDR", env.hostnames[0] if env.hostnames else "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(20000 + zlib.crc32(str(env.job_id).encode()) % 20000))
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(env.global_rank), str(env.num_tasks)
    os.environ["LOCAL_RANK"] = str(env.local_rank)


def join_job_world(backend: str, timeout_s: float) -> JobWorld:
    """This process's launcher world, its default process group made on first use (kept for
    the process's life: a multirun's points reuse it)."""
    global _JOINED
    world = job_world()
    if world is None:
        raise RuntimeError("join_job_world: this process was not started by torchrun or a submitit job")
    _JOINED = world
    if not dist.is_initialized():
        if world.kind == "submitit":
            _submitit_rendezvous(_submitit_env())
        if backend == "nccl":
            torch.cuda.set_device(world.local_rank)
        dist.init_process_group(backend=backend, init_method="env://",
                                timeout=datetime.timedelta(seconds=timeout_s))
        atexit.register(_leave_job_world)
    return world


def _leave_job_world() -> None:
    """At exit: every rank leaves the world together (a rank that left first would pull
    the connections from under one still reporting)."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 - a peer already gone: nothing to wait for
        pass
    dist.destroy_process_group()


def broadcast_from_rank0(obj):
    """``obj`` of rank 0 on every rank of the launcher's world (its default group)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# Environment of spawned CPU ranks that makes freed host memory reusable: glibc keeps large
# freed blocks in its heap (no munmap / trim) and torch allocates large tensors on
# transparent huge pages. Measured here: gathering 16k x 2048 float32 rows into a fresh
# tensor took 87 ms with the defaults (page faults of new memory) and 14-16 ms with these,
# the same as into a reused buffer. A GPU's caching allocator does the same for CUDA ranks.
HOST_MEMORY_CACHE = {"MALLOC_MMAP_THRESHOLD_": str(4 << 30), "MALLOC_TRIM_THRESHOLD_": str(64 << 30),
                     "MALLOC_TOP_PAD_": str(1 << 30), "THP_MEM_ALLOC_ENABLE": "1"}


# How spawned ranks start. A rank process that starts from scratch imports torch and the
# harness (about 2 s of CPU each, 4.5 s for 4 ranks on 2 cores); ranks forked from a
# server process that imported them once start in under 0.1 s (multiprocessing's
# forkserver: the server is a fresh process that only imported modules, never computed or
# touched a GPU, so forking it is safe for CUDA ranks too). The server starts with this
# process's environment and HOST_MEMORY_CACHE (glibc reads its malloc settings when a
# process starts), so runs with host_memory_cache=false spawn their ranks, as does
# OCCULT_RANK_START=spawn. Each rank then takes the launching process's environment of
# the moment (os.environ), its sys.path and working folder, as a spawned rank would.
RANK_START_ENV = "OCCULT_RANK_START"
RANK_PRELOAD = ["torch", "torch.distributed", "occult.dist", "occult.ep", "occult.parity", "occult.tasks.common",
                "occult.models.runtime"]
# and, for a launch of whole-model ranks, transformers' model code (about 3 s of CPU a rank
# otherwise, every rank of every run) and the modules every family's model file imports
# (0.08 s a rank): only the first launch of a process starts the server,
# so a process that launches a layer task first forks its later whole-model ranks without it
WHOLE_MODEL_PRELOAD = ["transformers.modeling_utils", "transformers.generation.utils", "transformers.masking_utils",
                       "transformers.modeling_layers"]


def _rank_processes(host_memory_cache: bool, preload: Sequence[str] = ()):
    """The multiprocessing context that starts this launch's ranks (see RANK_START_ENV);
    ``preload``: modules the fork server imports besides RANK_PRELOAD when it starts."""
    method = os.environ.get(RANK_START_ENV, "forkserver")
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"{RANK_START_ENV}={method!r}: allowed values are ['forkserver', 'spawn']")
    if method == "spawn" or not host_memory_cache:
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([*RANK_PRELOAD, *preload])
    added = {k: v for k, v in HOST_MEMORY_CACHE.items() if k not in os.environ}
    os.environ.update(added)                 # the server reads them when it starts
    try:
        forkserver.ensure_running()
    finally:
        for k in added:
            os.environ.pop(k, None)
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_context(rank: int, world_size: int, group, backend: str, local_rank: int, seed: int,
                  default_device: Optional[str], layout: Optional[dict] = None) -> RankContext:
    """The context of a rank whose process group exists; sets its device and clock, and
    (tests) torch's default device. ``layout``: the EPGroup's options (nodes, single-rank
    collectives)."""
    device = rank_device(backend, local_rank)
    use_device(device)
    if default_device is not None:
        torch.set_default_device(default_device)
    return RankContext(rank, world_size, EPGroup(rank, world_size, group, device, **(layout or {})), seed)


def _init_rank(rank: int, world_size: int, init_method: str, backend: str, timeout_s: float, threads: int,
               seed: int, default_device: Optional[str] = None, layout: Optional[dict] = None) -> RankContext:
    torch.set_num_threads(threads)
    torch.manual_seed(rank_seed(seed, rank))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size, init_method=init_method,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return _rank_context(rank, world_size, dist.group.WORLD, backend, rank, seed, default_device, layout)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, killed and not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:             # no /proc: the signal check is all there is
        return True


def watch_launcher(pid: int, every_s: float = 0.5) -> None:
    """Ends this rank (exit status 1) once the process that launched it is gone: a launcher
    killed before it could stop its ranks (a signal it cannot catch) leaves no rank
    computing on. A daemon thread polls ``pid`` every ``every_s`` seconds."""
    def watch():
        while _alive(pid):
            time.sleep(every_s)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="launcher-watch").start()


def _worker(rank, world_size, port, backend, timeout_s, threads, seed, default_device, layout, fn, args,
            results, errors, env=None, launcher_pid=None):
    if launcher_pid is not None:
        watch_launcher(launcher_pid)
    try:
        if env is not None:          # the launching process's environment (a rank forked from the server)
            os.environ.clear()
            os.environ.update(env)
        ctx = _init_rank(rank, world_size, f"tcp://127.0.0.1:{port}", backend, timeout_s, threads, seed,
                         default_device, layout)
        out = fn(ctx, *args)
        # plain pickle: tensors travel by value (torch's queue reducers would pass shared
        # memory handles that die with this process)
        results.put((rank, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        errors.put((rank, time.time(), traceback.format_exc()))
        raise SystemExit(1)
    finally:
        torch.set_default_device(None)
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn: Callable[..., Any], world_size: int, args: tuple = (), *, seed: int = 0,
           timeout_s: float = 600.0, collective_timeout_s: float = 120.0, threads: int = 0,
           backend: str = "gloo", default_device: Optional[str] = None,
           host_memory_cache: bool = True, devices_per_node: int = 0,
           single_rank_collectives: bool = False, preload: Sequence[str] = ()) -> list:
    """Runs ``fn(ctx, *args)`` on ``world_size`` ranks; returns the results in rank order.

    In a launcher's world (torchrun, a submitit job) the current process is one rank: the
    result list is gathered to rank 0 (other ranks get ``None``). Otherwise
    ``world_size`` processes are spawned on this machine (``backend="nccl"``: rank r
    on GPU r). ``fn`` and ``args`` must be picklable (``fn`` defined at module level).
    ``default_device``: torch's default device inside the ranks (tests set ``"meta"``,
    so that a tensor made without the device of its inputs cannot mix with them).
    ``host_memory_cache``: spawned ranks start with :data:`HOST_MEMORY_CACHE` (variables
    the caller already set are kept); a launcher's world keeps the environment it has.
    ``devices_per_node``: how the ranks are grouped into nodes (``cluster.devices_per_node``;
    0: one node), which ``ctx.ep`` carries for systems that stage their exchange by node.
    ``single_rank_collectives``: a world of one rank runs the backend's collectives
    (:class:`occult.ep.comm.EPGroup`). ``preload``: modules the ranks' fork server imports
    when this launch starts it (e.g. :data:`WHOLE_MODEL_PRELOAD`).
    """
    layout = {"devices_per_node": devices_per_node, "single_rank_collectives": single_rank_collectives}
    world = job_world()
    if world is not None:
        if world.world_size != world_size:
            raise RankFailed(f"launch: the job's world has {world.world_size} ranks, the run asks for {world_size}")
        return _launch_joined(world, fn, args, seed, timeout_s, collective_timeout_s,
                              threads or default_threads(world.local_world_size), backend, default_device,
                              layout)
    threads = threads or default_threads(world_size)
    ctx = _rank_processes(host_memory_cache, preload)
    results, errors = ctx.Queue(), ctx.Queue()
    port = _free_port()
    added = {k: v for k, v in HOST_MEMORY_CACHE.items() if k not in os.environ} if host_memory_cache else {}
    env = {**os.environ, **added} if ctx.get_start_method() == "forkserver" else None
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world_size, port, backend, collective_timeout_s, threads, seed, default_device,
                               layout, fn, args, results, errors, env, os.getpid()))
             for r in range(world_size)]
    os.environ.update(added)                 # spawned children read them when they start
    try:
        for p in procs:
            p.start()
    finally:
        for k in added:
            os.environ.pop(k, None)
    try:
        return _supervise(procs, results, errors, timeout_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)


def _launch_joined(world: JobWorld, fn, args, seed, timeout_s, collective_timeout_s, threads, backend,
                   default_device, layout=None):
    """One run in the launcher's world: a process group of its own, made and ended in step
    on every rank; the results gathered to rank 0."""
    join_job_world(backend, timeout_s)
    torch.set_num_threads(threads)
    torch.manual_seed(rank_seed(seed, world.rank))
    group = dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=collective_timeout_s))
    try:
        ctx = _rank_context(world.rank, world.world_size, group, backend, world.local_rank, seed, default_device,
                            layout)
        value = fn(ctx, *args)
        gathered = [None] * world.world_size if world.rank == 0 else None
        dist.gather_object(value, gathered, dst=0, group=group)
        dist.barrier(group=group)
    finally:
        torch.set_default_device(None)
        dist.destroy_process_group(group)
    return gathered


def _supervise(procs, results, errors, timeout_s) -> list:
    """Collects results; on the first error or a dead rank, fails with that rank's traceback
    (a rank that died without a traceback, killed by a signal or exiting on its own, is
    named as the cause of its peers' errors)."""
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
            rank, tb, reporters = failure
            raise RankFailed(_silent_deaths(procs, out, reporters, errors)
                             or f"rank {rank} of {len(procs)} failed:\n{tb}")
        for r, p in enumerate(procs):
            if r not in out and not p.is_alive() and p.exitcode not in (0, None):
                failure = _first_error(errors, wait=1.0)
                reporters = failure[2] if failure is not None else set()
                silent = _silent_deaths(procs, out, reporters, errors)
                if silent:
                    raise RankFailed(silent)
                raise RankFailed(f"rank {failure[0]} of {len(procs)} failed:\n{failure[1]}")
        if time.monotonic() > deadline:
            missing = sorted(set(range(len(procs))) - set(out))
            raise RankFailed(f"run timed out after {timeout_s:.0f} s waiting for ranks {missing}")
    return [out[r] for r in range(len(procs))]


def _silent_deaths(procs, out: dict, reporters: set, errors) -> str:
    """'rank r of P was killed by SIGKILL ...' / 'rank r of P died with exit code c ...' for
    the ranks without a result that died without reporting a Python error (their peers
    then fail with connection errors that are not the cause), else ''."""
    for p in procs:
        p.join(timeout=0.2 if p.is_alive() else 0)
    reporters = set(reporters)
    while True:  # a rank that exited has flushed its error: late ones are in the queue
        try:
            reporters.add(errors.get(timeout=0.05)[0])
        except queue.Empty:
            break
    dead = [(r, p.exitcode) for r, p in enumerate(procs)
            if r not in out and r not in reporters and p.exitcode not in (0, None)]
    if not dead:
        return ""
    names = ", ".join(_death(r, len(procs), code) for r, code in dead)
    causes = ("the out-of-memory killer, a timeout, a user" if any(code < 0 for _, code in dead)
              else "a crash in C, os._exit, a library calling exit")
    return (f"{names}; the other ranks' errors (e.g. 'Connection reset by peer') follow from it. "
            f"Look for what ended it ({causes}).")


def _death(rank: int, world_size: int, code: int) -> str:
    """One rank's silent end, in words."""
    if code < 0:
        return f"rank {rank} of {world_size} was killed by {_signal_name(-code)} (exit code {code})"
    return f"rank {rank} of {world_size} died with exit code {code} and no Python traceback"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _first_error(errors, wait: float = 0.0):
    """The earliest error reported (peers of a dead rank fail after it, with
    'connection closed' errors): once one error is seen, collect for a moment
    more and return the one with the earliest time stamp, with every rank that reported."""
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
    return rank, tb, {f[0] for f in found}
