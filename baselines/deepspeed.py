"""system=deepspeed: DeepSpeed-MoE's expert parallelism, run by the deepspeed library itself.

DeepSpeed's ``deepspeed.moe.sharded_moe.MOELayer`` (GShard's algorithm) runs
one module per layer:

  gate      per (token, k) route: expert index (-1 = dropped), queue position,
            gate weight; and the capacity C (rows per expert and sending rank)
  encode    every kept route's token into its slot of a dense, zero-padded
            buffer [E, C, D] (``_sparse_encode``)
  exchange  equal-split all-to-all (``_AllToAll``, through ``deepspeed.comm``):
            rank p receives the [e, C, D] blocks of its experts from every rank,
            e*C rows per peer whatever the load
  experts   on [P, e, C, D], padding rows included
  exchange  equal-split all-to-all back
  decode    each token gathers its routes' rows and sums them weighted by the
            gate (``_sparse_decode``)

What the harness drives, and how (deepspeed 0.19.x, pinned to 0.19.8):

* **gate**: DeepSpeed's public ``deepspeed.moe.layer.MoE`` builds its own
  ``TopKGate`` (a linear router, its own softmax and top-k); the harness's
  routing is the system-independent part of the comparison, so
  :class:`_RoutingGate` hands the harness's top-k ids and gate weights to
  ``MOELayer`` in the format its gate returns. That is an *internal contract*
  of ``MOELayer.forward``: ``gate(x, used_token, True, use_tutel)`` returns
  ``(l_aux, capacity, num_experts, indices_KT, locations_KT, gates_KT,
  exp_counts_E)`` (the ``sparse_routes`` form of ``topkgating``), checked
  against the installed version by :func:`load_deepspeed`.
* **experts**: :class:`_ExpertsAdapter` runs the harness's ``GroupedExperts``
  (this rank's e experts) on DeepSpeed's received layout [P, e, C, D].
* **group**: ``MOELayer`` gets the harness's process group (``ctx.ep.group``)
  through its ``_set_ep_group``; DeepSpeed's own group registry
  (``deepspeed.utils.groups``) is not needed, because no tensor parallelism is
  configured. ``deepspeed.init_distributed`` wraps the already initialised
  ``torch.distributed`` world (DeepSpeed's ``TorchBackend``) and loads DeepSpeed's
  small shared-memory C++ op, built with the system compiler once per machine at
  install time (``make venv`` runs ``python -m baselines.deepspeed``, about 2.5 min) in
  ``~/.cache/occult-bench/torch_extensions`` (``TORCH_EXTENSIONS_DIR``;
  ``$XDG_CACHE_HOME`` is honoured), shared by every checkout on the machine. Loading
  takes the op's lock file; a lock left by an interrupted build is reported after
  :data:`LOCK_WAIT_S` seconds with the file's path (torch itself would wait forever).
* **order**: DeepSpeed assumes the contiguous placement (global expert i on
  rank i // e, slot i % e); any other placement is refused.

Capacity C, as DeepSpeed's gating computes it:

* ``capacity_factor`` = 0 (default): ``drop_tokens=False``; C is the largest
  number of routes any expert gets on any rank (DeepSpeed all-reduces the max),
  so every expert is padded to the group's largest load. Exact top-k MoE.
* ``capacity_factor`` cf > 0: ``drop_tokens=True``, C = ``max(ceil(T / E * cf
  * K), min_capacity)`` (DeepSpeed's ``_capacity``, called here). Routes whose
  position in their expert's queue is >= C are dropped, the queue taken in
  DeepSpeed's top-2 / ``drop_policy="position"`` order: every first choice in
  token order, then every second choice, and so on.

Deviations from DeepSpeed's own gate, all in the routing that the harness
owns: DeepSpeed computes C from the local T and assumes every rank has the
same T; here T is the largest token count of any rank, so that the
equal-split exchange is well formed when ranks differ (the same C when they do
not). The max-load and T exchange is the harness's accounted ``counts``
exchange (phase ``counts``), where DeepSpeed's gate all-reduces one integer.
DeepSpeed's default drop order for k = 1 (random token selection) and k > 2
(highest gate weight first) is not used; position order is deterministic.
Dropless C is at least 1 (DeepSpeed's reshape of an empty buffer fails).

Accounting: the all-to-alls run inside DeepSpeed, so they are observed, not
called: the rows per peer are those of the real received buffer (e*C rows of
D values, the equal split), logged with ``log_collective`` for phase
``dispatch`` and ``combine``, forward and backward (backward through identity
autograd probes placed around DeepSpeed's exchanges). A logged time spans the
exchange *and* DeepSpeed's encode (dispatch) or decode (combine) beside it,
which cannot be separated from outside. Counters per call:
``dropped_pairs`` (routes beyond capacity on this rank) and ``padding_rows``
(zero rows this rank sends: E*C - kept routes).

Shapes: T tokens, K top-k, D hidden, E experts, P ranks, e local experts,
C capacity.
"""
from __future__ import annotations

import hashlib
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from baselines.tutel_harness import queue_positions
from occult.ep import Dispatcher, Exchange, Recorder, SystemConfig, exchange_counts
from occult.ep.accounting import span
from occult.ep.observe import CallTrace, probe
from occult.ep.plan import metadata_sends, returned, sends
from occult.ep.capabilities import Capabilities

DEEPSPEED_PIN = "0.19.8"
# DeepSpeed builds a small C++ op on first use; the project keeps it, once per machine and
# Python environment (the build names the environment's paths: two virtual environments
# sharing one folder would rebuild it in turn, each waiting on the other's lock)
EXTENSIONS_DIR = (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "occult-bench" / "torch_extensions"
                  / hashlib.sha256(sys.prefix.encode()).hexdigest()[:12])
SHM_BUILDER = "ShareMemCommBuilder"     # the op deepspeed.init_distributed loads on a CPU
# torch's extension loader waits on <build folder>/lock without a time limit, even when the
# op is built (it takes the lock to load it too); a load holds it for well under a second,
# so a lock still there after this long is an interrupted build's (or another process's)
LOCK_WAIT_S = 30.0


def load_deepspeed():
    """Imports deepspeed (its C++ op cache pointed at the project's) and checks the
    ``MOELayer`` gate contract this adapter relies on; returns ``deepspeed.moe.sharded_moe``."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS_DIR))
    try:
        import deepspeed
        from deepspeed.moe import sharded_moe
    except ImportError as exc:
        raise ImportError(f"system=deepspeed: deepspeed is not installed "
                          f"(pip install deepspeed=={DEEPSPEED_PIN}): {exc}") from exc
    version = getattr(deepspeed, "__version__", "unknown")
    needed = ("MOELayer", "_route_slots", "_sparse_encode", "_sparse_decode", "_capacity")
    missing = [n for n in needed if not hasattr(sharded_moe, n)]
    if not version.startswith("0.19.") or missing:
        raise ImportError(f"system=deepspeed drives deepspeed.moe.sharded_moe.MOELayer through its "
                          f"internal gate contract of deepspeed 0.19.x (tested: {DEEPSPEED_PIN}); found "
                          f"deepspeed {version}" + (f" without {missing}" if missing else "")
                          + f". Install deepspeed=={DEEPSPEED_PIN}.")
    return sharded_moe


def op_lock_file() -> Path:
    """The lock file torch's extension loader takes while it builds or loads DeepSpeed's op."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(SHM_BUILDER)
    name = getattr(builder, "NAME", "deepspeed_shm_comm")
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR", str(EXTENSIONS_DIR))) / name / "lock"


def wait_for_op_lock(lock: Path, timeout_s: float = LOCK_WAIT_S, poll_s: float = 0.1) -> None:
    """Returns once ``lock`` is gone; raises after ``timeout_s`` with what to do."""
    t0 = time.monotonic()
    while lock.exists():
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(
                f"system=deepspeed: {lock} has been held for over {timeout_s:.0f} s: an interrupted build of "
                f"DeepSpeed's C++ op left it, or another process is building the op. If no other run or "
                f"`make venv` is building it, delete the lock (rm {lock}) and rerun; the op is built once per "
                f"machine by `make venv` (python -m baselines.deepspeed)")
        time.sleep(poll_s)


def build_op() -> Path:
    """Builds (or finds) DeepSpeed's shared-memory C++ op in :data:`EXTENSIONS_DIR` (the venv
    step), so that runs only load it; returns the build folder."""
    load_deepspeed()
    from deepspeed.accelerator import get_accelerator

    lock = op_lock_file()
    wait_for_op_lock(lock)
    get_accelerator().create_op_builder(SHM_BUILDER).load()
    return lock.parent


def init_deepspeed_comm(group) -> None:
    """Makes ``deepspeed.comm`` use the already initialised ``torch.distributed`` world
    (idempotent; a no-op when it already does). Its C++ op is loaded on the way, after a
    bounded wait for the op's lock (:func:`wait_for_op_lock`)."""
    import deepspeed
    import deepspeed.comm as ds_comm

    if not dist.is_initialized():
        raise RuntimeError("system=deepspeed: torch.distributed must be initialised (the harness's "
                           "launcher does it) before DeepSpeed's communication layer")
    if not ds_comm.is_initialized():
        wait_for_op_lock(op_lock_file())
        deepspeed.init_distributed(dist_backend=dist.get_backend(group), verbose=False)


def check_contiguous(placement) -> None:
    """DeepSpeed's buffer puts global expert i in block i, sent to rank i // e: refuse others."""
    if not placement.is_contiguous():
        raise ValueError("system=deepspeed: DeepSpeed's MOELayer assumes the contiguous placement "
                         "(expert i on device i // e, slot i % e); this layer's placement is "
                         f"{placement.groups()}. Use the default placement with system=deepspeed.")


@dataclass(frozen=True)
class Routes:
    """One call's routing in DeepSpeed's gate format, and its load figures."""

    capacity: int               # C
    indices_KT: torch.Tensor    # int32 expert of each route, -1 when dropped
    locations_KT: torch.Tensor  # int32 queue position of each route (0 when dropped)
    gates_KT: torch.Tensor      # gate weight of each route (differentiable)
    exp_counts_E: torch.Tensor  # routes per expert before dropping
    kept: int                   # routes within capacity


def deepspeed_capacity(sharded_moe, capacity_factor: float, min_capacity: int, top_k: int,
                       max_tokens: int, num_experts: int, max_need: int) -> int:
    """C: dropless (cf = 0) the largest expert load in the group (at least 1); else
    DeepSpeed's ``_capacity`` for ``max_tokens`` tokens, factor cf * K and ``min_capacity``."""
    if capacity_factor == 0:
        return max(max_need, 1)
    shape_TE = torch.empty((max_tokens, num_experts), device="meta")    # _capacity reads the shape only
    return int(sharded_moe._capacity(shape_TE, torch.tensor(capacity_factor * top_k, device="cpu"),
                                     torch.tensor(min_capacity, device="cpu")))


class _KMajor(torch.autograd.Function):
    """[T, K] -> [K, T] (contiguous); backward hands the gradient back contiguous in [T, K],
    the layout the reference's gradient has, so that the float32 router rounds alike."""

    @staticmethod
    def forward(ctx, x_TK):
        return x_TK.t().contiguous()

    @staticmethod
    def backward(ctx, grad_KT):
        return grad_KT.t().contiguous()


def build_routes(topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, num_experts: int,
                 capacity: int) -> Routes:
    """The [K, T] routes of DeepSpeed's gate: queue positions in k-major order (first
    choices first, tokens in order), routes at position >= ``capacity`` marked -1."""
    T, K = topk_ids_TK.shape
    pos_KT, need_E = queue_positions(topk_ids_TK, num_experts)
    pos_KT = pos_KT.view(K, T)
    keep_KT = pos_KT < capacity
    ids_KT = topk_ids_TK.t()
    indices_KT = torch.where(keep_KT, ids_KT, torch.full_like(ids_KT, -1)).to(torch.int32)
    locations_KT = torch.where(keep_KT, pos_KT, torch.zeros_like(pos_KT)).to(torch.int32)
    return Routes(capacity, indices_KT, locations_KT, _KMajor.apply(topk_weights_TK), need_E, int(keep_KT.sum()))


class _RoutingGate(nn.Module):
    """Stands in for DeepSpeed's ``TopKGate``: returns one call's precomputed routes."""

    def __init__(self, routes: Routes, num_experts: int, trace: CallTrace):
        super().__init__()
        self.routes, self.num_experts, self.trace = routes, num_experts, trace
        self.ep_group = None

    def _set_ep_group(self, ep_group) -> None:
        """Called by ``MOELayer._set_ep_group`` (the routes are already global)."""
        self.ep_group = ep_group

    def forward(self, x_TD, used_token=None, sparse_routes=False, use_tutel=False):
        if used_token is not None or not sparse_routes or use_tutel:
            raise TypeError("system=deepspeed: MOELayer called its gate outside the contract this "
                            f"adapter implements (used_token=None, sparse_routes=True, use_tutel=False; "
                            f"got {used_token is not None}, {sparse_routes}, {use_tutel}); "
                            f"install deepspeed=={DEEPSPEED_PIN}")
        r = self.routes
        self.trace.start("dispatch", "forward")
        l_aux = x_TD.new_zeros(())        # no load-balancing loss: the harness's router owns routing
        return l_aux, r.capacity, self.num_experts, r.indices_KT, r.locations_KT, r.gates_KT, r.exp_counts_E


class _ExpertsAdapter(nn.Module):
    """The harness's experts on DeepSpeed's received layout: [P, e, C, D] -> [P, e, C, D]."""

    def __init__(self, experts: nn.Module, trace: CallTrace):
        super().__init__()
        self.experts, self.trace = experts, trace

    def forward(self, recv_PeCD: torch.Tensor) -> torch.Tensor:
        tr = self.trace
        P, e, C, D = recv_PeCD.shape
        # the exchange is equal-split: e*C rows of D values from (and to) every peer
        tr.rows_P, tr.row_bytes = [e * C] * P, D * recv_PeCD.element_size()
        tr.stop("dispatch", "forward")
        recv_PeCD = probe(recv_PeCD, lambda: tr.start("dispatch", "backward"))
        with span(tr.recorder, tr.layer, "experts"):
            rows_RD = recv_PeCD.transpose(0, 1).reshape(e * P * C, D)      # grouped by local expert
            y_RD = self.experts(rows_RD, torch.full((e,), P * C, dtype=torch.long, device=rows_RD.device))
            y_PeCD = y_RD.view(e, P, C, D).transpose(0, 1)
        y_PeCD = probe(y_PeCD, lambda: tr.stop("combine", "backward"))
        tr.start("combine", "forward")
        return y_PeCD


class DeepSpeedDispatcher(Dispatcher):
    """DeepSpeed-MoE's ``MOELayer`` on the harness's routing and experts.

    ``capacity_factor``: 0 dropless (default, exact, every expert padded to the
    group's largest load); > 0 GShard capacity ``max(ceil(T/E * cf * K),
    min_capacity)`` with overflow routes dropped. ``min_capacity``: DeepSpeed's
    lower bound on C for cf > 0 (4, as in ``deepspeed.moe.layer.MoE``).
    """

    capabilities = Capabilities(
        impl="library", precision="float64", expert_parallel=True, exact_forward=True, exact_backward=True,
        static_dispatch="it has no fixed-buffer dispatch (only naive EP's and Occult's exchanges have one)",
        co_execution=True,
        yields=("its collectives run inside the library, which does not hand them to another strand "
                "(exposed_comm = their whole time)"),
        traffic_plan=True,
        migration=True,
        replica_rules=(), payloads=("fp32",), dropped_pairs=False,
        shortcut_overlap=False)

    @dataclass
    class Config(SystemConfig):
        # 0: drop_tokens=False, C = the largest expert load in the group (exact).
        # > 0: C = max(ceil(T / E * cf * K), min_capacity) per (rank, expert); overflow
        # routes dropped (first choices first, tokens in order).
        capacity_factor: float = 0.0
        min_capacity: int = 4

        def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
            super().check(num_experts=num_experts, top_k=top_k, world_size=world_size)
            if not math.isfinite(self.capacity_factor) or self.capacity_factor < 0:
                raise ValueError(f"system.capacity_factor={self.capacity_factor!r}: must be a number >= 0 "
                                 "(0 dropless, > 0 capacity with dropping)")
            if self.min_capacity < 1:
                raise ValueError(f"system.min_capacity={self.min_capacity!r}: must be an integer >= 1")

        def is_exact(self) -> bool:
            return self.capacity_factor == 0

        def lossless_options(self) -> dict:
            """Dropless (capacity_factor 0): the capacity scheme without its drops, what the
            run's parity gate checks a dropping config with."""
            return {} if self.is_exact() else {"capacity_factor": 0.0}

    def __init__(self, ep, placement, config):
        super().__init__(ep, placement, config)
        check_contiguous(placement)
        self._sharded_moe = load_deepspeed()

    def plan_facts(self, topk_ids_TK, topk_weights_TK):
        """(T, largest expert load) of this rank: what C is the maximum of."""
        need_E = torch.bincount(topk_ids_TK.reshape(-1), minlength=self.placement.num_experts)
        return torch.stack([torch.tensor(topk_ids_TK.shape[0], device=need_E.device), need_E.max()])

    def _capacity_of(self, every_PX: torch.Tensor, top_k: int) -> int:
        """C from every rank's :meth:`plan_facts` [P, 2] (the same on every rank)."""
        max_tokens, max_need = every_PX.max(0).values.tolist()
        return deepspeed_capacity(self._sharded_moe, self.config.capacity_factor, self.config.min_capacity, top_k,
                                  max_tokens, self.placement.num_experts, max_need)

    def capacity(self, topk_ids_TK: torch.Tensor, layer: int, recorder: Optional[Recorder]) -> int:
        """C, the same on every rank: exchanges (T, largest expert load) with every rank."""
        mine_X = self.plan_facts(topk_ids_TK, None)
        every_PX = exchange_counts(mine_X.expand(self.ep.world_size, 2).contiguous(), self.ep,
                                   Exchange(layer, "counts", recorder))
        return self._capacity_of(every_PX, topk_ids_TK.shape[1])

    def plan(self, topk_ids_TK, topk_weights_TK, *, rank, shape, facts_PX=None, training=True):
        """A second statement of what the library sends (its all-to-alls run inside its
        ``MOELayer``; the parity worlds check this against the rows observed from its
        buffers): ``counts`` ((T, largest load) to every rank), then ``dispatch`` and
        ``combine``, e C rows to every rank with DeepSpeed's capacity C."""
        P, e = self.ep.world_size, self.placement.num_local
        C = self._capacity_of(facts_PX, topk_ids_TK.shape[1])
        x_bytes = shape.bytes_of(shape.hidden)
        return [metadata_sends("counts", rank, [1] * P, 2 * facts_PX.element_size()),
                sends("dispatch", rank, [e * C] * P, x_bytes), returned("combine", 1, x_bytes)]

    def build_moe_layer(self, routes: Routes, experts: nn.Module, trace: CallTrace) -> nn.Module:
        """DeepSpeed's ``MOELayer`` for one call: the call's routes as its gate, the
        harness's experts, the harness's group. Built per call (thin wrappers, no
        weights of its own) so that the routes and the trace stay call-scoped."""
        moe = self._sharded_moe.MOELayer(_RoutingGate(routes, self.placement.num_experts, trace),
                                         _ExpertsAdapter(experts, trace), ep_group_name=f"ep_size_{self.ep.world_size}",
                                         ep_size=self.ep.world_size, num_local_experts=self.placement.num_local,
                                         use_tutel=False)
        moe._set_ep_group(self.ep.group)
        return moe

    def forward_moe(self, x_TD, topk_ids_TK, topk_weights_TK, experts, *, layer=0, recorder=None):
        with span(recorder, layer, "moe"):
            return self._forward_moe(x_TD, topk_ids_TK, topk_weights_TK, experts, layer, recorder)

    def _forward_moe(self, x_TD, topk_ids_TK, topk_weights_TK, experts, layer, recorder):
        """DeepSpeed's MOELayer for this call, its exchanges observed and its counters logged."""
        P, e = self.ep.world_size, self.placement.num_local
        if P > 1:       # DeepSpeed's communication layer on this rank's world (idempotent)
            init_deepspeed_comm(self.ep.group)
        C = self.capacity(topk_ids_TK, layer, recorder)
        routes = build_routes(topk_ids_TK, topk_weights_TK.to(x_TD.dtype), self.placement.num_experts, C)
        trace = CallTrace(layer, recorder, self.ep)
        moe = self.build_moe_layer(routes, experts, trace)
        x_in_TD = probe(x_TD, lambda: trace.stop("dispatch", "backward"))
        out_TD = moe(x_in_TD, None)
        trace.stop("combine", "forward")
        out_TD = probe(out_TD, lambda: trace.start("combine", "backward"))
        if recorder is not None:
            T, K = topk_ids_TK.shape
            recorder.log_counter(layer, "dropped_pairs", T * K - routes.kept)
            recorder.log_counter(layer, "padding_rows", P * e * C - routes.kept)
        return out_TD


if __name__ == "__main__":
    print(f"DeepSpeed's C++ op: {build_op()}")
