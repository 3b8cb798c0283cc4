"""Naive expert parallelism: one row per (token, expert) pair.

Exchange per-(destination, local expert) counts, one variable-split
all-to-all of the pair rows, the experts, the reverse all-to-all, and the
gate-weighted sum on the home rank. Differentiable: the backward pass runs the
transposed all-to-alls (see :mod:`occult.ep.comm`).

Shapes: T tokens, K top-k, D hidden, P ranks, e local experts, R rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from occult.ep import Exchange, Recorder, SplitDispatcher, all_to_all_rows, exchange_counts
from occult.ep.payload import wire_row_bytes
from occult.ep.plan import Planned, RowShape, metadata_sends, returned, sends
from occult.ep.static import StaticConfig, StaticPairs, runs_static
from occult.ep.system import PayloadConfig, ReplicaConfig
from occult.ep.permute import (expert_major_order, gather_rows, inverse_permutation, sort_pairs_by_destination,
                               weighted_scatter_add)
from occult.ep.capabilities import Capabilities
from occult.ep.payload import PAYLOADS
from occult.ep.replica_rules import REPLICA_POLICIES


def pair_exchange_plan(send_Pe: torch.Tensor, rank: int, shape: RowShape, dispatch_payload: str = "fp32",
                       combine_payload: str = "fp32") -> list[Planned]:
    """The plan of naive EP's exchange from a rank's pairs per (destination, local expert)
    ``send_Pe`` [P, e] (:func:`occult.ep.permute.sort_pairs_by_destination`): ``counts``
    (the [P, e] counts, one int64 row to each rank), ``dispatch`` (a row per pair) and
    ``combine`` (the dispatch returned), rows crossing in their payloads."""
    P, e = send_Pe.shape
    d_bytes, d_meta = wire_row_bytes(dispatch_payload, shape.hidden, 0, shape.element_bytes)
    c_bytes, c_meta = wire_row_bytes(combine_payload, shape.hidden, 0, shape.element_bytes)
    return [metadata_sends("counts", rank, [1] * P, e * send_Pe.element_size()),
            sends("dispatch", rank, send_Pe.sum(1), d_bytes, meta_row_bytes=d_meta),
            returned("combine", 1, c_bytes, meta_row_bytes=c_meta)]


@dataclass(frozen=True)
class NaiveHandle:
    """What combine needs: how rows were sent, and how to fold them back at home."""

    token_R: torch.Tensor          # home token of each sent row (send order)
    weight_R: torch.Tensor         # gate weight of each sent row (send order)
    inv_perm_R: torch.Tensor       # expert-major received rows -> (source, slot) order
    send_P: list
    recv_P: list
    num_tokens: int
    layer: int
    recorder: Optional[Recorder]


class NaiveDispatcher(StaticPairs, SplitDispatcher):
    """Naive EP; ``payload``: how the rows cross (fp32: as they are; bf16, int8, fp8:
    compressed, see :mod:`occult.ep.payload`). Runs on a slot placement too (EPLB's: each pair
    to the copy that ``replica_policy`` picks, :mod:`occult.ep.replica_rules`).
    ``dispatch_mode=static``: fixed buffers of min(K, e) x ``max_tokens_per_rank`` slots per
    destination, no counts exchange, no host read (:mod:`occult.ep.static`)."""

    capabilities = Capabilities(
        impl="harness", precision="float64", expert_parallel=True, exact_forward=True, exact_backward=True,
        static_dispatch=True,
        co_execution=True,
        yields=True,
        traffic_plan=True,
        migration=True,
        replica_rules=REPLICA_POLICIES, payloads=PAYLOADS, dropped_pairs=True,
        shortcut_overlap=False)

    @dataclass
    class Config(StaticConfig, ReplicaConfig, PayloadConfig):
        """Naive EP's dispatch mode, replica rule and payloads."""

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK, *, layer=0, recorder=None):
        K = topk_ids_TK.shape[1]
        order_R, send_Pe = sort_pairs_by_destination(topk_ids_TK, self.placement, home=self.ep.rank)
        recv_Pe = exchange_counts(send_Pe, self.ep, Exchange(layer, "counts", recorder))
        # device-to-host sync: split sizes go to the collective as Python ints
        send_P, recv_P = send_Pe.sum(1).tolist(), recv_Pe.sum(1).tolist()
        token_R = order_R // K
        x_recv_RD = all_to_all_rows(gather_rows(x_TD, token_R), send_P, recv_P, self.ep,
                                    Exchange(layer, "dispatch", recorder), self.config.payload_of("dispatch"))
        perm_R = expert_major_order(recv_Pe)
        handle = NaiveHandle(token_R, topk_weights_TK.flatten()[order_R], inverse_permutation(perm_R),
                             send_P, recv_P, x_TD.shape[0], layer, recorder)
        return gather_rows(x_recv_RD, perm_R), recv_Pe.sum(0), handle

    def plan(self, topk_ids_TK, topk_weights_TK, *, rank, shape, facts_PX=None, training=True):
        if runs_static(self.config):
            return self.static_plan(topk_ids_TK, rank=rank, shape=shape)
        _, send_Pe = sort_pairs_by_destination(topk_ids_TK, self.placement, home=rank)
        return pair_exchange_plan(send_Pe, rank, shape, self.config.payload_of("dispatch"),
                                  self.config.payload_of("combine"))

    def combine(self, y_RD, handle: NaiveHandle):
        y_back_RD = all_to_all_rows(gather_rows(y_RD, handle.inv_perm_R), handle.recv_P, handle.send_P, self.ep,
                                    Exchange(handle.layer, "combine", handle.recorder),
                                    self.config.payload_of("combine"))
        return weighted_scatter_add(handle.num_tokens, handle.token_R, y_back_RD, handle.weight_R)
