"""system=exflow: ExFlow's context-coherent expert parallelism (the harness's implementation).

ExFlow (Yao et al., "Exploiting Inter-Layer Expert Affinity for Accelerating
MoE Model Inference") keeps the whole context on every device, so a token
need not go back to the device it came from after its experts: the device
that holds its output owns the token for the next layer, where attention and
the router run. One all-to-all per MoE layer replaces the usual two.

What this dispatcher runs (every collective below is real and accounted):

  sender    route; the token's *new home* is the device of its highest-weight
            expert (first slot on ties); one row per (token, expert), ordered by
            (destination, local expert), with its gate weight beside it
  exchange  ``dispatch`` (rows) + ``dispatch_meta`` (gate weights); for K > 1
            also ``dispatch_index`` (token index at home, new home: two int64)
  receiver  experts; each output weighted by its gate weight, and rows of the
            same token summed on the receiver (pre-aggregation: one partial
            per (token, device))
  K > 1     ``combine``: every partial goes to the token's new home (the
            partial computed on the new home itself is the collective's local
            block, not a transfer) with ``combine_meta`` (the token's home rank
            and index); the new home sums them: the token's full output now
            sits on its new home. This combine rule for top-k > 1 is defined
            here (ExFlow's one all-to-all is a top-1 property): K > 1 cannot
            do without a second leg, as the token's experts sit on several
            devices, but it moves one row per (token, device other than the
            new home) instead of one per (token, expert) to the original home.
  K = 1     no combine leg: the expert's device holds the token's output.
  harness   ``return_home``: the new home sends the output to the token's
            original rank. ExFlow does not send this: under context coherence
            the new home keeps the token. The harness's Dispatcher contract
            (``combine`` returns the outputs of this rank's tokens, which the
            replicated attention and the parity check need) does, so the leg
            runs, is logged under its own phase name, and is counted per layer
            in the counter ``return_rows_avoided`` (this rank's tokens whose
            new home is another rank: the remote rows of that leg).

So ExFlow's communication is the ``dispatch*`` (and for K > 1 ``combine*``)
phases; ``return_home`` is the harness's cost, never ExFlow's. What is
*modelled, not run*: the context coherence itself (the all-gather of the
prompts once and of every new token after each decode step, and attention
computed on whichever device holds the token). The inter-layer hop that
placement by affinity saves is a function of routing and placement, computed
in :mod:`baselines.exflow_placement`; in this harness a token always enters a
layer from its original rank.

Times: the layer's ``combine`` span includes the ``return_home`` leg; its
collective is timed apart (``a2a_time`` rows with phase ``return_home``).
ExFlow is an inference scheme; the backward pass runs (the transposed
collectives of every differentiable leg) so that gradients can be checked.

Exactness: every step is an exact regrouping of top-k MoE (gate weights
applied once, on the expert's device), so the output equals the single-device
reference to rounding, forward and backward, for every K and placement.

Placement: contiguous, or per layer from a placement artifact
(``placement_file``, written by :mod:`baselines.exflow_placement` or any
optimiser through :func:`occult.placement.save_placements`).

Shapes: T tokens, K top-k, D hidden, P ranks, e local experts, R received
rows (source-major), Q the same rows grouped by local expert, Z partials
(token, device) on the expert's device, F tokens whose new home is this rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from occult.ep import Exchange, Placement, Recorder, SplitDispatcher, all_to_all_rows, exchange_counts
from occult.ep.plan import forwarded, metadata_sends, returned, sends
from occult.placement.files import PlacementFileConfig
from occult.ep.permute import (expert_major_order, gather_rows, inverse_permutation, scatter_add_rows,
                               sort_pairs_by_destination, weighted_scatter_add)
from occult.ep.capabilities import Capabilities

RETURN_PHASE = "return_home"
# the dtype of the index rows (token index, rank) that travel beside the rows
INDEX_DTYPE = torch.long


@dataclass(frozen=True)
class ExFlowHandle:
    """What combine needs. ``part_Q``/``partial_dest_Z``/``partial_key_Z2`` are set for K > 1."""

    perm_R: torch.Tensor          # received (source-major) rows -> expert-major order
    weight_Q: torch.Tensor        # gate weight of each expert-major row
    recv_P: list                  # rows received from each rank (dispatch)
    send_P: list                  # rows sent to each rank (dispatch)
    token_R: torch.Tensor         # home token of each sent row (send order)
    new_home_T: torch.Tensor      # device of each home token's highest-weight expert
    part_Q: Optional[torch.Tensor]            # partial of each expert-major row (K > 1)
    partial_dest_Z: Optional[torch.Tensor]    # new home of each partial (K > 1)
    partial_key_Z2: Optional[torch.Tensor]    # (home rank, token index) of each partial (K > 1)
    num_tokens: int
    top_k: int
    layer: int
    recorder: Optional[Recorder]


def new_home_device(topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, placement: Placement
                    ) -> torch.Tensor:
    """ExFlow's owner of each token after the layer: the device of its highest-weight
    expert (the first such slot on ties): shape [T] (long)."""
    if topk_ids_TK.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=topk_ids_TK.device)
    top_T = topk_weights_TK.detach().argmax(dim=1, keepdim=True)
    return placement.device_E[topk_ids_TK.gather(1, top_T).squeeze(1)]


def _group_keys(key_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct keys in ascending order, and the group of every row: ``(keys_Z, group_R)``."""
    keys_Z, group_R = torch.unique(key_R, sorted=True, return_inverse=True)
    return keys_Z, group_R


def partial_traffic(device_R: torch.Tensor, token_R: torch.Tensor, new_home_T: torch.Tensor, world_size: int
                    ) -> torch.Tensor:
    """The ``combine`` leg's rows that one rank's tokens cause, [P, P]: each of its sent rows
    (token ``token_R`` to device ``device_R``) makes one partial per (token, device), which
    that device sends to the token's new home (the rule of :meth:`ExFlowDispatcher._partials`,
    seen from the tokens' home)."""
    P, T = world_size, max(new_home_T.numel(), 1)
    keys_Z, _ = _group_keys(device_R * T + token_R)
    pair_Z = (keys_Z // T) * P + new_home_T[keys_Z % T]
    return torch.bincount(pair_Z, minlength=P * P).view(P, P)


class ExFlowDispatcher(SplitDispatcher):
    """ExFlow's context-coherent scheme; ``placement_file``: a placement artifact (JSON from
    :func:`occult.placement.save_placements`) whose per-layer groups this system runs with;
    null: contiguous placement."""

    capabilities = Capabilities(
        impl="harness", precision="float64", expert_parallel=True, exact_forward=True, exact_backward=True,
        static_dispatch="it has no fixed-buffer dispatch (only naive EP's and Occult's exchanges have one)",
        co_execution=True,
        yields=True,
        traffic_plan=True,
        migration=True,
        replica_rules=(), payloads=("fp32",), dropped_pairs=False,
        shortcut_overlap=False)

    @dataclass
    class Config(PlacementFileConfig):
        """``placement_file``: a placement artifact (e.g. from baselines.exflow_placement);
        null: contiguous (:class:`occult.placement.files.PlacementFileConfig`)."""

    # ------------------------------------------------------------------ dispatch

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK, *, layer=0, recorder=None):
        T, K = topk_ids_TK.shape
        rec = recorder
        new_home_T = new_home_device(topk_ids_TK, topk_weights_TK, self.placement)
        order_R, send_Pe = sort_pairs_by_destination(topk_ids_TK, self.placement)
        recv_Pe = exchange_counts(send_Pe, self.ep, Exchange(layer, "counts", rec))
        # device-to-host sync: split sizes go to the collective as Python ints
        send_P, recv_P = send_Pe.sum(1).tolist(), recv_Pe.sum(1).tolist()
        token_R = order_R // K
        x_recv_RD = all_to_all_rows(gather_rows(x_TD, token_R), send_P, recv_P, self.ep,
                                    Exchange(layer, "dispatch", rec))
        w_R1 = topk_weights_TK.to(x_TD.dtype).flatten()[order_R].unsqueeze(1)
        w_recv_R1 = all_to_all_rows(w_R1, send_P, recv_P, self.ep, Exchange(layer, "dispatch_meta", rec))
        perm_R = expert_major_order(recv_Pe)
        weight_Q = w_recv_R1[perm_R, 0]
        part_Q = partial_dest_Z = partial_key_Z2 = None
        if K > 1:
            index_R2 = torch.stack([token_R, new_home_T[token_R]], dim=1)
            index_recv_R2 = all_to_all_rows(index_R2, send_P, recv_P, self.ep,
                                            Exchange(layer, "dispatch_index", rec))
            part_R, partial_dest_Z, partial_key_Z2 = self._partials(index_recv_R2, recv_P)
            part_Q = part_R[perm_R]
        handle = ExFlowHandle(perm_R, weight_Q, recv_P, send_P, token_R, new_home_T, part_Q, partial_dest_Z,
                              partial_key_Z2, T, K, layer, rec)
        return gather_rows(x_recv_RD, perm_R), recv_Pe.sum(0), handle

    def _partials(self, index_recv_R2: torch.Tensor, recv_P: list
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Groups the received rows into one partial per (token, this device), ordered by
        (new home, home rank, token index). Returns the partial of every received row [R],
        each partial's new home [Z] and its (home rank, token index) [Z, 2]."""
        P = self.ep.world_size
        dev = index_recv_R2.device
        src_R = torch.repeat_interleave(torch.arange(P, device=dev), torch.tensor(recv_P, dtype=torch.long, device=dev))
        token_R, dest_R = index_recv_R2[:, 0], index_recv_R2[:, 1]
        span_T = int(token_R.max()) + 1 if token_R.numel() else 1
        keys_Z, part_R = _group_keys((dest_R * P + src_R) * span_T + token_R)
        key_Z2 = torch.stack([(keys_Z // span_T) % P, keys_Z % span_T], dim=1)
        return part_R, keys_Z // (span_T * P), key_Z2

    # ------------------------------------------------------------------- combine

    def combine(self, y_QD, handle: ExFlowHandle):
        if handle.top_k == 1:
            at_new_home_RD = weighted_scatter_add(sum(handle.recv_P), handle.perm_R, y_QD, handle.weight_Q)
            return self._return_single(at_new_home_RD, handle)
        at_new_home_FD, home_F = self._merge_at_new_home(y_QD, handle)
        return self._return_merged(at_new_home_FD, home_F, handle)

    def plan(self, topk_ids_TK, topk_weights_TK, *, rank, shape, facts_PX=None, training=True):
        """``counts``, ``dispatch`` (a row per pair), ``dispatch_meta`` (its gate weight) and,
        for K > 1, ``dispatch_index`` (two int64), a second ``counts``, ``combine`` and
        ``combine_meta`` (a partial per (token, device) to the token's new home, with its
        home rank and index) and ``return_home`` (each token from its new home to its home);
        for K = 1 ``return_home`` returns the dispatch."""
        P, e, K = self.ep.world_size, self.placement.num_local, topk_ids_TK.shape[1]
        x_bytes, index_bytes = shape.bytes_of(shape.hidden), 2 * INDEX_DTYPE.itemsize
        order_R, send_Pe = sort_pairs_by_destination(topk_ids_TK, self.placement)
        send_P = send_Pe.sum(1)
        out = [metadata_sends("counts", rank, [1] * P, e * send_Pe.element_size()),
               sends("dispatch", rank, send_P, x_bytes), sends("dispatch_meta", rank, send_P, shape.bytes_of(1))]
        if K == 1:
            return out + [returned(RETURN_PHASE, 2, x_bytes)]
        new_home_T = new_home_device(topk_ids_TK, topk_weights_TK, self.placement)
        device_R = self.placement.device_E[topk_ids_TK.flatten()[order_R]]
        rows_PP = partial_traffic(device_R, order_R // K, new_home_T, P)
        all_P = torch.arange(P, device=rows_PP.device)
        home_PP = torch.zeros_like(rows_PP)
        home_PP[:, rank] = torch.bincount(new_home_T, minlength=P)
        return out + [sends("dispatch_index", rank, send_P, index_bytes, differentiable=False),
                      metadata_sends("counts", rank, [1] * P, send_Pe.element_size()),
                      forwarded("combine", all_P, rows_PP, x_bytes),
                      forwarded("combine_meta", all_P, rows_PP, index_bytes, differentiable=False),
                      forwarded(RETURN_PHASE, all_P, home_PP, x_bytes)]

    def _merge_at_new_home(self, y_QD: torch.Tensor, handle: ExFlowHandle
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """K > 1, ExFlow's combine: gate-weighted partials per (token, device), sent to the
        token's new home and summed there. Returns the full outputs of the tokens this rank
        now owns, ordered by (home rank, token index), and their home ranks [F]."""
        P, rec, layer = self.ep.world_size, handle.recorder, handle.layer
        Z = handle.partial_dest_Z.numel()
        partial_ZD = weighted_scatter_add(Z, handle.part_Q, y_QD, handle.weight_Q)
        send_P = torch.bincount(handle.partial_dest_Z, minlength=P)
        recv_P = exchange_counts(send_P.view(-1, 1), self.ep, Exchange(layer, "counts", rec)).flatten().tolist()
        send_P = send_P.tolist()
        got_ZD = all_to_all_rows(partial_ZD, send_P, recv_P, self.ep, Exchange(layer, "combine", rec))
        key_recv_Z2 = all_to_all_rows(handle.partial_key_Z2, send_P, recv_P, self.ep,
                                      Exchange(layer, "combine_meta", rec))
        span_T = int(key_recv_Z2[:, 1].max()) + 1 if key_recv_Z2.numel() else 1
        keys_F, final_Z = _group_keys(key_recv_Z2[:, 0] * span_T + key_recv_Z2[:, 1])
        return scatter_add_rows(keys_F.numel(), final_Z, got_ZD), keys_F // span_T

    def _return_single(self, at_new_home_RD: torch.Tensor, handle: ExFlowHandle) -> torch.Tensor:
        """K = 1, harness only: the received rows' outputs go back the way they came."""
        back_RD = all_to_all_rows(at_new_home_RD, handle.recv_P, handle.send_P, self.ep,
                                  Exchange(handle.layer, RETURN_PHASE, handle.recorder))
        return scatter_add_rows(handle.num_tokens, handle.token_R, back_RD)

    def _return_merged(self, at_new_home_FD: torch.Tensor, home_F: torch.Tensor,
                       handle: ExFlowHandle) -> torch.Tensor:
        """K > 1, harness only: each owned token's output goes to its original rank, which
        receives its tokens ordered by (new home, token index)."""
        P = self.ep.world_size
        send_P = torch.bincount(home_F, minlength=P).tolist()
        recv_P = torch.bincount(handle.new_home_T, minlength=P).tolist()
        back_TD = all_to_all_rows(at_new_home_FD, send_P, recv_P, self.ep,
                                  Exchange(handle.layer, RETURN_PHASE, handle.recorder))
        arrival_T = torch.argsort(handle.new_home_T, stable=True)
        return gather_rows(back_TD, inverse_permutation(arrival_T))

    def stats(self, handle: ExFlowHandle) -> dict:
        """``return_rows_avoided``: this rank's tokens that ExFlow leaves on another rank
        (the remote rows of the harness's ``return_home`` leg)."""
        return {"return_rows_avoided": int((handle.new_home_T != self.ep.rank).sum())}
