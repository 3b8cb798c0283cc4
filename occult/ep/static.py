"""Static-shape dispatch: fixed buffers, valid rows marked in the buffer, no host read.

How production decode moves tokens (the low-latency kernels of DeepEP, pplx-kernels, NCCL
EP): every rank sends every peer a buffer of a fixed number of slots, sized by
``max_tokens_per_rank``, with the valid rows marked in the buffer itself; so there is no
counts collective before the exchange, no split size read on the host, every shape of the
step is known before it runs, and the step can be captured in a CUDA graph
(:mod:`occult.ep.graphs`).

A system takes it with two pieces:

* its typed config subclasses :class:`StaticConfig` (options ``dispatch_mode``: ``dynamic``
  | ``static``, and ``max_tokens_per_rank``: the tokens per rank a call may hold, 0 for the
  task's tokens per rank, filled in by :meth:`StaticConfig.sized` where the task builds the
  system);
* its dispatcher subclasses :class:`StaticDispatch` (before :class:`SplitDispatcher`) and
  implements ``static_dispatch``, ``static_experts``, ``static_combine`` and
  ``static_plan``; its ``forward_moe`` runs them when the mode is static (and the call is
  not inside :func:`dynamic_calls`, e.g. a decode task's prompt), else the dynamic path.

:class:`StaticPairs` is the static path of a row per (token, expert) pair (naive EP):
``min(K, e) * M`` slots per destination (a token has at most that many pairs on one
device), each row its D values and its local expert (-1: padding); the receiver lays the
valid rows out as ``[e, P * M]`` per-expert slots (a token of a source rank has one slot
per local expert) and the experts run on every slot (:func:`slot_swiglu`: a masked grouped
GEMM on a GPU skips the empty ones; on a CPU padding is computed too, for every static
system alike).

On gloo the fixed buffer is sent whole, padding included: the collectives log the wire
rows and, beside them, the valid rows (:func:`occult.ep.comm.all_to_all_fixed`), read to
the host after the step (:meth:`occult.ep.accounting.Recorder.settle`).

Shapes: T tokens on this rank (at most M = ``max_tokens_per_rank``), K top-k, D hidden, F
expert FFN, P ranks, e local experts (slots per device), S slots per destination, N = P M.
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as nnf

from ..columns import column
from .accounting import Recorder, backward_span, span
from .capabilities import refusal
from .context import current, entered
from .comm import Exchange, all_to_all_fixed
from .payload import wire_row_bytes
from .permute import home_of
from .plan import returned, sends
from .replica_rules import DEVICE_POLICIES
from .system import SystemConfig

DISPATCH_MODES = ("dynamic", "static")


@dataclass
class StaticConfig(SystemConfig):
    """Options mixin of a system with a static-shape dispatch (see the module docstring)."""

    dispatch_mode: str = column("dynamic")     # dynamic (split sizes exchanged) | static (fixed buffers)
    max_tokens_per_rank: int = 0        # static: tokens per rank a call may hold (0: the task's tokens per rank)

    def check(self, *, num_experts: int, top_k: int, world_size: int) -> None:
        super().check(num_experts=num_experts, top_k=top_k, world_size=world_size)
        if self.dispatch_mode not in DISPATCH_MODES:
            raise ValueError(f"system.dispatch_mode={self.dispatch_mode!r}: allowed values are {list(DISPATCH_MODES)}")
        if self.is_static() and not self.capabilities().has("static_dispatch"):
            why = refusal(self.name, self.capabilities(), "static_dispatch")
            raise ValueError(f"system.dispatch_mode=static: {why}; allowed value: dynamic")
        if self.max_tokens_per_rank < 0:
            raise ValueError(f"system.max_tokens_per_rank={self.max_tokens_per_rank}: must be >= 0 "
                             "(0: the task's tokens per rank)")
        rule = self.replica_rule()
        if self.is_static() and rule not in DEVICE_POLICIES:
            raise ValueError(f"system.replica_policy={rule!r}: its choice is made on the host, which "
                             f"dispatch_mode=static may not read; allowed values with it: {list(DEVICE_POLICIES)}")
        if self.is_static() and self.compressed():
            raise ValueError("system.dispatch_mode=static sends rows as they are: allowed payloads with it are "
                             "payload=fp32, combine_payload=null")

    def is_static(self) -> bool:
        return self.dispatch_mode == "static"

    def sized(self, tokens_per_rank: int, force: bool = False) -> "StaticConfig":
        """This config with its buffers sized for ``tokens_per_rank`` tokens per rank when
        ``max_tokens_per_rank`` is unset (0), or always with ``force`` (the parity check's
        own problem)."""
        if not self.is_static() or (self.max_tokens_per_rank and not force):
            return self
        return dataclasses.replace(self, max_tokens_per_rank=max(1, int(tokens_per_rank)))

    def other_exact_paths(self) -> list:
        can = self.capabilities().has("static_dispatch")
        static = [] if self.is_static() or not can else [{"dispatch_mode": "static"}]
        return super().other_exact_paths() + static


@contextmanager
def dynamic_calls():
    """Layer calls inside run the dynamic dispatch even on a static system: a decode task's
    prompt (production runs prefill with its normal-mode kernels, decode steps with the
    low-latency ones). The run context's ``dynamic`` (:func:`occult.ep.context.entered`)."""
    with entered(dynamic=True):
        yield


def runs_static(config) -> bool:
    """Whether a call of a system with ``config`` takes its static path now."""
    return config.is_static() and not current().dynamic


def times_by_marks(config) -> bool:
    """Whether a run of a system with ``config`` times its steps by marks
    (``Recorder(marks=True)``: no span or collective waits for the device, the times read
    after the step): a static dispatch's, whose steps may not synchronise."""
    return config.is_static()


def capacity(config, num_tokens: int, layer: int, rank: int) -> int:
    """M, the tokens per rank the buffers hold; refuses a call with more tokens than that
    (never drops a token), naming the largest count seen (this call's)."""
    M = config.max_tokens_per_rank
    if M < 1:
        raise ValueError(f"system.dispatch_mode=static: system.max_tokens_per_rank is unset (0) and the task did not "
                         f"size it (StaticConfig.sized); set it to the largest tokens per rank of a call")
    if num_tokens > M:
        raise ValueError(f"system.max_tokens_per_rank={M} is below the tokens a rank has: rank {rank} has "
                         f"{num_tokens} tokens in one call of layer {layer} (the largest seen); set "
                         f"system.max_tokens_per_rank to at least {num_tokens}")
    return M


def slot_swiglu(x, w_gate_eDF: torch.Tensor, w_up_eDF: torch.Tensor, w_down_eFD: torch.Tensor,
                weight_eN: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Every local expert on every slot, static shapes (batched GEMMs over the e experts).
    ``x``: [e, N, D] (each expert its own slots) -> [e, N, D]; or [N, D] (rows every expert
    reads, each expert's output weighted by ``weight_eN``, 0 for an expert a row does not
    use) -> [N, D], the weighted sum over the experts."""
    h_eNF = nnf.silu(torch.matmul(x, w_gate_eDF)) * torch.matmul(x, w_up_eDF)
    if x.dim() == 3:
        return torch.bmm(h_eNF, w_down_eFD)
    return torch.bmm(h_eNF * weight_eN.unsqueeze(2), w_down_eFD).sum(0)


def with_trash_row(x_RD: torch.Tensor) -> torch.Tensor:
    """``x_RD`` with one zero row after its last: where a gather of an absent row reads."""
    return torch.cat([x_RD, x_RD.new_zeros((1,) + tuple(x_RD.shape[1:]))])


class StaticDispatch(ABC):
    """Mixin of a split dispatcher with a static mode (listed before
    :class:`occult.ep.dispatcher.SplitDispatcher`): ``forward_moe`` runs the static path
    when :func:`runs_static`, each part timed as the dynamic one's (dispatch, experts,
    combine)."""

    def forward_moe(self, x_TD, topk_ids_TK, topk_weights_TK, experts, *, layer=0, recorder=None):
        if not runs_static(self.config):
            return super().forward_moe(x_TD, topk_ids_TK, topk_weights_TK, experts, layer=layer, recorder=recorder)
        rec = recorder
        M = capacity(self.config, x_TD.shape[0], layer, self.ep.rank)
        with span(rec, layer, "dispatch"):
            routed, handle = self.static_dispatch(x_TD, topk_ids_TK, topk_weights_TK, M, layer=layer, recorder=rec)
        with span(rec, layer, "experts"):
            y = self.static_experts(experts, routed, handle)
        backward_span(rec, layer, "experts", routed, y)
        with span(rec, layer, "combine"):
            return self.static_combine(y, handle)

    @abstractmethod
    def static_dispatch(self, x_TD, topk_ids_TK, topk_weights_TK, M: int, *, layer: int,
                        recorder: Optional[Recorder]):
        """``(routed, handle)``: the rows the experts step reads and what combine needs."""

    @abstractmethod
    def static_experts(self, experts, routed, handle):
        """The local experts on the received fixed buffer: their (merged) outputs."""

    @abstractmethod
    def static_combine(self, y, handle):
        """The outputs back to their tokens: [T, D]."""

    @abstractmethod
    def static_plan(self, topk_ids_TK, *, rank: int, shape) -> list:
        """The static path's collectives (fixed rows per destination, whatever the routing)."""


@dataclass(frozen=True)
class PairHandle:
    """What the static pair path's combine needs."""

    row_TK: torch.Tensor        # send-buffer row of each pair (P S: a dropped pair, the trash row)
    weight_TK: torch.Tensor     # gate weights
    pos_R: torch.Tensor         # each received row's place among the [e, N] expert slots (e N: padding)
    send_valid_R: torch.Tensor  # which rows this rank sent were valid
    recv_valid_R: torch.Tensor  # which rows it received were valid
    layer: int
    recorder: Optional[Recorder]


def pair_slots(topk_ids_TK: torch.Tensor, placement, M: int, rank: int = 0) -> tuple:
    """Where each (token, k) pair goes in the send buffer: ``(row_TK, slot_TK, S)``; token t's
    j-th pair on device p takes row ``p S + t Kd + j`` (Kd = min(K, e), S = Kd M); a dropped
    pair (id -1) row ``P S`` (the trash row). ``slot_TK``: the local expert (slot) it uses;
    on a slot placement, the copy the replica rule picks for tokens sent by ``rank``."""
    T, K = topk_ids_TK.shape
    P, e = placement.num_devices, placement.num_local
    Kd = min(K, e)
    S = Kd * M
    keep_TK = topk_ids_TK >= 0
    dev_TK, slot_TK = placement.pair_local(topk_ids_TK, home_of(topk_ids_TK, rank))
    dev_TK = torch.where(keep_TK, dev_TK, torch.full_like(dev_TK, -1))
    same_TKK = (dev_TK.unsqueeze(2) == dev_TK.unsqueeze(1)) & keep_TK.unsqueeze(1)
    earlier_KK = torch.ones(K, K, dtype=torch.bool, device=dev_TK.device).tril(-1)
    j_TK = (same_TKK & earlier_KK).sum(2)
    tok_T1 = torch.arange(T, device=dev_TK.device).unsqueeze(1)
    row_TK = torch.where(keep_TK, dev_TK * S + tok_T1 * Kd + j_TK, torch.full_like(dev_TK, P * S))
    return row_TK, slot_TK, S


class StaticPairs(StaticDispatch):
    """The static path of a row per (token, expert) pair (naive EP; the module docstring)."""

    def static_dispatch(self, x_TD, topk_ids_TK, topk_weights_TK, M, *, layer, recorder):
        P, e = self.placement.num_devices, self.placement.num_local
        T, K = topk_ids_TK.shape
        D = x_TD.shape[1]
        row_TK, slot_TK, S = pair_slots(topk_ids_TK, self.placement, M, self.ep.rank)
        # each pair's row: its token's D values and its local expert (the valid mark: -1 is padding)
        rows_QX = torch.cat([x_TD.unsqueeze(1).expand(T, K, D), slot_TK.to(x_TD.dtype).unsqueeze(2)], 2)
        empty = x_TD.new_zeros(P * S + 1, D + 1)
        empty[:, D] = -1
        send_RX = empty.index_copy(0, row_TK.flatten(), rows_QX.reshape(T * K, D + 1))[:P * S]
        marks = lambda rows: rows[:, D].detach() >= 0
        recv_RX = all_to_all_fixed(send_RX, marks, self.ep, Exchange(layer, "dispatch", recorder, meta_cols=1),
                                   valid_back=marks)
        # the received rows laid out as [e, N] expert slots: slot (s, source j, token t)
        N = P * M
        slot_R = recv_RX[:, D].detach().long()
        valid_R = slot_R >= 0
        r_R = torch.arange(P * S, device=slot_R.device)
        pos_R = torch.where(valid_R, slot_R * N + (r_R // S) * M + (r_R % S) // max(S // M, 1),
                            torch.full_like(slot_R, e * N))
        x_eND = recv_RX.new_zeros(e * N + 1, D).index_copy(0, pos_R, recv_RX[:, :D])[:e * N].view(e, N, D)
        handle = PairHandle(row_TK, topk_weights_TK, pos_R, marks(send_RX), valid_R, layer, recorder)
        return x_eND, handle

    def static_experts(self, experts, x_eND, handle: PairHandle):
        return slot_swiglu(x_eND, experts.w_gate, experts.w_up, experts.w_down)

    def static_combine(self, y_eND, handle: PairHandle):
        D = y_eND.shape[2]
        y_RD = with_trash_row(y_eND.reshape(-1, D)).index_select(0, handle.pos_R)
        back_RD = all_to_all_fixed(y_RD, handle.recv_valid_R, self.ep,
                                   Exchange(handle.layer, "combine", handle.recorder),
                                   valid_back=handle.send_valid_R)
        T, K = handle.row_TK.shape
        got_TKD = with_trash_row(back_RD).index_select(0, handle.row_TK.flatten()).view(T, K, D)
        return (got_TKD * handle.weight_TK.to(got_TKD.dtype).unsqueeze(2)).sum(1)

    def static_plan(self, topk_ids_TK, *, rank, shape):
        P, e = self.placement.num_devices, self.placement.num_local
        S = min(topk_ids_TK.shape[1], e) * self.config.max_tokens_per_rank
        d_bytes, d_meta = wire_row_bytes("fp32", shape.hidden, 1, shape.element_bytes)
        c_bytes, _ = wire_row_bytes("fp32", shape.hidden, 0, shape.element_bytes)
        return [sends("dispatch", rank, [S] * P, d_bytes, meta_row_bytes=d_meta), returned("combine", 1, c_bytes)]
